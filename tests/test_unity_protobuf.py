"""The fast Unity client path: compiled protobuf + bulk encode/decode, against independent references.

* The fast path is what runs: protobuf's upb runtime, every mlagents communicator module built
  by ``impala.envs.mlagents_proto`` from the descriptors mlagents-envs ships (byte-identical),
  and ``UnityVecEnv`` on ``FastUnityEnvironment`` by default.
* Decoding: the same wire bytes (hand-assembled, so neither runtime's encoder is trusted) are
  decoded by ``impala.envs.unity_client.steps_from_proto`` on upb here, and by mlagents' own
  ``rpc_utils.steps_from_proto`` on the **pure-Python** protobuf in a subprocess
  (``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python``). Observations, rewards, ids, flags, dtypes
  must be equal, and bad input must fail the same way (same exception type and message; for
  undecodable bytes the same ``DecodeError`` type, whose text each runtime words its own way).
* Encoding: ``FastUnityEnvironment._generate_step_input`` gives the same bytes as mlagents' own.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mlagents_envs")

from impala.envs import mlagents_proto  # noqa: E402
from impala.envs.unity import UnityVecEnv  # noqa: E402,F401  (installs the protobuf path)

# isort: split
from mlagents_envs import rpc_utils  # noqa: E402
from mlagents_envs.base_env import (  # noqa: E402
    ActionSpec,
    ActionTuple,
    BehaviorSpec,
    DecisionSteps,
    DimensionProperty,
    ObservationSpec,
    ObservationType,
)
from mlagents_envs.communicator_objects.agent_info_pb2 import AgentInfoProto  # noqa: E402
from mlagents_envs.communicator_objects.observation_pb2 import PNG, ObservationProto  # noqa: E402
from mlagents_envs.communicator_objects.unity_output_pb2 import UnityOutputProto  # noqa: E402
from mlagents_envs.communicator_objects.unity_rl_output_pb2 import UnityRLOutputProto  # noqa: E402
from mlagents_envs.environment import UnityEnvironment  # noqa: E402
from mlagents_envs.side_channel.engine_configuration_channel import EngineConfigurationChannel  # noqa: E402
from mlagents_envs.side_channel.side_channel_manager import SideChannelManager  # noqa: E402

from impala.envs.unity_client import FastUnityEnvironment, steps_from_proto  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


# -- the fast path is in use -------------------------------------------------------------------
def test_compiled_protobuf_serves_the_shipped_descriptors():
    assert mlagents_proto.implementation() == "upb", (
        "protobuf is not running its compiled upb runtime; scripts/setup.sh installs protobuf>=5"
    )
    assert mlagents_proto.installed()
    mods = mlagents_proto.served_modules()
    assert len(mods) >= 15, mods
    for name in mods:
        mod = sys.modules[name]
        assert mod.__mlagents_proto_served__, name
        # the descriptor in use is byte for byte the one protoc embedded in mlagents' file
        assert mod.DESCRIPTOR.serialized_pb == mlagents_proto.serialized_descriptor(mod.__file__)
    assert type(AgentInfoProto).__module__.startswith("google._upb"), type(AgentInfoProto)
    assert type(AgentInfoProto.DESCRIPTOR).__module__.startswith("google._upb")


def test_every_shipped_module_loads_through_the_hook():
    import importlib
    import pkgutil

    import mlagents_envs.communicator_objects as co

    names = [m.name for m in pkgutil.iter_modules(co.__path__) if m.name.endswith("_pb2")]
    assert len(names) == 21  # mlagents-envs 0.28 ships 21 message modules (+ the _grpc one)
    for n in names:
        mod = importlib.import_module(f"{co.__name__}.{n}")
        assert mod.__mlagents_proto_served__
    from mlagents_envs.communicator_objects.command_pb2 import QUIT, RESET, STEP

    assert (STEP, RESET, QUIT) == (0, 1, 2)


def test_without_the_hook_current_protobuf_refuses_mlagents_files():
    """Why the hook exists, and that importing impala.envs.unity first is enough."""
    code = "import mlagents_envs.environment"
    bare = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert bare.returncode != 0 and "Descriptors cannot be created directly" in bare.stderr
    hooked = subprocess.run(
        [sys.executable, "-c", "import impala.envs.unity; " + code], capture_output=True, text=True, cwd=ROOT
    )
    assert hooked.returncode == 0, hooked.stderr


def test_vec_env_uses_the_fast_environment(monkeypatch):
    import socket

    import fake_unity as fu

    for fast, cls in ((True, FastUnityEnvironment), (False, UnityEnvironment)):
        players = fu.install_in_process(monkeypatch, fu.FakeUnityConfig(), connect_timeout=10)
        with socket.socket() as s:
            s.bind(("localhost", 0))
            port = s.getsockname()[1]
        with UnityVecEnv("FakeUnity", base_port=port, timeout_wait=10, fast_client=fast) as env:
            assert type(env._env) is cls
        assert players[0].join(5)


# -- wire bytes, assembled by hand ---------------------------------------------------------------
def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(num: int, wire_type: int) -> bytes:
    return _varint(num << 3 | wire_type)


def _ld(num: int, payload: bytes) -> bytes:  # a length-delimited field
    return _field(num, 2) + _varint(len(payload)) + payload


_F_OBS_FLOAT_DATA = ObservationProto.DESCRIPTOR.fields_by_name["float_data"].number
_F_INFO_OBS = AgentInfoProto.DESCRIPTOR.fields_by_name["observations"].number
_F_OUT_RL = UnityOutputProto.DESCRIPTOR.fields_by_name["rl_output"].number
_F_RL_INFOS = UnityRLOutputProto.DESCRIPTOR.fields_by_name["agentInfos"].number


def obs_bytes(shape, values=None, *, encoding="packed", extra=b"", **fields) -> bytes:
    """An ObservationProto: shape etc. from the message class, the float data written by hand."""
    head = ObservationProto(shape=list(shape), **fields).SerializeToString()
    if values is None:
        return head
    vals = np.asarray(values, dtype="<f4").ravel()
    if encoding == "packed":
        data = _ld(1, vals.tobytes()) if vals.size else b""
    else:  # one fixed32 field per value, which parsers must accept for a packed field too
        data = b"".join(_field(1, 5) + struct.pack("<f", v) for v in vals.tolist())
    return head + _ld(_F_OBS_FLOAT_DATA, data + extra)


def agent_bytes(aid: int, reward: float, observations: list[bytes], **fields) -> bytes:
    head = AgentInfoProto(id=aid, reward=reward, **fields).SerializeToString()
    return head + b"".join(_ld(_F_INFO_OBS, o) for o in observations)


def output_bytes(behaviors: dict[str, list[bytes]]) -> bytes:
    """A UnityOutputProto whose rl_output.agentInfos[name].value are the given agents."""
    out = b""
    for name, agents in behaviors.items():
        entry = _ld(1, name.encode()) + _ld(2, b"".join(_ld(1, a) for a in agents))
        out += _ld(_F_OUT_RL, _ld(_F_RL_INFOS, entry))  # repeated occurrences merge
    return out


def spec(*shapes, continuous=20, discrete=()) -> tuple:
    return (tuple(tuple(s) for s in shapes), continuous, tuple(discrete))


def behavior_spec(desc: tuple) -> BehaviorSpec:
    shapes, continuous, discrete = desc
    return BehaviorSpec(
        [
            ObservationSpec(
                shape=s,
                dimension_property=(DimensionProperty.UNSPECIFIED,) * len(s),
                observation_type=ObservationType.DEFAULT,
                name=f"obs{i}",
            )
            for i, s in enumerate(shapes)
        ],
        ActionSpec(continuous, discrete),
    )


def _crawler_agents(rng, n=10, sizes=(126, 32), done=(), max_step=(), start_id=100):
    agents = []
    for i in range(n):
        obs = [obs_bytes((k,), rng.normal(size=k)) for k in sizes]
        agents.append(
            agent_bytes(
                start_id + i,
                float(rng.normal()),
                obs,
                done=i in done,
                max_step_reached=i in max_step,
                group_id=i % 3,
                group_reward=float(rng.normal()),
            )
        )
    return agents


def decode_cases() -> list[tuple[str, bytes, dict]]:
    """(name, UnityOutputProto bytes, {behavior: spec}) for good and bad input."""
    rng = np.random.default_rng(7)
    crawler = spec((126,), (32,))
    cases = []

    def add(name, behaviors, specs):
        cases.append((name, output_bytes(behaviors), specs))

    add("crawler", {"C?team=0": _crawler_agents(rng)}, {"C?team=0": crawler})
    add(
        "crawler_terminal_rows",
        {"C?team=0": _crawler_agents(rng, done=(1, 4, 7), max_step=(4,))},
        {"C?team=0": crawler},
    )
    add("all_terminal", {"C?team=0": _crawler_agents(rng, n=3, done=(0, 1, 2))}, {"C?team=0": crawler})
    add("no_agents", {"C?team=0": []}, {"C?team=0": crawler})
    add(
        "behavior_missing_from_message",
        {"C?team=0": _crawler_agents(rng, n=2)},
        {"C?team=0": crawler, "Other?team=0": spec((3,), continuous=2)},
    )
    add(
        "several_behaviors",
        {"A": _crawler_agents(rng, n=2, sizes=(5,)), "B": _crawler_agents(rng, n=3, sizes=(31, 1))},
        {"A": spec((5,), continuous=2), "B": spec((31,), (1,), continuous=1)},
    )
    add(
        "rank2_and_big",
        {
            "R": [
                agent_bytes(
                    i,
                    0.5,
                    [obs_bytes((4, 3), rng.normal(size=12)), obs_bytes((5000,), rng.normal(size=5000))],
                )
                for i in range(3)
            ]
        },
        {"R": spec((4, 3), (5000,))},
    )
    add(
        "empty_spec",
        {"Z": [agent_bytes(i, 1.0, [obs_bytes((0,), []), obs_bytes((2,), [1, 2])]) for i in range(2)]},
        {"Z": spec((0,), (2,))},
    )
    add(
        "special_floats",
        {"S": [agent_bytes(0, -0.0, [obs_bytes((6,), [-0.0, 1e-45, 3.4e38, -3.4e38, 1.5e-38, 1.0])])]},
        {"S": spec((6,))},
    )
    unpacked = _crawler_agents(rng, n=4)
    unpacked[2] = agent_bytes(
        102,
        0.25,
        [obs_bytes((126,), rng.normal(size=126), encoding="fixed32"), obs_bytes((32,), rng.normal(size=32))],
    )
    add("unpacked_floats_on_the_wire", {"C?team=0": unpacked}, {"C?team=0": crawler})
    unknown = _crawler_agents(rng, n=3)
    unknown[1] = agent_bytes(
        101,
        0.5,
        [
            obs_bytes((126,), rng.normal(size=126), extra=_field(9, 0) + _varint(5)),
            obs_bytes((32,), rng.normal(size=32)),
        ],
    )
    add("unknown_field_in_float_data", {"C?team=0": unknown}, {"C?team=0": crawler})
    # visual (rank 3, uncompressed) and discrete behaviours: mlagents' own code path
    add(
        "visual_uncompressed",
        {
            "V": [
                agent_bytes(i, 1.0, [obs_bytes((2, 2, 3), rng.normal(size=12)), obs_bytes((3,), [1, 2, 3])])
                for i in range(2)
            ]
        },
        {"V": spec((2, 2, 3), (3,), continuous=0, discrete=(2,))},
    )
    masks = [
        agent_bytes(i, 0.0, [obs_bytes((3,), [i, 0, 1])], action_mask=[i == 0, False, True, False, True])
        for i in range(3)
    ]
    add("discrete_with_masks", {"D": masks}, {"D": spec((3,), continuous=0, discrete=(2, 3))})

    # -- bad input ---
    def bad_obs(agent_obs):
        agents = _crawler_agents(rng, n=3)
        agents[1] = agent_bytes(101, 0.5, agent_obs)
        return {"C?team=0": agents}

    add(
        "nan_observation",
        bad_obs([obs_bytes((126,), [np.nan] * 126), obs_bytes((32,), np.zeros(32))]),
        {"C?team=0": crawler},
    )
    add(
        "inf_in_second_spec",
        bad_obs([obs_bytes((126,), np.zeros(126)), obs_bytes((32,), [np.inf] * 32)]),
        {"C?team=0": crawler},
    )
    add(
        "huge_finite_values_overflow_the_mean",
        bad_obs([obs_bytes((126,), [3e38] * 126), obs_bytes((32,), np.zeros(32))]),
        {"C?team=0": crawler},
    )
    nan_terminal = _crawler_agents(rng, n=3, done=(2,))
    nan_terminal[2] = agent_bytes(
        102, 0.5, [obs_bytes((126,), np.zeros(126)), obs_bytes((32,), [np.nan] * 32)], done=True
    )
    add("nan_terminal_observation", {"C?team=0": nan_terminal}, {"C?team=0": crawler})
    nan_reward = _crawler_agents(rng, n=3)
    nan_reward[0] = agent_bytes(
        100, float("nan"), [obs_bytes((126,), np.zeros(126)), obs_bytes((32,), np.zeros(32))]
    )
    add("nan_reward", {"C?team=0": nan_reward}, {"C?team=0": crawler})
    inf_group = _crawler_agents(rng, n=2)
    inf_group[1] = agent_bytes(
        101,
        0.0,
        [obs_bytes((126,), np.zeros(126)), obs_bytes((32,), np.zeros(32))],
        group_reward=float("inf"),
    )
    add("inf_group_reward", {"C?team=0": inf_group}, {"C?team=0": crawler})
    add(
        "one_agent_short",
        bad_obs([obs_bytes((126,), np.zeros(100)), obs_bytes((32,), np.zeros(32))]),
        {"C?team=0": crawler},
    )
    add(
        "one_agent_short_shape_says_so",
        bad_obs([obs_bytes((100,), np.zeros(100)), obs_bytes((32,), np.zeros(32))]),
        {"C?team=0": crawler},
    )
    add(
        "all_agents_wrong_size",
        {"C?team=0": _crawler_agents(rng, n=3, sizes=(120, 32))},
        {"C?team=0": crawler},
    )
    wrong = [
        agent_bytes(i, 0.0, [obs_bytes((126,), np.zeros(120)), obs_bytes((32,), np.zeros(32))])
        for i in range(3)
    ]
    add("all_agents_wrong_size_shape_unchanged", {"C?team=0": wrong}, {"C?team=0": crawler})
    add("missing_second_observation", bad_obs([obs_bytes((126,), np.zeros(126))]), {"C?team=0": crawler})
    add(
        "compressed_instead_of_floats",
        bad_obs(
            [
                obs_bytes((126,), compressed_data=b"\x89PNG", compression_type=PNG),
                obs_bytes((32,), np.zeros(32)),
            ]
        ),
        {"C?team=0": crawler},
    )
    good = output_bytes({"C?team=0": _crawler_agents(rng, n=2)})
    cases.append(("truncated_bytes", good[:-7], {"C?team=0": crawler}))
    cases.append(("garbage_bytes", b"\xff\xff\xff\xff\x0f" + good, {"C?team=0": crawler}))
    return cases


def decode_all(cases, use_mlagents: bool) -> dict[str, object]:
    """Decode every case; a result is a dict of arrays per behavior, or ('error', type, text)."""
    from google.protobuf.message import DecodeError

    fn = rpc_utils.steps_from_proto if use_mlagents else steps_from_proto
    results: dict[str, object] = {}
    for name, data, specs in cases:
        try:
            out = UnityOutputProto.FromString(data)
            res = {}
            for b, desc in specs.items():
                infos = out.rl_output.agentInfos[b].value if b in out.rl_output.agentInfos else []
                dec, term = fn(infos, behavior_spec(desc))
                res[b] = {
                    "dec_obs": dec.obs,
                    "dec_reward": dec.reward,
                    "dec_id": dec.agent_id,
                    "dec_mask": dec.action_mask,
                    "dec_group_id": list(dec.group_id),
                    "dec_group_reward": dec.group_reward,
                    "term_obs": term.obs,
                    "term_reward": term.reward,
                    "term_id": term.agent_id,
                    "term_interrupted": term.interrupted,
                    "term_group_id": list(term.group_id),
                    "term_group_reward": term.group_reward,
                }
            results[name] = res
        except DecodeError as exc:
            results[name] = ("error", "DecodeError", None)  # each runtime words it its own way
            del exc
        except Exception as exc:  # compared by type and message
            results[name] = ("error", type(exc).__name__, str(exc))
    return results


def _reference_main(cases_path: str, out_path: str) -> None:
    """Subprocess entry: mlagents' own decoding on the pure-Python protobuf."""
    assert mlagents_proto.implementation() == "python", mlagents_proto.implementation()
    with open(cases_path, "rb") as f:
        cases = pickle.load(f)
    with open(out_path, "wb") as f:
        pickle.dump(decode_all(cases, use_mlagents=True), f)


