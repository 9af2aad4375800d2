"""A few thousand hostile messages against a running launch_impala while an honest actor trains
: the learner stays up, its memory stays bounded, the honest actor's frames keep coming,
every bad unroll is dropped and counted, and the loss stays finite."""

from __future__ import annotations

import ast
import csv
import json
import math
import os
import re
import signal
import time

import numpy as np
import zmq

from actors.remote import fetch_run_info
from impala.transport import wire
from impala.transport.trajectory import impala_unroll_schema
from procs import free_port_pair, kill_group, push_socket, signal_and_wait, start, wait_for

T = 20
HONEST_FRAMES = 10000  # the honest actor's frames past the flood before the run is stopped (500 unrolls)
SCHEMA = impala_unroll_schema(T, (4,), "float32", 2)


def _last(metrics, key: str) -> float:
    with open(metrics) as f:
        rows = [r for r in csv.DictReader(f) if r.get(key)]
    return float(rows[-1][key]) if rows else 0.0


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"VmRSS:\s+(\d+)", f.read()).group(1))


def _hostile_messages(rng: np.random.Generator, n: int, run_id: str) -> list[list[bytes]]:
    good = SCHEMA.allocate()
    good["obs"][:] = rng.standard_normal(good["obs"].shape)
    # The run id is public (every weights message carries it); the local actors' token is not.
    base = [bytes(f) for f in wire.encode("unroll", actor=0, version=0, arrays=good, info={"run_id": run_id})]
    out = []
    for i in range(n):
        kind = i % 8
        frames = list(base)
        if kind == 0:  # a well-formed unroll in the local actor's name, without its token
            pass
        elif kind == 1:  # truncated array frame
            frames[1] = frames[1][: rng.integers(0, len(frames[1]))]
        elif kind == 2:  # random garbage header
            frames[0] = rng.bytes(int(rng.integers(1, 200)))
        elif kind == 3:  # NaN in the rewards
            bad = {k: v.copy() for k, v in good.items()}
            bad["rewards"][0] = np.nan
            frames = [bytes(f) for f in wire.encode("unroll", actor=0, version=0, arrays=bad)]
        elif kind == 4:  # a version from the future, from an unknown id
            frames = [
                bytes(f)
                for f in wire.encode(
                    "unroll", actor=int(rng.integers(1, 1 << 20)), version=2**62, arrays=good
                )
            ]
        elif kind == 5:  # forged hello for the local actor, junk fingerprint
            frames = [
                bytes(f) for f in wire.encode("hello", actor=0, version=-1, info={"fingerprint": {"junk": 1}})
            ]
        elif kind == 6:  # wrong dtype declared
            header = json.loads(frames[0])
            header["arrays"][0][1] = "float64"
            frames[0] = json.dumps(header).encode()
        else:  # oversized
            frames = frames + [b"\0" * (SCHEMA.nbytes + 8192)]
        out.append(frames)
    return out


