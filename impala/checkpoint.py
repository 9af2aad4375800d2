"""Atomic checkpoints: write to a temporary file beside the target, fsync, then rename.

A crash mid-write leaves the previous checkpoint intact; readers never see a
half-written file. Loading uses ``weights_only=True``: a checkpoint holds
tensors and plain data only, so loading one cannot execute code.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch

from impala.config import ConfigError


def save_checkpoint(path: str, state: dict[str, Any]) -> None:
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


def load_checkpoint(path: str, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    if not os.path.exists(path):
        raise FileNotFoundError(f"no checkpoint at {path}; run without --resume, or point --logdir at a run that has one")
    return torch.load(path, map_location=map_location, weights_only=True)


def check_logdir(path: str) -> None:
    """Fail at start-up, not at the first checkpoint, when the run could not save anything."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--logdir {path}: cannot create it ({e.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"--logdir {path}: not writable")
