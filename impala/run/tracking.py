"""Optional experiment tracking: Weights & Biases (``--track``, ``pip install -e '.[track]'``).

The tracker receives exactly the rows TensorBoard and metrics.csv get, plus the run's resolved
configuration and the git commit it ran from. ``WANDB_MODE=offline`` (what the tests use) writes
the run under LOGDIR/wandb without any network; ``wandb sync`` uploads it later. A resumed run
(``--resume``) continues the same W&B run (its id is kept in LOGDIR/wandb_id).
"""

from __future__ import annotations

import os
import subprocess
from typing import Any, Mapping

from impala.options import ConfigError


def git_commit(path: str | None = None) -> str | None:
    """The commit the code runs from (with a ``-dirty`` suffix for local changes), or None outside git."""
    where = path or os.path.dirname(os.path.abspath(__file__))
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=where,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("-dirty" if dirty else "")


class WandbTracker:
    """One W&B run per training run; ``log`` mirrors MetricsLogger.log."""

    def __init__(
        self, *, project: str, logdir: str, name: str, config: Mapping[str, Any], resume: bool
    ) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError(
                "--track needs Weights & Biases: pip install -e '.[track]' (or pip install wandb)"
            ) from None
        self._wandb = wandb
        id_file = os.path.join(logdir, "wandb_id")
        run_id = None
        if resume and os.path.exists(id_file):
            with open(id_file) as f:
                run_id = f.read().strip() or None
        try:
            self.run = wandb.init(
                project=project,
                name=name,
                dir=logdir,
                id=run_id,
                resume="allow" if run_id else None,
                config={**config, "git_commit": git_commit()},
                reinit=True,
            )
        except Exception as e:  # noqa: BLE001 - wandb raises its own types for auth/network problems
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"--track: Weights & Biases could not start a run ({first}); set WANDB_MODE=offline to log "
                "without a network"
            ) from None
        with open(id_file, "w") as f:
            f.write(self.run.id)

    def log(self, step: int, row: Mapping[str, float]) -> None:
        self.run.log(dict(row), step=step)

    def log_video(self, step: int, key: str, path: str) -> None:
        self.run.log({key: self._wandb.Video(path)}, step=step)

    def close(self) -> None:
        self.run.finish()
