"""The learner's receive path over real ZeroMQ sockets: bad messages are dropped and counted, never fatal."""

import json
import logging
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import zmq

from impala.transport import wire
from impala.transport.trajectory import impala_unroll_schema
from learner.serve.server import PortInUseError, TrajectoryServer

SCHEMA = impala_unroll_schema(4, (3,), "float32", 2)


def _unroll():
    u = SCHEMA.allocate()
    u["obs"][:] = 1.0
    u["behaviour_logits"][:] = 0.5
    return u


def _episode(ret=3.0):
    """An unroll holding one whole episode of 4 steps and return ``ret``."""
    u = _unroll()
    u["first"][0] = True
    u["rewards"][:] = [ret, 0.0, 0.0, 0.0]
    u["dones"][3] = True
    return u


@pytest.fixture
def server():
    srv = TrajectoryServer(
        SCHEMA, queue_size=8, on_hello=lambda actor, info: None if info.get("ok", True) else "bad fingerprint"
    )
    srv.start()
    yield srv
    srv.close()


@pytest.fixture
def push(server):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(server.trajectory_endpoint)
    yield s
    s.close()


def _send(sock, frames):
    sock.send_multipart([bytes(f) for f in frames])


def _wait(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not pred():
        time.sleep(0.02)
    return pred()


def test_every_bad_message_is_dropped_and_counted(server, push, caplog):
    caplog.set_level(logging.WARNING, logger="learner.serve.server")
    good = wire.encode("unroll", actor=7, version=0, arrays=_episode(3.0))

    # An unroll before any hello: the actor is unknown.
    _send(push, good)
    assert _wait(lambda: server.dropped["unknown_actor"] == 1)

    _send(push, wire.encode("hello", actor=7, version=-1, info={"fingerprint": {}}))
    assert _wait(lambda: 7 in server.accepted)

    _send(push, [b"\x80garbage"] + [bytes(f) for f in good[1:]])  # malformed header
    frames = [bytes(f) for f in good]
    _send(push, frames[:1] + [frames[1][:-3]] + frames[2:])  # truncated frame
    header = json.loads(frames[0])
    header["arrays"][3][1] = "float64"  # rewards declared with the wrong dtype
    _send(push, [json.dumps(header).encode()] + frames[1:-3] + [frames[-3] * 2] + frames[-2:])
    _send(push, frames + [b"\0" * (SCHEMA.nbytes + 4096)])  # oversized
    nan = _unroll()
    nan["rewards"][2] = np.nan
    _send(push, wire.encode("unroll", actor=7, version=0, arrays=nan))  # NaN rewards
    _send(push, wire.encode("params", actor=7, version=0))  # a kind actors must not send

    assert _wait(lambda: sum(server.dropped.values()) == 7), dict(server.dropped)
    assert server.dropped["malformed"] == 1
    assert server.dropped["schema"] == 2  # truncated + wrong dtype
    assert server.dropped["oversized"] == 1
    assert server.dropped["non_finite"] == 1
    assert server.dropped["unexpected_kind"] == 1
    assert server.queue.qsize() == 0

    # The learner keeps running: a valid unroll still gets through, with its episode stats.
    _send(push, good)
    msg = server.get(timeout=5)
    assert msg is not None and msg.actor == 7
    np.testing.assert_array_equal(msg.arrays["obs"], _unroll()["obs"])
    assert server.stats()["charts/mean_return_100"] == 3.0 and server.stats()["charts/mean_length_100"] == 4.0
    assert server.stats()["transport/dropped_non_finite"] == 1.0
    # Each drop is logged with the actor id.
    assert any("actor 7 (non_finite" in r.getMessage() for r in caplog.records)


def test_unrolls_from_a_future_policy_version_are_dropped(server, push, caplog):
    caplog.set_level(logging.WARNING, logger="learner.serve.server")
    _send(push, wire.encode("hello", actor=5, version=-1, info={"fingerprint": {}}))
    assert _wait(lambda: 5 in server.accepted)
    server.publish(3, {})
    _send(push, wire.encode("unroll", actor=5, version=2**62, arrays=_unroll()))
    assert _wait(lambda: server.dropped["future_version"] == 1)
    assert server.stats()["transport/dropped_future_version"] == 1.0
    assert any("policy version 4611686018427387904 > published 3" in r.getMessage() for r in caplog.records)
    _send(push, wire.encode("unroll", actor=5, version=3, arrays=_unroll()))  # the current version is fine
    msg = server.get(timeout=5)
    assert msg is not None and msg.version == 3 and server.dropped["future_version"] == 1


def test_unrolls_from_another_run_or_unverified_local_ids_are_dropped(server, push):
    server.run_info = {"run_id": "current"}
    server.admission.protected_ids.add(0)
    server.admission.local_token = "t0ken"
    for actor in (0, 9):
        _send(push, wire.encode("hello", actor=actor, version=-1, info={"fingerprint": {}}))
    assert _wait(lambda: {0, 9} <= set(server.accepted))
    stamp = {"run_id": "current"}
    _send(push, wire.encode("unroll", actor=9, version=0, arrays=_unroll(), info={"run_id": "a-killed-run"}))
    _send(push, wire.encode("unroll", actor=9, version=0, arrays=_unroll()))  # no run id at all
    _send(
        push, wire.encode("unroll", actor=0, version=0, arrays=_unroll(), info=stamp)
    )  # a local id, no token
    _send(
        push,
        wire.encode("unroll", actor=0, version=0, arrays=_unroll(), info={**stamp, "local_token": "guess"}),
    )
    assert _wait(lambda: server.dropped["other_run"] == 2 and server.dropped["unverified_local"] == 2), dict(
        server.dropped
    )
    assert server.queue.qsize() == 0
    _send(push, wire.encode("unroll", actor=9, version=0, arrays=_unroll(), info=stamp))
    _send(
        push,
        wire.encode("unroll", actor=0, version=0, arrays=_unroll(), info={**stamp, "local_token": "t0ken"}),
    )
    got = [server.get(timeout=5), server.get(timeout=5)]
    assert sorted(m.actor for m in got if m is not None) == [0, 9]


def test_refused_hellos_are_logged_with_a_throttle(server, push, caplog):
    caplog.set_level(logging.ERROR, logger="learner.serve.server")
    for i in range(300):
        _send(push, wire.encode("hello", actor=100 + i, version=-1, info={"ok": False}))
    assert _wait(lambda: server.refused_hellos == 300)
    refusals = [r for r in caplog.records if "refused actor" in r.getMessage()]
    assert len(refusals) == 20 and all(len(r.getMessage()) < 400 for r in refusals)


def test_refused_actor_data_is_dropped(server, push):
    _send(push, wire.encode("hello", actor=2, version=-1, info={"ok": False}))
    assert _wait(lambda: 2 in server.refused)
    _send(push, wire.encode("unroll", actor=2, version=0, arrays=_unroll()))
    assert _wait(lambda: server.dropped["unknown_actor"] == 1)
    assert "bad fingerprint" in server.refused[2]


def test_full_queue_pushes_back_without_losing_hellos(server):
    """Backpressure: a full queue stops the reader, ZeroMQ's HWM then blocks the sender."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDHWM, 2)
    s.setsockopt(zmq.SNDBUF, 4096)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(server.trajectory_endpoint)
    _send(s, wire.encode("hello", actor=1, version=-1, info={}))
    assert _wait(lambda: 1 in server.accepted)
    sent = 0
    frames = [bytes(f) for f in wire.encode("unroll", actor=1, version=0, arrays=_unroll())]
    deadline = time.monotonic() + 20
    blocked_since = None
    while time.monotonic() < deadline:
        try:
            s.send_multipart(frames, flags=zmq.NOBLOCK)
            sent += 1
            blocked_since = None
        except zmq.Again:
            blocked_since = blocked_since or time.monotonic()
            if time.monotonic() - blocked_since > 1.0:
                break  # blocked for a whole second: pushed back
            time.sleep(0.01)
    s.close()
    assert time.monotonic() < deadline, "the sender was never pushed back"
    assert server.queue.qsize() == 8  # the bounded queue is full, nothing was dropped
    assert sum(server.dropped.values()) == 0
    assert sent > 8


def test_port_in_use_names_port_and_flag():
    first = TrajectoryServer(SCHEMA, port=0)
    try:
        with pytest.raises(PortInUseError, match=rf"port {first.trajectory_port}.*--port"):
            TrajectoryServer(SCHEMA, port=first.trajectory_port)
    finally:
        first.close()


def test_binds_loopback_by_default(server):
    assert server.trajectory_endpoint.startswith("tcp://127.0.0.1:")
    assert server.pull.getsockopt(zmq.LAST_ENDPOINT).decode().startswith("tcp://127.0.0.1:")


def test_hostile_messages_never_kill_the_receiver(push):
    """Inputs that once raised non-WireError exceptions inside the receive thread."""
    schema = SCHEMA
    srv = TrajectoryServer(
        schema, queue_size=8, validate=lambda a: "actions out of range" if a["actions"].max() >= 2 else None
    )
    srv.start()
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(srv.trajectory_endpoint)
    try:
        _send(s, wire.encode("hello", actor=5, version=-1))
        assert _wait(lambda: 5 in srv.accepted)
        deep = b"[" * 30000 + b"]" * 30000  # RecursionError inside json
        _send(s, [deep[: wire.MAX_HEADER_BYTES]])
        frames = [bytes(f) for f in wire.encode("unroll", actor=5, version=0, arrays=_unroll())]
        header = json.loads(frames[0])
        header["info"] = {"env": 10**400}  # no overflow: an env index is checked by type and range
        _send(s, [json.dumps(header).encode()] + frames[1:])
        header = json.loads(frames[0])
        header["arrays"][2][2] = [True, 4]  # a bool dimension (JSON true == 1)
        _send(s, [json.dumps(header).encode()] + frames[1:])
        bad = _unroll()
        bad["actions"][0] = 7  # an action the policy cannot have taken
        _send(s, wire.encode("unroll", actor=5, version=0, arrays=bad))
        assert _wait(lambda: sum(srv.dropped.values()) == 4), dict(srv.dropped)
        assert srv.healthy()
        _send(s, wire.encode("unroll", actor=5, version=0, arrays=_unroll()))
        assert srv.get(timeout=5) is not None
    finally:
        s.close()
        srv.close()


def test_hello_keeps_only_small_typed_fields(server, push):
    _send(
        push, wire.encode("hello", actor=9, version=-1, info={"pid": 12, "num_envs": 4, "junk": "x" * 50000})
    )
    assert _wait(lambda: 9 in server.accepted)
    assert server.accepted[9] == {"pid": 12, "num_envs": 4}  # no fingerprint: none was valid


def test_refused_ids_take_no_slot_and_idle_actors_give_theirs_up(server, push, monkeypatch):
    import learner.serve.admission as admission_rules

    monkeypatch.setattr(admission_rules, "MAX_ACTORS", 4)
    monkeypatch.setattr(admission_rules, "MAX_REFUSED", 16)
    for i in range(50):  # many refused ids: remembered up to MAX_REFUSED, never counted as actors
        _send(push, wire.encode("hello", actor=1000 + i, version=-1, info={"ok": False}))
    assert _wait(lambda: server.refused_hellos == 50)
    assert len(server.refused) == 16
    for actor in range(4):
        _send(push, wire.encode("hello", actor=actor, version=-1, info={"fingerprint": {}}))
    assert _wait(lambda: len(server.accepted) == 4)
    # The table is full and nobody is idle: a fifth actor is turned away (and counted).
    _send(push, wire.encode("hello", actor=99, version=-1, info={"fingerprint": {}}))
    assert _wait(lambda: server.dropped["unknown_actor"] == 1) and 99 not in server.accepted
    # Once actor 2 has been silent longer than ACTOR_IDLE_S, its slot goes to the newcomer.
    monkeypatch.setattr(admission_rules, "ACTOR_IDLE_S", 0.2)
    for actor in (0, 1, 3):
        server.admission.last_seen[actor] = time.monotonic() + 3600  # still active
    time.sleep(0.3)
    _send(push, wire.encode("hello", actor=99, version=-1, info={"fingerprint": {}}))
    assert _wait(lambda: 99 in server.accepted)
    assert 2 not in server.accepted and {0, 1, 3} <= set(server.accepted)


def test_a_forgotten_actor_learns_it_from_the_weights_and_says_hello_again():
    """A real actor loop (in a thread) against the server: after the learner forgets it, its next
    unroll is dropped as unknown, the weights message names it, and it says hello again."""
    import threading

    from actor_threads import cartpole_actor
    from impala.nets.impala_net import build_model
    from impala.transport.params import state_dict_arrays
    from impala.transport.trajectory import impala_unroll_schema

    schema = impala_unroll_schema(4, (4,), "float32", 2)
    srv = TrajectoryServer(schema, queue_size=64)
    srv.start()
    stop = threading.Event()
    actor = cartpole_actor(srv, num_envs=1, unroll_length=4, stop_event=stop)
    try:
        params = state_dict_arrays(build_model("mlp", (4,), 2))
        actor.start()
        assert _wait(lambda: 3 in srv.accepted, 60)
        srv.publish(0, params)
        assert srv.get(timeout=30) is not None
        srv.accepted.pop(3)  # the learner forgets it (as an idle expiry would)
        assert _wait(lambda: srv.dropped["unknown_actor"] >= 1, 30)
        deadline = time.monotonic() + 30
        while 3 not in srv.accepted and time.monotonic() < deadline:
            srv.publish(0, params)  # weights go out after every update; they now list actor 3
            for _ in range(
                64
            ):  # drain what is queued (bounded: once accepted, the actor sends without pause)
                if srv.get(timeout=0.05) is None:
                    break
        assert 3 in srv.accepted, dict(srv.dropped)
    finally:
        stop.set()
        actor.join(timeout=10)
        srv.close()


def test_an_actor_that_goes_silent_is_said_to_have_left_and_back_when_it_returns(
    server, push, caplog, monkeypatch
):
    """The learner's log says when a remote actor joins, when it has sent nothing for a while, and when it
    returns."""
    import learner.serve.admission as admission_rules

    monkeypatch.setattr(admission_rules, "SILENT_S", 0.5)
    with caplog.at_level(logging.INFO, logger="learner.serve.server"):
        _send(push, wire.encode("hello", actor=42, version=-1, info={"fingerprint": {}, "num_envs": 2}))
        assert _wait(lambda: "actor 42 joined (2 envs" in caplog.text)
        assert _wait(lambda: "actor 42 left? nothing from it for" in caplog.text, timeout=5.0)
        time.sleep(1.5)  # the heartbeat checks every second
        assert caplog.text.count("actor 42 left?") == 1  # said once, not every second
        _send(push, wire.encode("unroll", actor=42, version=0, arrays=_unroll(), info={}))
        assert _wait(lambda: "actor 42 is back" in caplog.text)


def test_an_unknown_actor_of_another_run_counts_as_other_run_not_unknown(server, push):
    """After a --resume on the same port, the dead run's orphans send unrolls without ever saying hello to the
    new learner: they are another run's (other_run), not actors to tell to say hello (unknown_actor)."""
    server.run_info = {"run_id": "current"}
    _send(push, wire.encode("unroll", actor=77, version=0, arrays=_unroll(), info={"run_id": "a-killed-run"}))
    _send(push, wire.encode("unroll", actor=78, version=0, arrays=_unroll(), info={"run_id": "current"}))
    assert _wait(lambda: server.dropped["other_run"] == 1 and server.dropped["unknown_actor"] == 1), dict(
        server.dropped
    )
    assert 77 not in server.admission.unknown_recent and 78 in server.admission.unknown_recent


def test_a_publish_delay_sends_the_weights_of_earlier_updates_as_they_were():
    """--publish-delay 2: the first weights go out at once; after that each publish sends the weights given
    two calls before, unchanged by what the learner did to its arrays since (they are views of weights the
    optimizer changes in place)."""
    srv = TrajectoryServer(impala_unroll_schema(4, (4,), "float32", 2), publish_delay=2)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(srv.params_endpoint)
    srv.start()

    def newest_version(want: int) -> dict[str, np.ndarray]:
        """Read weights messages (heartbeats re-send the newest every second) until version ``want``;
        none may be newer."""
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if sub.poll(200):
                msg = wire.decode_packed(sub.recv(), expect_kind="params")
                assert msg.version <= want, (msg.version, want)
                if msg.version == want:
                    return msg.arrays
        raise AssertionError(f"version {want} never arrived")

    try:
        weights = {"w": np.zeros(3, np.float32)}
        srv.publish(0, weights)
        assert newest_version(0)["w"].tolist() == [0, 0, 0] and srv.published_version == 0
        for version in (1, 2, 3):
            weights["w"][:] = version  # the learner's arrays change in place after every update
            srv.publish(version, weights)
        assert srv.published_version == 1
        assert newest_version(1)["w"].tolist() == [1, 1, 1]  # as it was when given, not [3, 3, 3]
        weights["w"][:] = 4
        srv.publish(4, weights)
        assert srv.published_version == 2 and newest_version(2)["w"].tolist() == [2, 2, 2]
    finally:
        sub.close()
        srv.close()


ACTOR_TERM_SCRIPT = """
import os, signal, sys, time
from actors.actor import Actor
from actors.loop import ActorConfig
from impala.envs import EnvSpec
from impala.transport.messages import ImpalaAgentSpec

if __name__ == "__main__":
    config = ActorConfig(actor_id=0, env=EnvSpec("CartPole-v1"), num_envs=2, unroll_length=4,
                         trajectory_endpoint="tcp://127.0.0.1:9", params_endpoint="tcp://127.0.0.1:9",
                         agent=ImpalaAgentSpec("mlp"), params_timeout_s=60)
    actor = Actor(config)
    actor.start()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # until its run() has installed its SIGTERM handler
        with open(f"/proc/{actor.pid}/status") as f:
            caught = int(next(l for l in f if l.startswith("SigCgt:")).split()[1], 16)
        if caught & (1 << (signal.SIGTERM - 1)):
            break
        time.sleep(0.05)
    time.sleep(float(sys.argv[1]))  # building its envs (0), or waiting for weights
    for _ in range(int(sys.argv[2])):  # the pool's terminate, again and again while the actor exits
        os.kill(actor.pid, signal.SIGTERM)
        time.sleep(0.002)
    actor.join(30)
    print("exitcode", actor.exitcode)
"""


@pytest.mark.parametrize("wait_s, signals", [(0.0, 1), (3.0, 1), (3.0, 40)])
def test_an_actor_stopped_with_sigterm_exits_0_without_a_traceback(tmp_path, wait_s, signals):
    """The pool stops actors with SIGTERM: the actor unwinds (closing its envs) and exits 0; more SIGTERMs
    while it exits are ignored, never raised inside its cleanup or the interpreter's atexit callbacks (they
    printed "Exception ignored in atexit callback ... SystemExit: 0")."""
    script = tmp_path / "term.py"
    script.write_text(ACTOR_TERM_SCRIPT)
    out = subprocess.run(
        [sys.executable, str(script), str(wait_s), str(signals)],
        capture_output=True, text=True, timeout=120, cwd=str(Path(__file__).resolve().parents[1]),
    )  # fmt: skip
    assert "exitcode 0" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert "Exception ignored" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-2000:]
