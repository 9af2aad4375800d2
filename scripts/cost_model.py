#!/usr/bin/env python
"""Where every core-millisecond of an IMPALA run goes, and the ceiling that leaves for this machine.

Part 1 times each stage of the pipeline alone, on one core (one torch thread), through the project's
own code, per agent step:

- actor: the env step with its preprocessing (``GymVecEnv``), inference (``ImpalaAgent.act`` on the K
  envs of one actor), the rest of the actor's bookkeeping per step (recording, ``transition``), and
  encoding one unroll for the wire (``wire.encode``);
- learner, receive side: decoding (``wire.decode`` against the schema), the finite and bound checks
  (``check_finite``, ``ImpalaTrainer.validate``);
- learner, update (``ImpalaTrainer.update`` on B unrolls, the defaults' epochs x minibatches), split by
  timing the calls it makes: stacking the unrolls (``stage_host``), rebuilding frame stacks and
  laying them out for the torso (``prepare``), the network's forward pass, V-trace and the loss,
  backward, gradient clipping, the optimizer step, PopArt's statistics, the health metrics, and the
  rest (minibatch indexing, metrics);
- learner, publish: the weights as arrays (``ImpalaTrainer.params``) packed for the wire.

The cost model: each agent step needs the sum of those core-milliseconds, so N cores can do at most
N / sum steps per second (frames: x the frame skip). Part 2 runs ``launch_impala`` with the same
settings for ``--seconds`` (after a 20 s warm-up), times the stages again (a shared host's speed drifts),
and prints its measured rate next to the two ceilings, the ratio to their mean, and where the cores went
meanwhile: each process's CPU time (all its threads) and the time its
threads were runnable but waiting for a CPU, from /proc, per second and per agent step.

    python scripts/cost_model.py --workers 2 --seconds 60
    python scripts/cost_model.py --skip-run            # the breakdown only
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


class Clock:
    """Seconds spent in named stages, by wrapping the callables that do them."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._depth = 0

    @contextlib.contextmanager
    def stage(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - t0

    def wrap(self, name: str, fn: Callable) -> Callable:
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self.stage(name):
                return fn(*args, **kwargs)

        return timed


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError, StopIteration):
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    return f"{os.cpu_count()} cores ({cpu}), torch {torch.__version__}, GPU: none used"


def build(args: argparse.Namespace):
    """The run's configs, env info and trainer exactly as launch_impala resolves them."""
    from impala.envs import EnvSpec
    from impala.envs.probe import probe_env
    from impala.run.config import settle
    from learner.cli import launch_impala
    from learner.vtrace_learner import ImpalaTrainer

    flags = [
        "--env",
        args.env,
        "--envs-per-worker",
        str(args.envs_per_worker),
        "--device",
        "cpu",
        *args.extra,
    ]
    parsed = launch_impala.parse_args(flags)
    run, impala = launch_impala.resolve(parsed)
    env = probe_env(EnvSpec(args.env), seed=0)
    run, impala = settle(run, impala, env.obs_shape, chosen=launch_impala.chosen_options(parsed))
    return run, impala, env, ImpalaTrainer(impala, run, env)


