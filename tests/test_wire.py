"""The wire codec: round trips, and every kind of bad message is rejected before allocation."""

import json

import numpy as np
import pytest

from impala.transport import wire
from impala.transport.trajectory import impala_unroll_schema, stack_time_major

SCHEMA = impala_unroll_schema(5, (4,), "float32", 3)


def _unroll(rng):
    u = SCHEMA.allocate()
    u["obs"][:] = rng.normal(size=u["obs"].shape)
    u["actions"][:] = rng.integers(0, 3, size=5)
    u["rewards"][:] = rng.normal(size=5)
    u["behaviour_logits"][:] = rng.normal(size=(5, 3))
    u["dones"][2] = True
    u["first"][3] = True
    return u


def _bytes(frames):
    return [bytes(f) for f in frames]


def test_round_trip_is_exact_and_zero_copy():
    rng = np.random.default_rng(0)
    u = _unroll(rng)
    frames = _bytes(wire.encode("unroll", actor=3, version=7, arrays=u, info=wire.episode_info([1.5], [10])))
    msg = wire.decode(frames, schema=SCHEMA)
    assert (msg.kind, msg.actor, msg.version) == ("unroll", 3, 7)
    for name in SCHEMA.names:
        np.testing.assert_array_equal(msg.arrays[name], u[name])
        assert msg.arrays[name].dtype == u[name].dtype
    assert wire.parse_episode_info(msg.info) == ([1.5], [10])
    # The arrays are views over the received frames, not copies.
    assert not msg.arrays["obs"].flags.owndata


def test_packed_round_trip():
    rng = np.random.default_rng(1)
    arrays = {
        "w": rng.normal(size=(3, 5)).astype(np.float32),
        "b": np.arange(3, dtype=np.int64),
        "flag": np.array([True]),
    }
    frame = wire.encode_packed("params", actor=0, version=11, arrays=arrays, info={"run": {"x": 1}})
    msg = wire.decode_packed(frame, expect_kind="params")
    assert msg.version == 11 and msg.info["run"] == {"x": 1}
    for k in arrays:
        np.testing.assert_array_equal(msg.arrays[k], arrays[k])


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda fr: [b"\xff\xfe not json"] + fr[1:], "not valid JSON"),
        (lambda fr: [b"[1, 2]"] + fr[1:], "not a JSON object"),
        (lambda fr: fr[:-1], "frames followed"),  # a missing frame
        (lambda fr: fr[:1] + [fr[1][:-4]] + fr[2:], "needs"),  # a truncated frame
        (lambda fr: fr + [b"extra"], "frames followed"),
    ],
)
def test_malformed_and_truncated_messages_are_rejected(mutate, match):
    frames = _bytes(wire.encode("unroll", actor=1, version=0, arrays=_unroll(np.random.default_rng(2))))
    with pytest.raises(wire.WireError, match=match):
        wire.decode(mutate(frames), schema=SCHEMA)


def _with_header(frames, **changes):
    header = json.loads(frames[0])
    header.update(changes)
    return [json.dumps(header).encode()] + frames[1:]


def test_wrong_schema_dtype_shape_and_version_are_rejected():
    frames = _bytes(wire.encode("unroll", actor=1, version=0, arrays=_unroll(np.random.default_rng(3))))
    header = json.loads(frames[0])
    bad_dtype = [list(a) for a in header["arrays"]]
    bad_dtype[3][1] = "float64"  # rewards
    with pytest.raises(wire.WireError, match="do not match the schema"):
        wire.decode(_with_header(frames, arrays=bad_dtype), schema=SCHEMA)
    bad_shape = [list(a) for a in header["arrays"]]
    bad_shape[0][2] = [6, 5]
    with pytest.raises(wire.WireError, match="do not match the schema"):
        wire.decode(_with_header(frames, arrays=bad_shape), schema=SCHEMA)
    with pytest.raises(wire.WireError, match="wire schema"):
        wire.decode(_with_header(frames, schema=99), schema=SCHEMA)
    with pytest.raises(wire.WireError, match="kind"):
        wire.decode(_with_header(frames, kind="exec"), schema=SCHEMA)
    with pytest.raises(wire.WireError, match="actor"):
        wire.decode(_with_header(frames, actor="0; rm -rf"), schema=SCHEMA)


def test_sizes_are_checked_before_allocation():
    # A header claiming a 2**40-element array, with a tiny frame: rejected by arithmetic, nothing allocated.
    header = {
        "schema": 1,
        "kind": "unroll",
        "actor": 0,
        "version": 0,
        "arrays": [["obs", "uint8", [1 << 20, 1 << 20]]],
        "info": {},
    }
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.decode([json.dumps(header).encode(), b"x"], max_bytes=1 << 30)
    header["arrays"] = [["obs", "object", [1]]]
    with pytest.raises(wire.WireError, match="not allowed"):
        wire.decode([json.dumps(header).encode(), b"x" * 8])
    with pytest.raises(wire.WireError, match="exceeds"):
        wire.decode([b" " * (wire.MAX_HEADER_BYTES + 1)])


def test_packed_message_bounds():
    frame = wire.encode_packed("params", actor=0, version=1, arrays={"w": np.ones(4, np.float32)})
    with pytest.raises(wire.WireError):
        wire.decode_packed(frame[:-8])
    with pytest.raises(wire.WireError):
        wire.decode_packed(frame + b"\0" * 16)
    with pytest.raises(wire.WireError, match="length"):
        wire.decode_packed((10**6).to_bytes(4, "little") + b"{}")


def test_non_finite_values_and_episode_info():
    u = _unroll(np.random.default_rng(4))
    assert wire.check_finite(u) is None
    u["rewards"][1] = np.nan
    assert wire.check_finite(u) == "rewards"
    with pytest.raises(ValueError):
        wire.encode("unroll", actor=0, version=0, info={"episode_returns": [float("nan")]})
    raw = b'{"schema": 1, "kind": "hello", "actor": 0, "version": 0, "arrays": [], "info": {"x": NaN}}'
    with pytest.raises(wire.WireError, match="non-finite"):
        wire.decode([raw])
    with pytest.raises(wire.WireError):
        wire.parse_episode_info({"episode_returns": [1.0, 2.0], "episode_lengths": [3]})
    with pytest.raises(wire.WireError):
        wire.parse_episode_info({"episode_returns": ["1"], "episode_lengths": [3]})


def test_stack_time_major():
    rng = np.random.default_rng(5)
    us = [_unroll(rng) for _ in range(3)]
    batch = stack_time_major(us, SCHEMA)
    assert batch["obs"].shape == (6, 3, 4)
    assert batch["behaviour_logits"].shape == (5, 3, 3)
    np.testing.assert_array_equal(batch["rewards"][:, 1], us[1]["rewards"])


def test_bool_dimensions_and_huge_ints_are_rejected():
    frames = _bytes(wire.encode("unroll", actor=1, version=0, arrays=_unroll(np.random.default_rng(6))))
    header = json.loads(frames[0])
    header["arrays"][3][2] = [True]  # rewards [5] declared as [true]: JSON true must not pass as a size
    with pytest.raises(wire.WireError, match="bad shape"):
        wire.decode([json.dumps(header).encode()] + frames[1:])
    with pytest.raises(wire.WireError):
        wire.parse_episode_info({"episode_returns": [10**400], "episode_lengths": [1]})
    with pytest.raises(wire.WireError):
        wire.parse_episode_info({"episode_returns": [1.0], "episode_lengths": [True]})
    with pytest.raises(wire.WireError, match="not valid JSON"):
        wire.decode([b"[" * 20000 + b"]" * 20000])
