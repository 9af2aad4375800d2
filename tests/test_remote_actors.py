"""Actors on "another machine": impala-actors against a learner, plain and with CURVE keys."""

import os
import re
import shutil
import time

import pytest
import zmq

from impala.transport import wire
from impala.transport.curve import (
    ClientKeys,
    make_client_keys,
    make_client_socket,
    prepare_server,
    start_authenticator,
)
from impala.transport.trajectory import impala_unroll_schema
from learner.serve.server import TrajectoryServer
from procs import free_port_pair, kill_group, run, start, wait_for

# 2 unrolls a minibatch (--minibatches 4): FRAMES was set with these updates
CARTPOLE = [
    *("--env", "CartPole-v1", "--unroll-length", "20"),
    *("--batch-size", "8", "--minibatches", "4", "--no-progress"),
]
FRAMES = (
    6000  # the remote actors' run: 37 updates of 8 unrolls (about 8 s of a 2-core box once they have joined)
)


def _learner_then_actors(tmp_path, learner_extra, actor_extra):
    port = free_port_pair()
    # The "other machine" is this one: a learner taking every core (its default with --workers 0)
    # would time-slice its threads against the actors' (about 30x slower on 2 loaded cores).
    learner = start(
        [
            "launch_impala",
            "--workers",
            "0",
            *CARTPOLE,
            "--total-frames",
            str(FRAMES),
            "--port",
            str(port),
            "--logdir",
            str(tmp_path / "run"),
            *"--max-seconds 120 --torch-threads 1".split(),
            *learner_extra,
        ]
    )
    try:
        if "--curve" in learner_extra:
            keys = learner_extra[learner_extra.index("--curve") + 1]
            # prepare_server writes server.key before it makes authorized/: wait for both
            assert wait_for(
                lambda: (
                    os.path.exists(os.path.join(keys, "server.key"))
                    and os.path.isdir(os.path.join(keys, "authorized"))
                ),
                60,
            )
            client_dir = actor_extra[actor_extra.index("--curve") + 1]
            public = make_client_keys(client_dir)
            shutil.copy(os.path.join(keys, "server.key"), client_dir)
            shutil.copy(public, os.path.join(keys, "authorized", "remote.key"))
        # No --max-seconds: the actors must notice by themselves when the learner is done.
        actors = run(
            [
                "impala-actors",
                "--learner",
                f"tcp://127.0.0.1:{port}",
                *"--workers 2 --learner-timeout 8".split(),
                *actor_extra,
            ],
            timeout=180,
        )
        assert "the learner is gone" in actors.stderr
        out, _ = learner.communicate(timeout=60)
    finally:
        kill_group(learner)
    return learner.returncode, out, actors


def test_remote_actors_learn_the_run_from_the_learner(tmp_path):
    rc, out, actors = _learner_then_actors(tmp_path, [], [])
    assert rc == 0, out[-3000:]
    assert "running 2 actors for CartPole-v1" in actors.stderr
    frames = int(re.search(r"done: (\d+) env frames", out).group(1))
    assert frames >= FRAMES


def test_remote_actors_with_curve_keys(tmp_path):
    rc, out, actors = _learner_then_actors(
        tmp_path, ["--curve", str(tmp_path / "learner-keys")], ["--curve", str(tmp_path / "actor-keys")]
    )
    assert rc == 0, out[-3000:] + actors.stderr[-2000:]
    assert int(re.search(r"done: (\d+) env frames", out).group(1)) >= FRAMES
    # where to connect, and which public key the actors need, said at start
    server_key = os.path.join(str(tmp_path / "learner-keys"), "server.key")
    assert f"actors need the learner's public key {server_key}" in out, out[:3000]