def test_live_fuzz_against_a_running_learner(tmp_path):
    port = free_port_pair()
    learner = start(
        [
            *"launch_impala --env CartPole-v1 --workers 1 --unroll-length".split(),
            str(T),
            "--batch-size",
            "8",
            "--port",
            str(port),
            *"--total-frames 10000000 --max-seconds 170 --no-progress --log-interval 2 --logdir".split(),
            str(tmp_path),
        ]
    )
    sock = push_socket(port, sndhwm=100000)
    n = 3000
    try:
        metrics = tmp_path / "metrics.csv"
        assert wait_for(lambda: metrics.exists() and metrics.stat().st_size > 0, 90), "the run never started"
        run_id = fetch_run_info(f"tcp://127.0.0.1:{port + 1}", 30).run_id
        time.sleep(1.0)  # let the PUSH connection finish its handshake before the flood
        rss_start = _rss_kib(learner.pid)
        t0 = time.monotonic()
        for frames in _hostile_messages(np.random.default_rng(0), n, run_id):
            sock.send_multipart(frames)
        sent_s = time.monotonic() - t0
        frames_at_flood = _last(metrics, "charts/env_frames")
        hostile_unrolls = n - n // 8  # the hellos among them are refused and logged instead
        # The receive thread shares the GIL with training: let it drain the flood, then stop the run.
        assert wait_for(lambda: _last(metrics, "transport/dropped") >= hostile_unrolls, 120), _last(
            metrics, "transport/dropped"
        )
        # ... and the honest actor keeps training through and after it
        assert wait_for(lambda: _last(metrics, "charts/env_frames") >= frames_at_flood + HONEST_FRAMES, 60)
        rss_after = _rss_kib(learner.pid)
        out = signal_and_wait(learner, signal.SIGINT)
    finally:
        sock.close()
        kill_group(learner)
    assert learner.returncode == 0, out[-3000:]
    done = [line for line in out.splitlines() if line.startswith("launch_impala: done")][-1]
    assert int(re.search(r"done: (\d+) env frames", done).group(1)) >= frames_at_flood + HONEST_FRAMES, done
    with open(tmp_path / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    assert all(math.isfinite(float(r["losses/total"])) for r in rows if r.get("losses/total"))
    # the final counts (the last CSV row may predate the last drops)
    dropped = ast.literal_eval(re.search(r"dropped (\{.*?\}), actor restarts", done).group(1))
    # Every hostile unroll-kind message is dropped and counted.
    assert sum(dropped.values()) >= hostile_unrolls, dropped
    assert (
        dropped["unverified_local"] >= n // 8
        and dropped["non_finite"] >= n // 8
        and dropped["oversized"] >= n // 8
    ), dropped
    assert rss_after < 1.5 * rss_start, (rss_start, rss_after)
    print(
        f"live fuzz: {n} messages sent in {sent_s:.1f}s, dropped {dropped}, RSS {rss_start} -> {rss_after} "
        "KiB"
    )


def _random_policy_unrolls(n: int) -> list[dict[str, np.ndarray]]:
    """``n`` consecutive unrolls of a uniform-random policy on CartPole-v1, as an actor sends them (a new
    episode's first observation follows an episode end)."""
    import gymnasium as gym

    env, rng = gym.make("CartPole-v1"), np.random.default_rng(3)
    obs, _ = env.reset(seed=3)
    first, out = True, []
    for _ in range(n):
        u = SCHEMA.allocate()
        for t in range(T):
            u["obs"][t], u["first"][t] = obs, first
            u["actions"][t] = rng.integers(2)
            obs, u["rewards"][t], terminated, truncated, _ = env.step(int(u["actions"][t]))
            first = u["dones"][t] = terminated or truncated
            if first:
                obs, _ = env.reset()
        u["obs"][T], u["first"][T] = obs, first
        out.append(u)  # behaviour_logits stay 0: uniform
    env.close()
    return out


def _attacks(port: int, stop, counts: dict) -> None:
    """Every attack of the second hostile-peer probe, mixed, until ``stop``: claimed episode statistics from
    an
    accepted id, a flooding accepted id (with behaviour logits at the receive bound now and then), forged
    hellos
    for the local actor and for the flooder's id, and malformed messages."""
    import threading

    from actors.remote import fetch_run_info
    from impala.envs import EnvSpec
    from impala.envs.probe import measure_env_fingerprint

    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 5)
    run_id = fetch_run_info(f"tcp://127.0.0.1:{port + 1}", 60).run_id
    real = measure_env_fingerprint(EnvSpec("CartPole-v1"), seed=7).to_dict()  # anyone can measure it
    sock = push_socket(port, sndhwm=2000)

    def send(kind, actor, arrays=None, info=None, version=0):
        try:
            sock.send_multipart(
                [bytes(f) for f in wire.encode(kind, actor=actor, version=version, arrays=arrays, info=info)],
                zmq.NOBLOCK,
            )
            counts[kind] = counts.get(kind, 0) + 1
        except zmq.Again:
            pass

    # The flooder's and the claimers' unrolls are a uniform-random CartPole policy's real transitions:
    # accepted ids' data is trained on (within their share), so zeroed observations with one action and no
    # reward would be data poisoning, which no receive check can tell from an honest actor's data (only
    # keys keep such peers out). What this run checks is the transport's defences, not immunity to poison.
    random_unrolls = _random_policy_unrolls(64)
    huge = SCHEMA.allocate()
    huge["behaviour_logits"][..., 0], huge["behaviour_logits"][..., 1] = 1e6, -1e6
    huge["actions"][:] = 1  # the action the huge logits call impossible
    garbage = _hostile_messages(np.random.default_rng(1), 400, run_id)
    send("hello", 4000, info={"fingerprint": real, "num_envs": 1})  # the flooder, accepted
    i = 0
    try:
        while not stop.is_set():
            if i % 50 == 0:  # a new id claims 100 episodes of return 500 (stop-at-return 195 would fire)
                actor = 3000 + i // 50
                send("hello", actor, info={"fingerprint": real, "num_envs": 1})
                send(
                    "unroll",
                    actor,
                    random_unrolls[i % len(random_unrolls)],
                    {
                        "run_id": run_id,
                        "env": 0,
                        "episode_returns": [500.0] * 100,
                        "episode_lengths": [500] * 100,
                    },
                )
            if i % 25 == 0:  # forged hellos: in the local actor's name, and the flooder's with junk
                send("hello", 0, info={"fingerprint": {"junk": 1}})
                send("hello", 4000, info={"fingerprint": {"junk": 1}})
                send("hello", 4000, info={"fingerprint": real, "num_envs": 1})  # and back
            flood = huge if i % 10 == 0 else random_unrolls[i % len(random_unrolls)]
            send("unroll", 4000, flood, {"run_id": run_id, "env": 0})
            sock.send_multipart(garbage[i % len(garbage)], zmq.NOBLOCK) if i % 3 == 0 else None
            i += 1
            time.sleep(0.005)  # ~200 messages/s of unrolls, more with the rest
    except zmq.ZMQError:
        pass
    finally:
        sock.close()


