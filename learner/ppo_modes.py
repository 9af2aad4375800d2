"""What ``launch_ppo`` adds to the PPO trainer for ML-Agents' run settings: the extrinsic reward's
``strength``, ``--inference`` (the policy acts, nothing trains) and ``--initialize-from`` (another run's
weights, not its counters).

A subclass of :class:`learner.ppo_learner.PPOTrainer` that changes only what reaches it: the rewards it
ingests are scaled (ML-Agents' ``ExtrinsicRewardProvider`` returns ``strength * reward``; the episode
returns the actors report stay the env's own), and in inference it ingests nothing and is never ready,
so the runtime never updates and the actors never wait for new weights.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from impala.nets.onnx_export import onnx_file_name
from impala.run.checkpoint import CheckpointError, load_checkpoint
from impala.transport import wire
from learner.ppo_learner import PPOTrainer


class MLAgentsPPOTrainer(PPOTrainer):
    """:class:`PPOTrainer` with ``strength`` on the rewards, and an ``inference`` mode that never trains."""

    def __init__(self, *args: Any, strength: float = 1.0, inference: bool = False, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.strength, self.inference = strength, inference
        if inference:  # no update will come: actors must not pause for one
            self.agent = dataclasses.replace(self.agent, unrolls_per_update=0)

    def ingest(self, msg: wire.Message, version: int) -> bool:
        if self.inference:
            return True
        if self.strength != 1.0:
            msg = dataclasses.replace(
                msg, arrays={**msg.arrays, "rewards": msg.arrays["rewards"] * self.strength}
            )
        return super().ingest(msg, version)

    def ready(self) -> bool:
        return not self.inference and super().ready()

    def onnx_name(self) -> str:
        """The behaviour's name, as the ONNX file is named: numbered checkpoints are ``<name>-<steps>.pt``."""
        return os.path.splitext(onnx_file_name(self.env_spec))[0]

    def initialize_from(self, path: str) -> None:
        """Start from the weights (and optimizer moments and normalizers, as ML-Agents' ``initialize_from``
        loads its policy and optimizer) of the checkpoint at ``path``, with this run's counters: step 0, no
        updates, so the schedules start over."""
        state = load_checkpoint(path, keys=("trainer",))
        mine = self.state_dict()
        saved = dict(state["trainer"])
        for key in ("total_steps", "update_count", "rejected_batches", "rng"):
            if key in mine:
                saved[key] = mine[key]
        try:
            self.load_state_dict(saved)
        except CheckpointError as e:
            raise CheckpointError(f"--initialize-from {path}: {e}") from None
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            first = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            raise CheckpointError(
                f"--initialize-from {path}: its network does not fit this run ({first})"
            ) from None