def test_curve_server_refuses_clients_without_an_authorized_key(tmp_path):
    schema = impala_unroll_schema(2, (1,), "float32", 2)
    keys_dir = str(tmp_path / "keys")
    local = prepare_server(keys_dir)
    server = TrajectoryServer(schema, curve_dir=keys_dir)
    server.start()
    ctx = zmq.Context.instance()
    socks = []
    try:

        def hello_from(actor, keys):
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 0)
            if keys is not None:
                make_client_socket(s, keys)
            s.connect(server.trajectory_endpoint)
            socks.append(s)
            try:
                s.send_multipart(
                    [bytes(f) for f in wire.encode("hello", actor=actor, version=-1)], flags=zmq.NOBLOCK
                )
            except zmq.Again:
                pass  # never connected: the handshake was refused

        stranger_dir = str(tmp_path / "stranger")
        make_client_keys(stranger_dir)
        shutil.copy(os.path.join(keys_dir, "server.key"), stranger_dir)
        hello_from(1, None)  # no CURVE at all
        hello_from(
            2,
            ClientKeys(
                os.path.join(stranger_dir, "server.key"), os.path.join(stranger_dir, "client.key_secret")
            ),
        )  # not authorized
        hello_from(3, local)  # the learner's own local-actor key
        assert wait_for(lambda: 3 in server.accepted, 10)
        time.sleep(1.0)
        assert set(server.accepted) == {3}
    finally:
        for s in socks:
            s.close()
        server.close()


def test_remote_learner_without_curve_is_refused_before_connecting():
    # The address is never contacted: the check happens before any socket is made.
    out = run(["impala-actors", "--learner", "tcp://192.0.2.1:5555", "--workers", "1"], timeout=60)
    assert out.returncode == 2
    assert "--curve" in out.stderr and "Traceback" not in out.stderr


def test_bad_values_are_one_line_errors_before_connecting(capsys):
    from actors.remote import main

    cases = [
        (["--timeout", "nan"], "--timeout must be a finite number"),
        (["--learner-timeout", "-1"], "--learner-timeout must be a number of seconds > 0"),
        (["--max-seconds", "-1"], "--max-seconds must be >= 0"),
        (["--first-id", "-1"], "--first-id must be >= 0"),
        (["--seed", "-1"], "--seed must be in 0.."),
        (["--first-id", "1048576", "--workers", "2"], "actor ids must stay <= 1048576"),
        (["--workers", "0"], "--workers must be >= 1"),
    ]
    # The first case as a real process (the console script's exit status and stderr), the others
    # through its main in this process; every case must fail before waiting for weights from the
    # (absent) learner.
    for i, (argv, message) in enumerate(cases):
        if i == 0:
            out = run(["impala-actors", "--learner", "tcp://127.0.0.1:1", *argv], timeout=60)
            rc, err = out.returncode, out.stderr
        else:
            rc, err = main(["--learner", "tcp://127.0.0.1:1", *argv]), capsys.readouterr().err
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1 and message in lines[0], (argv, err)


def test_ppo_learner_takes_remote_actors_over_curve(tmp_path):
    """launch_ppo with --curve: impala-actors learns from the weights message that it runs a PPO
    agent, joins through the CURVE handshake with an authorized key, and trains with the local actor.

    The keys are made and exchanged before either side starts (the learner keeps the keys it finds;
    test_remote_actors_with_curve_keys has the learner make them), so the actors start up alongside
    the learner. The learner is stopped (SIGTERM: it finishes its update, checkpoints, exits 0) a few
    seconds after the remote actor joined, rather than at a --max-seconds long enough for a slow start."""
    import signal
    import threading

    port = free_port_pair()
    keys, client = tmp_path / "learner-keys", tmp_path / "actor-keys"
    prepare_server(str(keys))
    public = make_client_keys(str(client))
    shutil.copy(os.path.join(keys, "server.key"), client)
    shutil.copy(public, os.path.join(keys, "authorized", "remote.key"))
    learner = start(
        [
            *"launch_ppo --env Pendulum-v1 --workers 1 --envs-per-worker 2 --curve".split(),
            str(keys),
            "--port",
            str(port),
            "--logdir",
            str(tmp_path / "run"),
            *"--max-seconds 120 --no-progress --torch-threads 1".split(),
        ]
    )
    lines: list[str] = []

    def read() -> None:
        for line in learner.stdout:
            lines.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        actors = start(
            [
                "impala-actors",
                "--learner",
                f"tcp://127.0.0.1:{port}",
                "--workers",
                "1",
                "--curve",
                str(client),
                "--learner-timeout",
                "8",
            ]
        )
        try:
            assert wait_for(lambda: any("actor 1000 joined" in line for line in lines), 120), "".join(lines)[
                -3000:
            ]
            time.sleep(3.0)  # the remote actor plays alongside the local one for a while
            learner.send_signal(signal.SIGTERM)
            actors_out, _ = actors.communicate(
                timeout=120
            )  # no --max-seconds: they notice by themselves that the learner is gone
        finally:
            kill_group(actors)
        learner.wait(timeout=60)
        reader.join(timeout=10)
    finally:
        kill_group(learner)
    out = "".join(lines)
    assert learner.returncode == 0, out[-3000:]
    assert "actor 0 joined" in out and "actor 1000 joined (2 envs;" in out, out[-3000:]
    assert (
        actors.returncode == 0
        and "running 1 actors for Pendulum-v1" in actors_out
        and "the learner is gone" in actors_out
    ), actors_out[-2000:]
    assert int(re.search(r"done: (\d+) agent steps", out).group(1)) > 0


