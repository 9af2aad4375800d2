"""The wire format: a JSON header plus one raw frame per array. Never pickle.

A message is a ZeroMQ multipart message::

    frame 0: UTF-8 JSON header {"schema": 1, "kind": ..., "actor": int, "version": int,
                                "arrays": [[name, dtype, shape], ...], "info": {...}}
    frame 1..n: the raw bytes of each array, C order, in header order

Decoding trusts nothing: the header's size, its keys and their types, the
array list (names, dtypes, shapes must equal the expected schema exactly), each
frame's byte length and the total size are all checked *before* any array is
built, and arrays are then views over the received frames (no copy). A pickle
from the network would execute code, so none is ever loaded.

Parameters travel *packed* in one frame (``encode_packed``): a 4-byte
little-endian header length, the same JSON header, then the arrays' bytes, each
starting at a multiple of 8. One frame lets the actors' SUB sockets use
``ZMQ_CONFLATE`` (keep only the newest message), which works only for
single-part messages; without it, weights queued in socket buffers would be
hundreds of versions stale by the time an actor reads them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from impala.transport.trajectory import TrajectorySchema

WIRE_SCHEMA_VERSION = 1
MAX_HEADER_BYTES = 64 * 1024
MAX_EPISODES_PER_MESSAGE = 4096
KINDS = ("hello", "unroll", "params", "bye")
# No bfloat16: numpy has no such dtype without ml_dtypes; weights travel as float32.
_ALLOWED_DTYPES = {"uint8", "int8", "int32", "int64", "float16", "float32", "float64", "bool"}


class WireError(ValueError):
    """A message that does not conform to the wire format or its schema."""


@dataclass
class Message:
    """A decoded message: its kind, the sender's actor id and policy version, arrays and info."""

    kind: str
    actor: int
    version: int
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)


MAX_ACTOR_ID = 1 << 20  # actor ids on the wire are in [0, MAX_ACTOR_ID]


def encode(
    kind: str,
    *,
    actor: int,
    version: int,
    arrays: Mapping[str, np.ndarray] | None = None,
    info: Mapping[str, Any] | None = None,
) -> list[Any]:
    """Frames for ``socket.send_multipart(frames, copy=False)``."""
    if kind not in KINDS:
        raise WireError(f"unknown message kind {kind!r}")
    arrays = arrays or {}
    header = {
        "schema": WIRE_SCHEMA_VERSION,
        "kind": kind,
        "actor": int(actor),
        "version": int(version),
        "arrays": [[name, a.dtype.name, list(a.shape)] for name, a in arrays.items()],
        "info": dict(info or {}),
    }
    frames: list[Any] = [json.dumps(header, allow_nan=False).encode()]
    for a in arrays.values():
        frames.append(memoryview(np.ascontiguousarray(a)).cast("B"))
    return frames


def _frame_bytes(frame: Any) -> memoryview:
    # zmq.Frame (copy=False) exposes .buffer; bytes and memoryviews work as they are.
    buf = getattr(frame, "buffer", frame)
    return memoryview(buf).cast("B")


def _check_int(header: dict, key: str, lo: int, hi: int) -> int:
    v = header.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise WireError(f"header field {key!r} must be an int in [{lo}, {hi}], got {v!r}")
    return v