def actor_costs(run, trainer, env_info, unrolls_wanted: int, clock: Clock) -> list[dict[str, np.ndarray]]:
    """One actor's work for ``unrolls_wanted`` unrolls of K envs, timed per stage; returns the unrolls."""
    from actors.agents import make_agent
    from impala.envs import EnvSpec
    from impala.envs.vector import GymVecEnv
    from impala.transport import wire

    K, T = run.envs_per_worker, run.unroll_length
    envs = GymVecEnv(EnvSpec(env_info.spec.id), K, seed=1)
    obs = envs.reset()
    agent = make_agent(trainer.agent, envs=envs, first_obs=obs, unroll_length=T, seed=1)
    agent.load_params(trainer.params())
    first = np.ones(K, dtype=bool)
    unrolls = []
    for _ in range(unrolls_wanted):
        with clock.stage("actor: bookkeeping"):
            buf = {a.name: np.empty((K, *a.shape), dtype=a.dtype) for a in agent.schema.arrays}
            for name, value in agent.unroll_start(obs).items():
                buf[name][:] = value
        for t in range(T):
            with clock.stage("actor: bookkeeping"):
                for name, value in agent.observation(obs, first).items():
                    buf[name][:, t] = value
            with clock.stage("actor: inference"):
                actions, recorded = agent.act(obs, first)
            with clock.stage("actor: env step + preprocessing"):
                result = envs.step(actions)
            with clock.stage("actor: bookkeeping"):
                for name, value in {**recorded, **agent.transition(result)}.items():
                    buf[name][:, t] = value
                obs, first = result.obs, result.terminated | result.truncated
        with clock.stage("actor: bookkeeping"):
            for name, value in agent.observation(obs, first).items():
                buf[name][:, T] = value
        for k in range(K):
            unroll = {name: value[k] for name, value in buf.items()}
            with clock.stage("actor: encode"):
                frames = [bytes(f) for f in wire.encode("unroll", actor=0, version=0, arrays=unroll)]
            unrolls.append(frames)
    envs.close()
    return unrolls


def receive_costs(trainer, encoded: list[list[bytes]], clock: Clock) -> list[Any]:
    """Decoding and checking every unroll as the learner's receive thread does."""
    from impala.transport import wire

    messages = []
    for frames in encoded:
        with clock.stage("learner: receive (decode)"):
            msg = wire.decode(frames, schema=trainer.schema)
        with clock.stage("learner: receive (checks)"):
            assert wire.check_finite(msg.arrays) is None and trainer.validate(msg.arrays) is None
        messages.append(msg)
    return messages


@contextlib.contextmanager
def timed_update_parts(trainer, clock: Clock):
    """Wrap what ``VTraceLearner.step`` / ``ImpalaTrainer.update`` call, for the length of the block."""
    import torch

    from learner import vtrace_learner

    learner = trainer.learner
    saved = []

    def patch(owner: Any, name: str, label: str) -> None:
        original = getattr(owner, name)
        saved.append((owner, name, original, name in vars(owner)))
        setattr(owner, name, clock.wrap(label, original))

    patch(learner, "stage_host", "update: stack unrolls")
    patch(learner, "prepare", "update: rebuild frame stacks, layout")
    patch(learner.model, "forward", "update: forward")
    patch(vtrace_learner, "impala_loss", "update: V-trace + loss")
    patch(vtrace_learner, "vtrace_targets", "update: V-trace + loss")  # per step, or once a batch
    patch(torch.Tensor, "backward", "update: backward")
    patch(torch.nn.utils, "clip_grad_norm_", "update: clip grad norm")
    patch(learner.optimizer, "step", "update: optimizer step")
    patch(learner.model.baseline, "update", "update: PopArt statistics")
    patch(learner.health, "measure", "update: health metrics")
    try:
        yield
    finally:
        for owner, name, original, own in reversed(saved):
            if own:  # a module or class attribute: put it back
                setattr(owner, name, original)
            else:  # an instance attribute shadowing its class's method: remove it
                delattr(owner, name)


def learner_costs(trainer, messages: list[Any], updates: int, clock: Clock) -> int:
    """``updates`` updates on the received unrolls (reused round-robin); returns the agent steps trained."""
    from impala.transport import wire

    B = trainer.config.batch_size
    T = messages[0].arrays["actions"].shape[0]
    with timed_update_parts(trainer, clock):
        for u in range(updates + 1):
            for i in range(B):
                trainer.ingest(messages[(u * B + i) % len(messages)], 0)
            t0 = time.perf_counter()
            trainer.update(frames_done=0)
            if u == 0:  # warm-up: allocations, first-call costs
                clock.seconds.clear()
                continue
            clock.seconds["update: total"] += time.perf_counter() - t0
            with clock.stage("learner: publish weights"):
                wire.encode_packed("params", actor=0, version=u, arrays=trainer.params())
    return updates * B * T


