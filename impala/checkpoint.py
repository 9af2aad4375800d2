"""Atomic checkpoints: write to a temporary file beside the target, fsync, then rename.

A crash mid-write leaves the previous checkpoint intact; readers never see a
half-written file. A state holding a NaN or infinite float tensor is refused before
anything is written, so a diverged run never replaces a good checkpoint. Loading uses
``weights_only=True``: a checkpoint holds tensors and plain data only, so loading one
cannot execute code; a file that is not such a checkpoint is one ``CheckpointError``.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from impala.config import ConfigError


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used; the message names the file and the problem."""


def non_finite_tensors(state: Any, prefix: str = "") -> list[str]:
    """Names of the floating-point tensors in a nested state that hold NaN or inf."""
    if isinstance(state, torch.Tensor):
        return [prefix or "<tensor>"] if state.is_floating_point() and not bool(torch.isfinite(state).all()) else []
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    return [name for key, value in items for name in non_finite_tensors(value, f"{prefix}.{key}" if prefix else str(key))]


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
    bad = non_finite_tensors(state)
    if bad:
        raise CheckpointError(f"not writing {path}: {len(bad)} tensor(s) hold NaN or inf ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load_checkpoint(path: str, map_location: str | torch.device = "cpu", *, keys: tuple[str, ...] = ()) -> dict[str, Any]:
    """Load a checkpoint this program wrote; ``keys`` must all be present at the top level."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}; run without --resume, or point --logdir at a run that has one")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} is not a file")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - any failure to parse means the same thing to the user
        # torch's own message suggests weights_only=False, i.e. running code from the file: never.
        kind = "empty" if os.path.getsize(path) == 0 else f"truncated or not a checkpoint ({type(e).__name__})"
        raise CheckpointError(f"checkpoint {path} cannot be read: {kind}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path} holds a {type(state).__name__}, not a checkpoint dict")
    missing = [k for k in keys if k not in state]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks {', '.join(missing)}: not a checkpoint of this program")
    return state


def check_logdir(path: str) -> None:
    """Fail at start-up, not at the first checkpoint, when the run could not save anything."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--logdir {path}: cannot create it ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--logdir {path}: not writable")