def decode_header(frame: Any) -> dict[str, Any]:
    """A message's JSON header, size- and type-checked; WireError otherwise."""
    raw = _frame_bytes(frame)
    if len(raw) > MAX_HEADER_BYTES:
        raise WireError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        header = json.loads(bytes(raw).decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise WireError(f"header is not valid JSON: {type(e).__name__}: {str(e)[:200]}") from None
    if not isinstance(header, dict):
        raise WireError("header is not a JSON object")
    if header.get("schema") != WIRE_SCHEMA_VERSION:
        raise WireError(
            f"wire schema {header.get('schema')!r} != {WIRE_SCHEMA_VERSION}: actor and learner versions "
            "differ"
        )
    if header.get("kind") not in KINDS:
        raise WireError(f"unknown message kind {header.get('kind')!r}")
    _check_int(header, "actor", 0, MAX_ACTOR_ID)
    _check_int(header, "version", -1, 1 << 62)
    if not isinstance(header.get("arrays"), list) or not isinstance(header.get("info"), dict):
        raise WireError("header needs an 'arrays' list and an 'info' object")
    return header


def _reject_constant(name: str) -> None:
    raise WireError(f"header contains non-finite number {name}")


def decode(
    frames: Sequence[Any],
    *,
    schema: TrajectorySchema | None = None,
    max_bytes: int = 256 * 1024 * 1024,
    expect_kind: str | None = None,
) -> Message:
    """Validate and decode a multipart message.

    Args:
        frames: the received frames (bytes, memoryviews or ``zmq.Frame``).
        schema: when given, the arrays must match it exactly (names, order,
            dtypes, shapes); otherwise only dtype whitelisting and size limits apply.
        max_bytes: bound on the total payload.
        expect_kind: reject any other kind.
    """
    if not frames:
        raise WireError("empty message")
    header = decode_header(frames[0])
    kind = header["kind"]
    if expect_kind is not None and kind != expect_kind:
        raise WireError(f"expected a {expect_kind!r} message, got {kind!r}")
    specs = header["arrays"]
    if len(specs) != len(frames) - 1:
        raise WireError(f"header lists {len(specs)} arrays but {len(frames) - 1} frames followed")
    if schema is not None:
        want = [[a.name, a.dtype, list(a.shape)] for a in schema.arrays]
        if specs != want:
            raise WireError(f"arrays {specs_summary(specs)} do not match the schema {specs_summary(want)}")
    total = 0
    arrays: dict[str, np.ndarray] = {}
    for spec, frame in zip(specs, frames[1:]):
        if not (
            isinstance(spec, list)
            and len(spec) == 3
            and isinstance(spec[0], str)
            and isinstance(spec[1], str)
        ):
            raise WireError(f"bad array spec {spec!r}")
        name, dtype, shape = spec
        if dtype not in _ALLOWED_DTYPES:
            raise WireError(f"array {name!r}: dtype {dtype!r} not allowed")
        # type() is int, not isinstance: JSON true would pass as 1 (and equal the schema's 1).
        if (
            not isinstance(shape, list)
            or len(shape) > 8
            or not all(type(d) is int and 0 <= d < (1 << 31) for d in shape)
        ):
            raise WireError(f"array {name!r}: bad shape {shape!r}")
        if name in arrays:
            raise WireError(f"array {name!r} appears twice")
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        total += nbytes
        if total > max_bytes:
            raise WireError(f"message payload exceeds {max_bytes} bytes")
        buf = _frame_bytes(frame)
        if len(buf) != nbytes:
            raise WireError(f"array {name!r}: frame has {len(buf)} bytes, {dtype}{shape} needs {nbytes}")
        arrays[name] = np.frombuffer(buf, dtype=dtype).reshape(shape)
    return Message(kind, header["actor"], header["version"], arrays, header["info"])


def _align8(n: int) -> int:
    return (n + 7) & ~7


def encode_packed(
    kind: str,
    *,
    actor: int,
    version: int,
    arrays: Mapping[str, np.ndarray],
    info: Mapping[str, Any] | None = None,
) -> bytes:
    """One frame: length-prefixed header, then 8-byte-aligned array bytes."""
    frames = encode(kind, actor=actor, version=version, arrays=arrays, info=info)
    header = frames[0]
    parts = [len(header).to_bytes(4, "little"), header]
    offset = _align8(4 + len(header))
    parts.append(b"\0" * (offset - 4 - len(header)))
    for frame in frames[1:]:
        parts.append(frame)
        pad = _align8(len(frame)) - len(frame)
        if pad:
            parts.append(b"\0" * pad)
    return b"".join(parts)


def decode_packed(
    frame: Any,
    *,
    schema: TrajectorySchema | None = None,
    max_bytes: int = 256 * 1024 * 1024,
    expect_kind: str | None = None,
) -> Message:
    """Split a packed frame into header and array views, then ``decode`` them."""
    buf = _frame_bytes(frame)
    if len(buf) < 4:
        raise WireError("packed message shorter than its length prefix")
    hlen = int.from_bytes(buf[:4], "little")
    if hlen > MAX_HEADER_BYTES or 4 + hlen > len(buf):
        raise WireError(f"packed header length {hlen} is out of range")
    header_bytes = buf[4 : 4 + hlen]
    header = decode_header(header_bytes)
    offset = _align8(4 + hlen)
    frames: list[Any] = [header_bytes]
    for spec in header["arrays"]:
        try:
            if not (
                isinstance(spec, list)
                and len(spec) == 3
                and spec[1] in _ALLOWED_DTYPES
                and isinstance(spec[2], list)
            ):
                raise TypeError("not [name, dtype, shape]")
            name, dtype, shape = spec
            if not all(type(d) is int and 0 <= d < (1 << 31) for d in shape):
                raise TypeError("bad shape")
            nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        except (TypeError, ValueError) as e:
            raise WireError(f"bad array spec {spec!r}: {e}") from None
        if nbytes < 0 or offset + nbytes > len(buf) or nbytes > max_bytes:
            raise WireError(f"array {name!r} runs past the end of the packed message")
        frames.append(buf[offset : offset + nbytes])
        offset += _align8(nbytes)
    if offset != _align8(len(buf)):
        raise WireError(f"packed message has {len(buf) - offset} trailing bytes")
    return decode(frames, schema=schema, max_bytes=max_bytes, expect_kind=expect_kind)


def specs_summary(specs: list) -> str:
    """Array specs as short text for error lines (``obs:uint8[32, 84, 84]``)."""
    return ", ".join(
        f"{s[0]}:{s[1]}{s[2]}" if isinstance(s, list) and len(s) == 3 else repr(s) for s in specs
    )


def episode_info(returns: Sequence[float], lengths: Sequence[int]) -> dict[str, Any]:
    """Finished episodes' returns and lengths as a message's info."""
    return {"episode_returns": [float(r) for r in returns], "episode_lengths": [int(n) for n in lengths]}


def parse_episode_info(info: Mapping[str, Any]) -> tuple[list[float], list[int]]:
    """Episode stats from an unroll header, validated (finite, bounded, matching lengths)."""
    returns = info.get("episode_returns", [])
    lengths = info.get("episode_lengths", [])
    if not isinstance(returns, list) or not isinstance(lengths, list) or len(returns) != len(lengths):
        raise WireError("episode_returns and episode_lengths must be lists of equal length")
    if len(returns) > MAX_EPISODES_PER_MESSAGE:
        raise WireError(f"more than {MAX_EPISODES_PER_MESSAGE} episodes in one message")
    # type() checks: bools are ints in Python, and a 400-digit JSON int would overflow isfinite.
    if not all(
        (type(r) is float and math.isfinite(r)) or (type(r) is int and abs(r) < 2**53) for r in returns
    ):
        raise WireError("episode_returns must be finite numbers")
    if not all(type(n) is int and 0 <= n < 2**53 for n in lengths):
        raise WireError("episode_lengths must be non-negative ints")
    return [float(r) for r in returns], [int(n) for n in lengths]


def check_bounded(
    arrays: Mapping[str, np.ndarray], bound: float, names: Iterable[str] | None = None
) -> str | None:
    """A message naming the first floating-point array (of ``names``, default all) holding a value
    above ``bound`` in absolute value, else None. Finite but huge values overflow an update."""
    for name in arrays if names is None else names:
        a = arrays[name]
        if a.dtype.kind == "f" and a.size:
            peak = float(np.abs(a).max())
            if peak > bound:
                return f"{name} exceeds --max-abs-value {bound:g} (max |x| = {peak:.3g})"
    return None


def check_finite(arrays: Mapping[str, np.ndarray]) -> str | None:
    """Name of the first floating-point array holding NaN/inf, else None."""
    for name, a in arrays.items():
        if a.dtype.kind == "f" and not np.isfinite(a).all():
            return name
    return None
