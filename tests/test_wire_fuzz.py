"""Property-based fuzzing of the wire decoders: whatever bytes a peer sends, decoding
either returns a message that matches the schema or raises ``WireError``, never anything else."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from impala.transport import wire
from impala.transport.trajectory import impala_unroll_schema

SCHEMA = impala_unroll_schema(3, (2,), "float32", 2)
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _valid_frames(seed: int = 0) -> list[bytes]:
    arrays = SCHEMA.allocate()
    rng = np.random.default_rng(seed)
    for name, value in arrays.items():
        if value.dtype.kind == "f":
            value[...] = rng.standard_normal(value.shape)
    return [
        bytes(f)
        for f in wire.encode("unroll", actor=3, version=1, arrays=arrays, info=wire.episode_info([1.0], [5]))
    ]


def _decodes_or_wire_error(fn, *args, **kwargs):
    try:
        msg = fn(*args, **kwargs)
    except wire.WireError:
        return None
    if kwargs.get("schema") is not None:
        for spec in kwargs["schema"].arrays:
            arr = msg.arrays[spec.name]
            assert arr.dtype == np.dtype(spec.dtype) and arr.shape == tuple(spec.shape)
    return msg


@FUZZ
@given(st.lists(st.binary(max_size=300), min_size=0, max_size=8))
def test_random_frames(frames):
    _decodes_or_wire_error(wire.decode, frames, schema=SCHEMA)
    _decodes_or_wire_error(wire.decode, frames)


@FUZZ
@given(st.binary(max_size=2000))
def test_random_packed_bytes(blob):
    _decodes_or_wire_error(wire.decode_packed, blob, schema=SCHEMA)
    _decodes_or_wire_error(wire.decode_packed, blob)


@FUZZ
@given(st.data())
def test_mutated_valid_messages(data):
    frames = _valid_frames(data.draw(st.integers(0, 3)))
    i = data.draw(st.integers(0, len(frames) - 1))
    frame = bytearray(frames[i])
    op = data.draw(st.sampled_from(["flip", "truncate", "extend", "drop_frame", "dup_frame"]))
    if op == "flip" and frame:
        pos = data.draw(st.integers(0, len(frame) - 1))
        frame[pos] ^= data.draw(st.integers(1, 255))
        frames[i] = bytes(frame)
    elif op == "truncate":
        frames[i] = bytes(frame[: data.draw(st.integers(0, len(frame)))])
    elif op == "extend":
        frames[i] = bytes(frame) + data.draw(st.binary(min_size=1, max_size=64))
    elif op == "drop_frame":
        del frames[i]
    else:
        frames.insert(i, frames[i])
    _decodes_or_wire_error(wire.decode, frames, schema=SCHEMA)
    packed = b"".join(frames)  # a nonsense packing of the parts: still only WireError
    _decodes_or_wire_error(wire.decode_packed, packed, schema=SCHEMA)


JSONISH = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=20,
)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["schema", "kind", "actor", "version", "arrays", "info", "x"]), JSONISH, max_size=7
    )
)
def test_forged_headers(fields):
    frames = _valid_frames()
    header = json.loads(frames[0])
    header.update(fields)
    forged = [json.dumps(header).encode()] + frames[1:]
    msg = _decodes_or_wire_error(wire.decode, forged, schema=SCHEMA)
    if msg is not None:
        assert isinstance(msg.actor, int) and 0 <= msg.actor < (1 << 20) and isinstance(msg.info, dict)
        try:
            wire.parse_episode_info(msg.info)
        except wire.WireError:
            pass


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_round_trip(seed):
    frames = _valid_frames(seed)
    msg = wire.decode(frames, schema=SCHEMA)
    again = wire.decode(
        wire.encode("unroll", actor=msg.actor, version=msg.version, arrays=msg.arrays, info=msg.info),
        schema=SCHEMA,
    )
    for name in msg.arrays:
        np.testing.assert_array_equal(msg.arrays[name], again.arrays[name])
    packed = wire.decode_packed(
        wire.encode_packed("unroll", actor=3, version=1, arrays=msg.arrays, info=msg.info), schema=SCHEMA
    )
    for name in msg.arrays:
        np.testing.assert_array_equal(msg.arrays[name], packed.arrays[name])