def test_an_honest_cartpole_run_learns_to_195_with_the_attacks_mixed_in(tmp_path):
    """The honest actors' run reaches --stop-at-return 195 on their own episodes (the claimed ones would
    have ended it at once), trains through a flooding id, forged hellos, logits at the bound and garbage,
    and the checkpoint it leaves plays CartPole well. Two honest actors: the flooder's fair share is a
    third of the batches, not half, so the run needs fewer frames (it still trains on the flood)."""
    import threading

    from learner.cli.eval_cli import main as impala_eval

    port = free_port_pair()
    learner = start(
        ["launch_impala", "--env", "CartPole-v1", "--workers", "2", "--unroll-length", str(T),
         "--batch-size", "8", "--minibatches", "4", "--learning-rate", "2e-3", "--port", str(port),
         "--total-frames", "3000000",
         "--max-seconds", "300", "--stop-at-return", "195", "--no-progress", "--log-interval", "2",
         "--logdir", str(tmp_path / "run")]
    )  # fmt: skip
    stop, counts = threading.Event(), {}
    attacker = threading.Thread(target=_attacks, args=(port, stop, counts), daemon=True)
    try:
        attacker.start()
        out, _ = learner.communicate(timeout=360)
    finally:
        stop.set()
        attacker.join(timeout=10)
        kill_group(learner)
    assert learner.returncode == 0, out[-3000:]
    done = [line for line in out.splitlines() if line.startswith("launch_impala: done")][-1]
    assert "stopped at --stop-at-return 195" in done, done
    frames = int(re.search(r"done: (\d+) env frames", done).group(1))
    dropped = ast.literal_eval(re.search(r"dropped (\{.*?\}), actor restarts", done).group(1))
    # learning CartPole takes tens of thousands of frames; the claimed episodes stopped a run at once
    assert frames > 20_000, done
    # the attacks ran all along: the flooder's unrolls, its logits at the bound dropped (schema), the forged
    # local hellos' unverified unrolls and the garbage dropped and counted
    assert (
        counts.get("unroll", 0) > 500 and dropped.get("schema", 0) > 0 and dropped.get("non_finite", 0) > 0
    ), (counts, dropped)
    rc = impala_eval([str(tmp_path / "run"), "--episodes", "10", "--workers", "0", "--policy", "greedy",
                      "--out", str(tmp_path / "eval.json")])  # fmt: skip
    assert rc == 0
    mean = json.loads((tmp_path / "eval.json").read_text())["mean"]
    assert mean >= 150, mean  # the agent really plays: the run's 195 came from its own episodes
    print(
        f"attacks mixed in: sent {counts}, dropped {dropped}; stopped at {frames} frames; greedy eval "
        f"{mean:.0f}"
    )