def _assert_same(a, b, where: str) -> None:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        assert isinstance(a, np.ndarray) and isinstance(b, np.ndarray), where
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        # bitwise: -0.0 stays -0.0 and NaN payloads are kept
        assert a.tobytes() == b.tobytes(), where
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a.keys(), b)
        for k in a:
            _assert_same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """mlagents' rpc_utils.steps_from_proto on the pure-Python protobuf, in a subprocess."""
    tmp = tmp_path_factory.mktemp("pb_ref")
    cases = decode_cases()
    (tmp / "cases.pkl").write_bytes(pickle.dumps(cases))
    env = dict(os.environ, PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")
    code = (
        f"import sys; sys.path.insert(0, {str(HERE)!r}); import test_unity_protobuf as t; "
        f"t._reference_main({str(tmp / 'cases.pkl')!r}, {str(tmp / 'ref.pkl')!r})"
    )
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return cases, pickle.loads((tmp / "ref.pkl").read_bytes())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_decoding_equals_pure_python_mlagents(reference):
    cases, ref = reference
    ours = decode_all(cases, use_mlagents=False)
    assert ours.keys() == ref.keys()
    for name in ref:
        _assert_same(ours[name], ref[name], name)
    # the cases do what their names say
    errors = {n: r[1] for n, r in ref.items() if isinstance(r, tuple)}
    assert errors == {
        "nan_observation": "RuntimeError",
        "inf_in_second_spec": "RuntimeError",
        "huge_finite_values_overflow_the_mean": "RuntimeError",
        "nan_terminal_observation": "RuntimeError",
        "nan_reward": "RuntimeError",
        "inf_group_reward": "RuntimeError",
        "one_agent_short": "ValueError",
        "one_agent_short_shape_says_so": "UnityObservationException",
        "all_agents_wrong_size": "UnityObservationException",
        "all_agents_wrong_size_shape_unchanged": "ValueError",
        "missing_second_observation": "IndexError",
        "compressed_instead_of_floats": "ValueError",
        "truncated_bytes": "DecodeError",
        "garbage_bytes": "DecodeError",
    }
    crawler = ref["crawler_terminal_rows"]["C?team=0"]
    assert len(crawler["dec_id"]) == 7 and crawler["term_interrupted"].tolist() == [False, True, False]
    assert crawler["dec_obs"][0].shape == (7, 126) and crawler["term_obs"][1].shape == (3, 32)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_decoding_equals_mlagents_on_upb(reference):
    """The same comparison in this process (upb), so a runtime difference could not hide one of ours."""
    cases, _ = reference
    ours = decode_all(cases, use_mlagents=False)
    theirs = decode_all(cases, use_mlagents=True)
    for name in theirs:
        _assert_same(ours[name], theirs[name], name)


def test_observations_are_the_values_sent():
    rng = np.random.default_rng(3)
    vals = rng.normal(size=(10, 158)).astype(np.float32)
    agents = [
        agent_bytes(i, 0.0, [obs_bytes((126,), vals[i, :126]), obs_bytes((32,), vals[i, 126:])])
        for i in range(10)
    ]
    out = UnityOutputProto.FromString(output_bytes({"C": agents}))
    dec, term = steps_from_proto(out.rl_output.agentInfos["C"].value, behavior_spec(spec((126,), (32,))))
    np.testing.assert_array_equal(np.concatenate(dec.obs, axis=1), vals)
    assert len(term) == 0 and term.obs[0].shape == (0, 126)
    # like mlagents' arrays: aligned, writeable, native float32, not tied to the message's bytes
    # (also for one agent, whose row slice would otherwise be a read-only view)
    one, _ = steps_from_proto(out.rl_output.agentInfos["C"].value[:1], behavior_spec(spec((126,), (32,))))
    for arr in [*dec.obs, *one.obs]:
        assert arr.dtype == np.float32 and arr.flags.c_contiguous and arr.flags.aligned
        assert arr.flags.writeable
    np.testing.assert_array_equal(one.obs[1], vals[:1, 126:])


# -- encoding ---------------------------------------------------------------------------------
def _bare_env(cls, state: dict[str, int]):
    """An environment object with only what _generate_step_input reads (no connection)."""
    env = object.__new__(cls)
    env._env_state = {
        b: (
            DecisionSteps(
                [np.zeros((n, 1), np.float32)],
                np.zeros(n, np.float32),
                np.arange(n, dtype=np.int32),
                None,
                [0] * n,
                np.zeros(n, np.float32),
            ),
            None,
        )
        for b, n in state.items()
    }
    channel = EngineConfigurationChannel()
    channel.set_configuration_parameters(time_scale=20.0, target_frame_rate=-1)
    env._side_channel_manager = SideChannelManager([channel])
    return env


def test_step_input_bytes_equal_mlagents():
    rng = np.random.default_rng(11)
    special = np.array([0.0, -0.0, 1e-45, 3.4e38, -1.0, np.inf, -np.inf, np.nan], np.float32)
    cont = rng.uniform(-1, 1, size=(10, 20)).astype(np.float32)
    cont[3, :8] = special
    state = {"Crawler?team=0": 10, "Disc": 3, "Hybrid": 4, "Nobody": 0, "OnlyCont": 2}
    actions = {
        "Crawler?team=0": ActionTuple(continuous=cont),
        "Disc": ActionTuple(discrete=np.array([[0, 2], [1, 0], [2, 1]], np.int32)),
        "Hybrid": ActionTuple(
            continuous=rng.normal(size=(4, 3)).astype(np.float32),
            discrete=np.array([[4], [0], [1], [2]], np.int32),
        ),
        "Nobody": ActionTuple(continuous=np.zeros((0, 2), np.float32)),
        "OnlyCont": ActionTuple(continuous=np.ones((2, 1), np.float32)),
    }
    fast = FastUnityEnvironment._generate_step_input(_bare_env(FastUnityEnvironment, state), actions)
    orig = UnityEnvironment._generate_step_input(_bare_env(UnityEnvironment, state), actions)
    assert fast.SerializeToString(deterministic=True) == orig.SerializeToString(deterministic=True)
    assert len(fast.rl_input.agent_actions["Crawler?team=0"].value) == 10
    assert len(fast.rl_input.side_channel) > 0

    # a step where nobody asked for a decision
    empty = {"Nobody": ActionTuple(continuous=np.zeros((0, 2), np.float32))}
    assert FastUnityEnvironment._generate_step_input(
        _bare_env(FastUnityEnvironment, {"Nobody": 0}), empty
    ).SerializeToString(deterministic=True) == UnityEnvironment._generate_step_input(
        _bare_env(UnityEnvironment, {"Nobody": 0}), empty
    ).SerializeToString(deterministic=True)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_fast_path_taken_on_good_input_and_mlagents_code_on_the_rest(monkeypatch):
    import impala.envs.unity_client as uc

    calls: list[str] = []
    original = rpc_utils.steps_from_proto

    def counted(infos, bspec):
        calls.append(current)
        return original(infos, bspec)

    monkeypatch.setattr(uc.rpc_utils, "steps_from_proto", counted)
    fell_back = set()
    for current, data, specs in decode_cases():
        calls.clear()
        decode_all([(current, data, specs)], use_mlagents=False)
        if calls:
            fell_back.add(current)
    assert fell_back == {
        "unknown_field_in_float_data",
        "visual_uncompressed",
        "discrete_with_masks",
        "one_agent_short",
        "one_agent_short_shape_says_so",
        "all_agents_wrong_size",
        "all_agents_wrong_size_shape_unchanged",
        "missing_second_observation",
        "compressed_instead_of_floats",
    }


# -- the communicator's in-process channel ------------------------------------------------------
def test_channel_behaves_like_a_pipe():
    import threading
    import time

    from impala.envs.unity_client import _QueueServicer

    s = _QueueServicer()
    parent, child = s.parent_conn, s.child_conn
    assert not parent.poll(0) and not parent.poll(0.05)
    msg = object()
    child.send(msg)
    assert parent.poll(0) and parent.poll(1) and parent.recv() is msg  # by reference, no copy
    threading.Timer(0.1, child.send, args=("late",)).start()
    t0 = time.monotonic()
    assert parent.poll(5) and time.monotonic() - t0 < 4 and parent.recv() == "late"

    parent.send("400")  # what RpcCommunicator.close sends before closing its end
    parent.close()
    assert child.recv() == "400"  # sent before close: still delivered
    for _ in range(2):
        with pytest.raises(EOFError):
            child.recv()
    with pytest.raises(BrokenPipeError):
        child.send("request after close")
    with pytest.raises(EOFError):
        parent.recv()


def test_handler_never_waits_after_close(monkeypatch):
    """A request arriving after close fails at once instead of holding a gRPC worker thread
    (whose executor the interpreter joins at exit)."""
    import socket
    import threading

    import fake_unity as fu

    players = fu.install_in_process(monkeypatch, fu.FakeUnityConfig(), connect_timeout=10)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = UnityVecEnv("FakeUnity", base_port=port, timeout_wait=10)
    env.reset()
    env.step(np.zeros((3, 2), np.float32))
    servicer = env._env._communicator.unity_to_external
    env.close()
    assert players[0].join(5) and players[0].shutdown == "quit"
    errors: list[BaseException] = []

    def late_exchange():
        try:
            servicer.Exchange(object(), None)
        except BaseException as exc:  # noqa: BLE001 - recorded for the assertion
            errors.append(exc)

    t = threading.Thread(target=late_exchange, daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive() and len(errors) == 1 and isinstance(errors[0], BrokenPipeError)


def test_process_exits_after_close_with_the_fast_communicator(tmp_path):
    code = f"""
import sys, socket
sys.path.insert(0, {str(HERE)!r})
import numpy as np
import fake_unity as fu
from impala.envs.unity import UnityVecEnv
build = fu.write_fake_build({str(tmp_path / "FakeCrawler.x86_64")!r}, preset="crawler")
with socket.socket() as s:
    s.bind(("localhost", 0)); port = s.getsockname()[1]
env = UnityVecEnv(str(build), base_port=port, timeout_wait=30)
env.reset()
for _ in range(5):
    env.step(np.zeros((5, 20), np.float32))
env.close()
print("closed")
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0 and "closed" in res.stdout, res.stderr[-2000:]
