"""The per-step (Py)Art-IMPALA loss composed from raw inputs as the learner composes it: values into return
units with the PopArt statistics, V-trace's targets from them, then the one loss. The tests of the loss's
formulas call this, so they check the same pieces the learner runs."""

from __future__ import annotations

import torch

from impala.algos import impala_losses, popart


def step_loss(
    behaviour: torch.Tensor,
    target: torch.Tensor,
    actions: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    normalized_values: torch.Tensor,
    normalized_bootstrap: torch.Tensor,
    state: popart.PopArtState | None = None,
    tasks: int | torch.Tensor = 0,
    *,
    baseline_cost: float = 0.5,
    entropy_cost: float = 0.01,
    reduction: str = "mean",
    pg_clip: float | None = None,
    normalize_advantages: bool = False,
) -> impala_losses.ImpalaLoss:
    """``state`` None: identity statistics (a run without PopArt)."""
    if state is None:
        state = popart.init_state(1)
    boot_task = tasks[-1] if isinstance(tasks, torch.Tensor) else tasks
    targets = impala_losses.vtrace_targets(
        behaviour,
        target,
        actions,
        discounts,
        rewards,
        popart.unnormalize(state, normalized_values.detach(), tasks),
        popart.unnormalize(state, normalized_bootstrap.detach(), boot_task),
        clip_rho_threshold=1.0,
        clip_pg_rho_threshold=1.0,
        pg_clip=pg_clip,
        lambda_=1.0,
    )
    return impala_losses.impala_loss(
        behaviour,
        target,
        actions,
        normalized_values,
        targets,
        state,
        tasks,
        baseline_cost=baseline_cost,
        entropy_cost=entropy_cost,
        reduction=reduction,
        pg_clip=pg_clip,
        standardize=impala_losses.normalized if normalize_advantages else None,
    )