def breakdown(
    args: argparse.Namespace, run: Any, impala: Any, env_info: Any, trainer: Any
) -> list[tuple[str, float]]:
    """Each stage alone on one core: (stage, core-milliseconds per agent step)."""
    K, T, B = run.envs_per_worker, run.unroll_length, impala.batch_size
    clock = Clock()
    unrolls_wanted = max(1, -(-B // K))  # enough for one batch
    encoded = actor_costs(run, trainer, env_info, unrolls_wanted, clock)
    actor_steps = unrolls_wanted * K * T
    messages = receive_costs(trainer, encoded, clock)
    received_steps = len(messages) * T
    actor = {k: v for k, v in clock.seconds.items()}
    clock.seconds.clear()
    trained = learner_costs(trainer, messages, args.updates, clock)

    rows: list[tuple[str, float]] = []  # (stage, core-ms per agent step)
    for name, s in actor.items():
        steps = received_steps if name.startswith("learner") else actor_steps
        rows.append((name, 1e3 * s / steps))
    total_update = clock.seconds.pop("update: total")
    parts = {k: v for k, v in clock.seconds.items() if k.startswith("update: ")}
    for name, s in parts.items():
        rows.append((name, 1e3 * s / trained))
    rows.append(
        ("update: other (indexing, metrics, Python)", 1e3 * (total_update - sum(parts.values())) / trained)
    )
    rows.append(("learner: publish weights", 1e3 * clock.seconds["learner: publish weights"] / trained))
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument("--env", default="PongDeterministic-v4")
    ap.add_argument("--workers", type=int, default=os.cpu_count(), help="cores the run gets (default: all)")
    ap.add_argument("--envs-per-worker", type=int, default=4)
    ap.add_argument("--updates", type=int, default=4, help="timed learner updates (default: 4)")
    ap.add_argument("--seconds", type=float, default=60.0, help="end-to-end run length (default: 60)")
    ap.add_argument("--skip-run", action="store_true", help="the breakdown only, no end-to-end run")
    ap.add_argument("extra", nargs="*", help="more launch_impala flags (after --)")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # core-milliseconds: one core per stage
    run, impala, env_info, trainer = build(args)
    K, T, B = run.envs_per_worker, run.unroll_length, impala.batch_size
    skip = env_info.frames_per_step
    print(f"machine: {machine()}")
    print(
        f"{args.env}: K={K} envs per actor, T={T}, B={B}, {impala.epochs} epochs x {impala.minibatches} "
        f"minibatches, model {impala.model}, learner precision {trainer.learner.precision} "
        f"(--precision {impala.precision}), frame skip {skip:g}"
    )
    rows = breakdown(args, run, impala, env_info, trainer)
    total = sum(ms for _, ms in rows)
    print(f"\n{'stage':<44} {'core-ms / agent step':>22} {'share':>7}")
    for name, ms in rows:
        print(f"{name:<44} {ms:>22.4f} {100 * ms / total:>6.1f}%")
    print(f"{'total':<44} {total:>22.4f}")
    ceiling_steps = args.workers * 1e3 / total
    print(
        f"\ncost-model ceiling on {args.workers} cores: {ceiling_steps:,.0f} agent steps/s = "
        f"{ceiling_steps * skip:,.0f} frames/s"
    )
    if args.skip_run:
        return 0
    flags = ["--envs-per-worker", str(K), "--device", "cpu", *args.extra]
    frames, usage, done = end_to_end(args.env, args.workers, args.seconds, flags)
    steps = frames / skip
    print(f"launch_impala --workers {args.workers}: {frames:,.0f} frames/s ({steps:,.0f} agent steps/s)")
    print(f"    {done}")
    # A shared host's speed drifts from minute to minute (a virtual machine's neighbours): the stages are
    # timed again after the run, and the ratio is taken against the mean of the two ceilings, with both.
    after = sum(ms for _, ms in breakdown(args, run, impala, env_info, trainer))
    ceiling_after = args.workers * 1e3 / after
    mean_ceiling = (ceiling_steps + ceiling_after) / 2
    print(
        f"stages timed again after the run: total {after:.4f} core-ms per agent step (before: {total:.4f}), "
        f"ceiling {ceiling_after * skip:,.0f} frames/s"
    )
    if abs(after - total) > 0.1 * min(after, total):
        print("    the box's speed changed by more than 10% during the measurement: rerun for a firm ratio")
    print(
        f"measured / ceiling = {frames / (mean_ceiling * skip):.2f} (against the mean of the two ceilings; "
        f"{frames / (ceiling_steps * skip):.2f} before, {frames / (ceiling_after * skip):.2f} after)"
    )
    print(f"\nwhere the {os.cpu_count()} cores went over the measured {args.seconds:.0f} s (per process):")
    busy = 0.0
    for name, (cpu_s, wait_s) in sorted(usage.items()):
        busy += cpu_s
        print(
            f"  {name:<28} {cpu_s / args.seconds:5.2f} cores busy, {wait_s / args.seconds:5.2f} core-s/s "
            f"waiting for a CPU, {1e3 * cpu_s / args.seconds / steps:.3f} core-ms per agent step"
        )
    print(
        f"  all: {busy / args.seconds:.2f} of {os.cpu_count()} cores busy; "
        f"{1e3 * busy / args.seconds / steps:.3f} core-ms per agent step measured vs {total:.3f} modelled"
    )
    return 0


def _proc_times(pid: int) -> tuple[float, float] | None:
    """(CPU seconds used, seconds spent runnable but waiting for a CPU) of one process, all its threads."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        wait = 0.0
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                wait += int(f.read().split()[1]) / 1e9
        return cpu, wait
    except (OSError, IndexError, ValueError):
        return None


def _tree(root: int) -> dict[int, str]:
    """``root`` and its descendants: pid -> a short name (learner / actor-N / other)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
                children[ppid].append(int(entry))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        out[pid] = "learner" if pid == root else "other"
        todo += children.get(pid, [])
    actors = sorted(p for p in out if p != root and _is_actor(p))
    for i, pid in enumerate(actors):
        out[pid] = f"actor process {i}"
    return out


def _is_actor(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read() and _proc_times(pid) is not None  # not the resource tracker
    except OSError:
        return False


def end_to_end(env: str, workers: int, seconds: float, flags: list[str]) -> tuple[float, dict, str]:
    """``launch_impala`` for ``seconds`` after a 20 s warm-up: frames/s between two metrics rows, and each
    process's CPU use and CPU wait over the same window."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as logdir:
        cmd = [os.path.join(os.path.dirname(sys.executable), "launch_impala"), "--env", env, "--workers"]
        cmd += [str(workers), "--logdir", logdir, "--no-progress", "--log-interval", "1", "--total-frames"]
        cmd += [str(10**12), "--max-seconds", str(seconds + 30), *flags]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        time.sleep(20)  # start-up and the queue filling
        tree = _tree(proc.pid)
        start = {pid: _proc_times(pid) for pid in tree}
        rows0 = _metrics(logdir)
        time.sleep(seconds)
        end = {pid: _proc_times(pid) for pid in tree}
        rows1 = _metrics(logdir)
        out, _ = proc.communicate(timeout=120)
    usage: dict[str, tuple[float, float]] = defaultdict(lambda: (0.0, 0.0))
    for pid, name in tree.items():
        if start.get(pid) and end.get(pid):
            cpu, wait = usage[name]
            usage[name] = (cpu + end[pid][0] - start[pid][0], wait + end[pid][1] - start[pid][1])
    (f0, t0), (f1, t1) = rows0, rows1
    done = [line for line in out.splitlines() if line.startswith("launch_impala: done")]
    return (f1 - f0) / (t1 - t0), dict(usage), done[-1] if done else "(no done line)"


def _metrics(logdir: str) -> tuple[float, float]:
    """(env frames, seconds) of the newest metrics row."""
    import csv

    with open(os.path.join(logdir, "metrics.csv")) as f:
        row = list(csv.DictReader(f))[-1]
    return float(row["charts/env_frames"]), float(row["time"])


if __name__ == "__main__":
    sys.exit(main())
