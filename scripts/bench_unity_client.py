#!/usr/bin/env python
"""Client-side cost of one ``UnityVecEnv.step`` for 10 Crawler-shaped agents, before and after.

Each measurement runs in its own interpreter, for each variant, interleaved, side by side:

python+mlagents  mlagents-envs' own ``UnityEnvironment`` on the pure-Python protobuf
                 (``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``): what ran before, since the
                 protobuf<3.21 that mlagents-envs 0.28's modules need is pure Python on 3.11
upb+mlagents     the same code on the compiled upb runtime (the protobuf move alone)
upb+fast         ``FastUnityEnvironment`` on upb: the default now (``UnityVecEnv(fast_client=True)``)

Modes:

replay
    No transport and no player. ``UnityEnvironment`` (the real one) talks to a replaying
    communicator: ``exchange`` wraps the input in a ``UnityMessageProto`` and serializes it (the
    bytes gRPC would send), then parses the next pre-encoded reply (10 agents, observations
    126 + 32 floats, never-ending episodes) and returns its ``unity_output``. So a step costs
    UnityVecEnv's bookkeeping + ``set_actions`` + building and encoding the actions + decoding
    the reply + ``steps_from_proto``: everything the client does except moving bytes.
grpc
    The real gRPC server (mlagents' ``RpcCommunicator``, or ``FastRpcCommunicator`` for
    upb+fast: the same server without the pickling Pipe) and a player in a second process
    that replays the same pre-encoded replies as raw bytes (no protobuf on its side, so it
    costs only its gRPC call). Wall time per step and the client process's
    CPU time per step (all its threads).
transport
    The gRPC floor under ``grpc``: a server with ``RpcCommunicator``'s settings whose handler
    answers every call at once with a pre-encoded reply (no ``UnityEnvironment``, no Pipe to
    the main thread, no protobuf work), the same player. Per call, not per env step; the same
    for every variant (no message is decoded).
fake
    ``UnityVecEnv`` against ``tests/fake_unity.py`` launched as a build (``--preset crawler
    --agents 10``), random actions: env steps/s and agent steps/s. The fake player builds its
    messages in Python, so it is slower than a real build would be; it uses the same protobuf
    implementation as the client.

    .venv/bin/python scripts/bench_unity_client.py                       # every mode and variant
    .venv/bin/python scripts/bench_unity_client.py --modes replay,grpc --variants upb+fast --profile
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

N_AGENTS, OBS_SIZES, ACTION_SIZE = 10, (126, 32), 20
BEHAVIOR = "CrawlerReplay?team=0"
N_REPLIES = 16  # distinct pre-encoded step replies, cycled
EXCHANGE = "/communicator_objects.UnityToExternalProto/Exchange"


def _pb():
    """The communicator message classes (through impala's protobuf path when it exists)."""
    import impala.envs.unity  # noqa: F401  (serves mlagents' messages from the current protobuf)

    # isort: split
    from mlagents_envs.communicator_objects import unity_message_pb2, unity_output_pb2

    return unity_message_pb2, unity_output_pb2


def encoded_messages() -> dict[str, object]:
    """The player's pre-encoded UnityMessageProto bytes: hello, empty, first output, step outputs."""
    unity_message_pb2, _ = _pb()  # first: the protobuf path must be in place
    from mlagents_envs.communicator_objects.agent_info_pb2 import AgentInfoProto
    from mlagents_envs.communicator_objects.brain_parameters_pb2 import ActionSpecProto, BrainParametersProto
    from mlagents_envs.communicator_objects.observation_pb2 import ObservationProto

    Msg = unity_message_pb2.UnityMessageProto
    rng = np.random.default_rng(0)

    def hello() -> bytes:
        m = Msg()
        m.header.status = 200
        init = m.unity_output.rl_initialization_output
        init.name, init.communication_version, init.package_version = "Replay", "1.5.0", "2.2.1-exp.1"
        caps = init.capabilities
        caps.baseRLCapabilities = caps.concatenatedPngObservations = True
        caps.compressedChannelMapping = caps.hybridActions = caps.trainingAnalytics = True
        caps.variableLengthObservation = caps.multiAgentGroups = True
        return m.SerializeToString()

    def output(brain_params: bool) -> bytes:
        m = Msg()
        m.header.status = 200
        infos = m.unity_output.rl_output.agentInfos[BEHAVIOR].value
        for i in range(N_AGENTS):
            info = AgentInfoProto(reward=float(rng.normal()), id=i)
            for k, n in enumerate(OBS_SIZES):
                o = ObservationProto(shape=[n], name=f"VectorSensor{k}")
                o.float_data.data.extend(rng.normal(size=n).astype(np.float32).tolist())
                info.observations.append(o)
            infos.append(info)
        if brain_params:
            init = m.unity_output.rl_initialization_output
            init.name, init.communication_version, init.package_version = "Replay", "1.5.0", "2.2.1-exp.1"
            init.brain_parameters.append(
                BrainParametersProto(
                    brain_name=BEHAVIOR,
                    is_training=True,
                    action_spec=ActionSpecProto(num_continuous_actions=ACTION_SIZE),
                )
            )
        return m.SerializeToString()

    empty = Msg()
    empty.header.status = 200
    return {
        "hello": hello(),
        "empty": empty.SerializeToString(),
        "first": output(True),
        "steps": [output(False) for _ in range(N_REPLIES)],
    }


class _Replay:
    """A Communicator that encodes what it is sent and decodes pre-encoded replies."""

    def __init__(self, msgs: dict) -> None:
        unity_message_pb2, _ = _pb()
        self.Msg = unity_message_pb2.UnityMessageProto
        self.hello, self.first, self.steps = msgs["hello"], msgs["first"], msgs["steps"]
        self.n = 0
        self.sent_bytes = 0

    def initialize(self, inputs, poll_callback=None):
        self.sent_bytes += len(inputs.SerializeToString())
        return self.Msg.FromString(self.hello).unity_output

    def exchange(self, inputs, poll_callback=None):
        message = self.Msg()
        message.header.status = 200
        message.unity_input.CopyFrom(inputs)
        self.sent_bytes += len(message.SerializeToString())
        reply = self.first if self.n == 0 else self.steps[self.n % len(self.steps)]
        self.n += 1
        return self.Msg.FromString(reply).unity_output

    def close(self) -> None:
        pass


def _timed_steps(env, seconds: float, rng) -> dict:
    acts = [rng.uniform(-1, 1, size=(env.num_envs, env.action_dim)).astype(np.float32) for _ in range(8)]
    env.reset()
    for i in range(20):  # warm-up
        env.step(acts[i % 8])
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while True:
        env.step(acts[n % 8])
        n += 1
        if n % 10 == 0 and time.perf_counter() - t0 >= seconds:
            break
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {
        "steps": n,
        "ms_per_step": 1e3 * wall / n,
        "cpu_ms_per_step": 1e3 * cpu / n,
        "steps_per_s": n / wall,
        "agent_steps_per_s": n * env.num_envs / wall,
    }


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def measure(mode: str, seconds: float, profile: bool, fast: bool) -> dict:
    from impala.envs.unity import UnityVecEnv  # first: it installs the protobuf path

    # isort: split
    from google.protobuf.internal import api_implementation
    from mlagents_envs.environment import UnityEnvironment

    rng = np.random.default_rng(1)
    out: dict = {"mode": mode, "protobuf": api_implementation.Type(), "fast_client": fast}
    if mode == "transport":
        out.update(measure_transport(seconds))
        return out
    if mode == "replay":
        msgs = encoded_messages()
        from impala.envs.unity_client import FastUnityEnvironment

        for cls in (UnityEnvironment, FastUnityEnvironment):
            cls._get_communicator = staticmethod(lambda *a: _Replay(msgs))
        env = UnityVecEnv(None, worker_id=0, base_port=free_port(), fast_client=fast)
    elif mode == "grpc":
        port = free_port()
        player = subprocess.Popen([sys.executable, __file__, "--player", str(port)])
        env = UnityVecEnv(None, worker_id=0, base_port=port, timeout_wait=30, fast_client=fast)
    elif mode == "fake":
        sys.path.insert(0, str(ROOT / "tests"))
        from fake_unity import write_fake_build

        tmp = tempfile.mkdtemp(prefix="bench_unity_")
        build = write_fake_build(
            Path(tmp) / "FakeCrawler.x86_64", preset="crawler", args=["--agents", str(N_AGENTS)]
        )
        env = UnityVecEnv(str(build), worker_id=0, base_port=free_port(), timeout_wait=60, fast_client=fast)
    else:
        raise ValueError(mode)
    try:
        assert (env.num_envs, env.obs_dim, env.action_dim) == (N_AGENTS, sum(OBS_SIZES), ACTION_SIZE)
        if profile:
            import cProfile
            import io
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            out.update(_timed_steps(env, seconds, rng))
            prof.disable()
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
            out["profile"] = s.getvalue()
        else:
            out.update(_timed_steps(env, seconds, rng))
    finally:
        env.close()
        if mode == "grpc":
            player.wait(30)
    return out


def measure_transport(seconds: float) -> dict:
    """The gRPC floor: mlagents' server settings, a handler that answers with the pre-encoded reply
    at once (no UnityEnvironment, no Pipe to a main thread, no protobuf), the same player."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    msgs = encoded_messages()
    unity_message_pb2, _ = _pb()
    close = unity_message_pb2.UnityMessageProto()
    close.header.status = 400
    close_bytes = close.SerializeToString()
    lock = threading.Lock()
    state = {"n": 0, "stop": False}
    stopped = threading.Event()

    def exchange(request: bytes, context) -> bytes:
        with lock:
            state["n"] += 1
            n = state["n"]
            if state["stop"]:
                stopped.set()
                return close_bytes
        return msgs["steps"][n % N_REPLIES]

    port = free_port()
    server = grpc.server(
        thread_pool=ThreadPoolExecutor(max_workers=10), options=(("grpc.so_reuseport", 1),)
    )  # as RpcCommunicator
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "communicator_objects.UnityToExternalProto",
                {"Exchange": grpc.unary_unary_rpc_method_handler(exchange)},
            ),
        )
    )
    server.add_insecure_port(f"[::]:{port}")
    server.start()
    player = subprocess.Popen([sys.executable, __file__, "--player", str(port)])
    try:
        deadline = time.monotonic() + 60
        while state["n"] < 50 and time.monotonic() < deadline:  # connected and warmed up
            time.sleep(0.01)
        n0, t0, c0 = state["n"], time.perf_counter(), time.process_time()
        time.sleep(seconds)
        n, wall, cpu = state["n"] - n0, time.perf_counter() - t0, time.process_time() - c0
        state["stop"] = True
        stopped.wait(30)
        player.wait(30)
    finally:
        server.stop(0)
    return {
        "steps": n,
        "ms_per_step": 1e3 * wall / n,
        "cpu_ms_per_step": 1e3 * cpu / n,
        "steps_per_s": n / wall,
        "agent_steps_per_s": n * N_AGENTS / wall,
    }


def run_player(port: int) -> int:
    """The zero-cost player: replays pre-encoded UnityMessageProto bytes over gRPC (raw bytes)."""
    import grpc

    msgs = encoded_messages()
    unity_message_pb2, _ = _pb()
    close = unity_message_pb2.UnityMessageProto()
    close.header.status = 400
    close_bytes = close.SerializeToString()
    channel = grpc.insecure_channel(f"localhost:{port}")
    call = channel.unary_unary(EXCHANGE)  # no (de)serializers: bytes in, bytes out
    try:
        call(msgs["hello"], wait_for_ready=True, timeout=60)
        reply = call(msgs["empty"])
        n = 0
        while reply != close_bytes:
            reply = call(msgs["first"] if n == 0 else msgs["steps"][n % N_REPLIES])
            n += 1
    except grpc.RpcError:  # the server went away first
        pass
    finally:
        channel.close()
    return 0


VARIANTS = {
    # name: (protobuf implementation, UnityVecEnv fast_client)
    "python+mlagents": ("python", False),  # before: mlagents' code on the pure-Python protobuf
    "upb+mlagents": ("upb", False),  # the protobuf move alone
    "upb+fast": ("upb", True),  # now: upb + FastUnityEnvironment (the default)
    "python+fast": ("python", True),
}


def run_child(mode: str, variant: str, seconds: float, profile: bool) -> dict:
    impl, fast = VARIANTS[variant]
    env = dict(os.environ)
    if impl == "python":
        env["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = "python"
    else:
        env.pop("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", None)
    cmd = [sys.executable, __file__, "--child", mode, "--seconds", str(seconds), "--fast", str(int(fast))]
    if profile:
        cmd.append("--profile")
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{mode}/{variant} failed:\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if out["protobuf"] != impl:
        raise SystemExit(f"{variant}: asked for protobuf {impl!r}, the child ran {out['protobuf']!r}")
    out["variant"] = variant
    return out


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    ap.add_argument(
        "--modes", default="replay,grpc,transport,fake", help="comma-separated: replay, grpc, transport, fake"
    )
    ap.add_argument(
        "--variants",
        default="python+mlagents,upb+mlagents,upb+fast",
        help=f"comma-separated, from {', '.join(VARIANTS)}; the first and last are "
        "compared (python = PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python; "
        "mlagents/fast = UnityVecEnv(fast_client=False/True))",
    )
    ap.add_argument("--seconds", type=float, default=5.0, help="measured time per run")
    ap.add_argument(
        "--repeats", type=int, default=3, help="runs per (mode, variant), interleaved; the median is shown"
    )
    ap.add_argument("--profile", action="store_true", help="print a cProfile summary of one run each")
    ap.add_argument("--json", help="also write all runs here")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--fast", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--player", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.player is not None:
        return run_player(args.player)
    if args.child:
        print(json.dumps(measure(args.child, args.seconds, args.profile, bool(args.fast))))
        return 0

    import google.protobuf

    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            ap.error(f"unknown variant {v!r}")
    print(
        f"protobuf {google.protobuf.__version__}, python {sys.version.split()[0]}, "
        f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start; 10 agents, obs "
        f"{'+'.join(map(str, OBS_SIZES))}, {ACTION_SIZE} actions; {args.seconds:g} s x "
        f"{args.repeats} per row, median shown"
    )
    runs: list[dict] = []
    print(
        f"{'mode':7s} {'variant':16s} {'ms/step':>8s} {'CPU ms/step':>12s} {'env steps/s':>12s} "
        f"{'agent steps/s':>14s}"
    )
    for mode in args.modes.split(","):
        # transport decodes nothing: one variant is enough
        mode_variants = variants[-1:] if mode == "transport" else variants
        per: dict[str, list[dict]] = {v: [] for v in mode_variants}
        for _ in range(args.repeats):  # interleaved, so that load changes hit every variant alike
            for v in mode_variants:
                per[v].append(run_child(mode, v, args.seconds, False))
        med: dict[str, dict] = {}
        for v in mode_variants:
            rs = per[v]
            runs += rs
            r = med[v] = sorted(rs, key=lambda x: x["ms_per_step"])[len(rs) // 2]
            print(
                f"{mode:7s} {v:16s} {r['ms_per_step']:8.3f} {r['cpu_ms_per_step']:12.3f} "
                f"{r['steps_per_s']:12.1f} {r['agent_steps_per_s']:14.0f}   (runs: "
                + ", ".join(f"{x['ms_per_step']:.3f}" for x in rs)
                + " ms)",
                flush=True,
            )
        if len(mode_variants) >= 2:
            a, b = med[mode_variants[0]], med[mode_variants[-1]]
            print(
                f"{mode:7s} {variants[0]} / {variants[-1]}: time per step "
                f"{a['ms_per_step'] / b['ms_per_step']:.1f}x, CPU per step "
                f"{a['cpu_ms_per_step'] / b['cpu_ms_per_step']:.1f}x",
                flush=True,
            )
        if args.profile and mode != "transport":
            for v in mode_variants:
                r = run_child(mode, v, args.seconds, True)
                print(
                    f"--- cProfile (main thread), {mode}, {v} ({r['ms_per_step']:.3f} ms/step under "
                    f"the profiler) ---\n{r['profile']}"
                )
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