def test_secret_keys_are_private_and_loose_ones_are_refused(tmp_path, capsys):
    import stat

    from actors.remote import main as actors_main

    keys = tmp_path / "learner-keys"
    prepare_server(str(keys))
    for name in ("server.key_secret", "local.key_secret"):
        assert stat.S_IMODE(os.stat(keys / name).st_mode) == 0o600, name
    assert stat.S_IMODE(os.stat(keys).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(keys / "authorized").st_mode) == 0o700
    os.chmod(keys / "server.key_secret", 0o644)
    out = run(
        [
            *"launch_impala --env CartPole-v1 --workers 1 --curve".split(),
            str(keys),
            "--logdir",
            str(tmp_path / "run"),
        ],
        timeout=120,
    )
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
    assert (
        f"secret key {keys / 'server.key_secret'} is readable by others (mode 0644); run: chmod 600"
        in lines[-1]
    )
    # the actor side too (its main in this process: the other tests run impala-actors for real)
    client = tmp_path / "actor-keys"
    make_client_keys(str(client))
    shutil.copy(keys / "server.key", client)
    os.chmod(client / "client.key_secret", 0o640)
    rc, err = (
        actors_main(["--learner", "tcp://127.0.0.1:5555", "--curve", str(client)]),
        capsys.readouterr().err,
    )
    assert rc == 2 and "readable by others (mode 0640)" in err and len(err.strip().splitlines()) == 1, err


def test_an_authenticator_starts_right_after_the_last_one_stopped(tmp_path):
    """Closing a ZeroMQ socket releases its inproc name later, in libzmq's reaper thread; pyzmq's own
    authenticator, started again at once, fails within a few tries ('Address already in use' for
    inproc://zeromq.zap.01, as one fresh-clone CI run saw between two CURVE servers, or for its
    control pipe, named after an id() Python reuses; that failure then hung in stop())."""
    keys_dir = str(tmp_path / "keys")
    prepare_server(keys_dir)
    ctx = zmq.Context.instance()
    for _ in range(200):
        start_authenticator(ctx, keys_dir).stop()


def test_a_server_that_cannot_start_leaves_no_authenticator_behind(tmp_path):
    """A CURVE server whose keys are missing fails at construction and releases the process's one ZAP
    authenticator, so the next server in the same process starts (before: 'Address already in use' for
    inproc://zeromq.zap.01 in every later CURVE server of the process)."""
    schema = impala_unroll_schema(2, (1,), "float32", 2)
    with pytest.raises(OSError):
        TrajectoryServer(schema, curve_dir=str(tmp_path / "no-keys-here"))
    keys_dir = str(tmp_path / "keys")
    prepare_server(keys_dir)
    server = TrajectoryServer(schema, curve_dir=keys_dir)
    server.close()
