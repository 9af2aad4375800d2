"""The IMPALA and PopArt-IMPALA losses, built from the same three pieces: V-trace targets, the policy
gradient (plain or PPO's clipped surrogate, as APPO) and the baseline regression.

References: Espeholt et al. 2018, "IMPALA" (arXiv:1802.01561): the unnormalized loss; Hessel et al.
2018, "Multi-task deep RL with PopArt" (arXiv:1809.04474): the normalized V-trace losses.

**Loss reduction is explicit** (``reduction="sum"`` or ``"mean"`` over T*B and any
trailing dims). The IMPALA paper and TorchBeast *sum* over T*B, and their published
learning rate, RMSProp epsilon and gradient-norm clip (6e-4, 0.01, 40) are numbers in
those units: RMSProp adds epsilon to ``sqrt(v)``, and ``v`` grows with the square of
the loss scale, so the same epsilon on a mean-reduced loss (T*B = 2560 times smaller
gradients) shrinks every step to about 1% of the learning rate. A2C/PPO recipes
(baselines, SB3, cleanrl) publish their numbers for *mean* losses. Each recipe must be
run in the units its numbers were published in; :mod:`impala.run.config` says which.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F

from impala.algos import vtrace
from impala.algos.popart import Allreduce, PopArtState, normalize, task_stat

__all__ = [
    "ImpalaLoss",
    "policy_gradient_loss",
    "baseline_loss",
    "entropy",
    "entropy_per_step",
    "REDUCTIONS",
    "clipped_surrogate_loss",
    "normalized",
    "impala_loss",
    "BatchTargets",
    "vtrace_targets",
]


class ImpalaLoss(NamedTuple):
    """Scalar losses and the V-trace quantities behind them.

    total: ``pg_loss + baseline_cost * baseline_loss - entropy_cost * entropy``.
    pg_loss: ``-reduce(log pi(a|x) * advantage)``.
    baseline_loss: ``0.5 * reduce((target - value)^2)`` (normalized units under PopArt).
    entropy: reduced policy entropy (the bonus; enters ``total`` with a minus sign).
    mean_entropy: the policy's entropy per step, whatever the reduction (for display).
    vtrace: the :class:`~impala.algos.vtrace.VTraceFromLogitsReturns`; ``vtrace.vs`` are the
      unnormalized targets to feed :meth:`PopArtValueHead.update`.
    pg_advantages: the advantages used in ``pg_loss`` (normalized under PopArt), [T, B, ...].
    value_targets: the regression targets of ``baseline_loss``, [T, B, ...].
    """

    total: torch.Tensor
    pg_loss: torch.Tensor
    baseline_loss: torch.Tensor
    entropy: torch.Tensor
    mean_entropy: torch.Tensor
    vtrace: vtrace.VTraceFromLogitsReturns
    pg_advantages: torch.Tensor
    value_targets: torch.Tensor


class BatchTargets(NamedTuple):
    """V-trace's value targets and the policy term's advantages for a batch, in return units, computed
    once (PPO computes its advantages and returns once per rollout, before the first epoch) and then
    held fixed over every pass and minibatch. Shapes [T, B, ...]; no gradient."""

    vs: torch.Tensor
    pg_advantages: torch.Tensor


REDUCTIONS = ("sum", "mean")


def _reduce(x: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return x.sum()
    if reduction == "mean":
        return x.mean()
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def policy_gradient_loss(
    action_log_probs: torch.Tensor, advantages: torch.Tensor, *, reduction: str
) -> torch.Tensor:
    """``-reduce(log pi(a_t|x_t) * A_t)``; advantages are constants (detached).

    Args:
      action_log_probs: shape [T, B, ...], differentiable.
      advantages: shape [T, B, ...].
      reduction: "sum" or "mean" over all elements.
    """
    return -_reduce(action_log_probs * advantages.detach(), reduction)


def baseline_loss(targets: torch.Tensor, values: torch.Tensor, *, reduction: str) -> torch.Tensor:
    """``0.5 * reduce((targets - values)^2)``; targets are constants (detached).

    Args:
      targets: shape [T, B, ...].
      values: shape [T, B, ...], differentiable.
      reduction: "sum" or "mean" over all elements.
    """
    return 0.5 * _reduce((targets.detach() - values).pow(2), reduction)


def entropy_per_step(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` at each step: logits [..., A] -> [...]."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()  # p log p underflows in reduced precision
    log_p = F.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def entropy(logits: torch.Tensor, *, reduction: str) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` reduced over all leading dims; logits shape [..., A]."""
    return _reduce(entropy_per_step(logits), reduction)


def _td_advantages(
    vs: torch.Tensor,
    rewards: torch.Tensor,
    discounts: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    lambda_: float = 1.0,
) -> torch.Tensor:
    """``r_s + gamma_s (lambda v_{s+1} + (1 - lambda) V(x_{s+1})) - V(x_s)``: V-trace's policy-gradient
    advantage without its rho factor (the clipped surrogate applies the ratio itself)."""
    values = values.detach()
    boot = bootstrap_value.detach().unsqueeze(0)
    vs_tp1 = torch.cat([vs[1:], boot], dim=0)
    if lambda_ != 1.0:
        vs_tp1 = lambda_ * vs_tp1 + (1.0 - lambda_) * torch.cat([values[1:], boot], dim=0)
    return (rewards + discounts * vs_tp1 - values).detach()


def clipped_surrogate_loss(
    action_log_probs: torch.Tensor,
    behaviour_action_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip: float,
    reduction: str,
) -> torch.Tensor:
    """PPO's clipped surrogate against the behaviour policy (APPO: RLlib, Sample Factory).

    ``-reduce(min(rho A, clip(rho, 1 - clip, 1 + clip) A))`` with ``rho = pi(a|x) / mu(a|x)``.
    Its gradient is ``rho A grad log pi`` (IMPALA's term with an unclipped rho) until the
    ratio leaves ``[1 - clip, 1 + clip]`` in the direction ``A`` favours, then zero: that is
    what makes several passes over one batch safe.
    """
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    ratio = torch.exp(action_log_probs - behaviour_action_log_probs.detach())
    adv = advantages.detach()
    return -_reduce(torch.min(ratio * adv, ratio.clamp(1.0 - clip, 1.0 + clip) * adv), reduction)


def normalized(advantages: torch.Tensor, allreduce: Allreduce | None = None) -> torch.Tensor:
    """``(A - mean(A)) / (std(A) + 1e-8)`` over the whole batch (as PPO normalizes a minibatch).

    With ``allreduce`` the batch is split over a learner group: mean and (unbiased) std are the
    whole batch's, from the ranks' summed count, sum and sum of squares."""
    if allreduce is None:
        if advantages.numel() < 2:
            return advantages - advantages.mean()
        return (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    x = advantages.double()
    n, s, sq = allreduce(
        torch.stack([torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device), x.sum(), (x * x).sum()])
    )
    mean = s / n
    if n < 2:
        return (x - mean).to(advantages.dtype)
    std = ((sq - n * mean * mean).clamp(min=0) / (n - 1)).sqrt()
    return ((x - mean) / (std + 1e-8)).to(advantages.dtype)


def vtrace_targets(
    behaviour_policy_logits: torch.Tensor,
    target_policy_logits: torch.Tensor,
    actions: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    *,
    clip_rho_threshold: float | None,
    clip_pg_rho_threshold: float | None,
    pg_clip: float | None,
    lambda_: float,
) -> BatchTargets:
    """V-trace's value targets ``vs`` and the policy term's advantages, in return units, from values in
    return units (under PopArt, ``unnormalize`` the critic's output first): V-trace's own
    ``pg_advantages`` (IMPALA's term), or with ``pg_clip`` the advantages without the rho factor that the
    clipped surrogate takes. The caller decides when: before every step (IMPALA) or once per batch and
    held fixed over its passes and minibatches (PPO's rule). No gradient flows through them."""
    with torch.no_grad():
        v = vtrace.from_logits(
            behaviour_policy_logits,
            target_policy_logits,
            actions,
            discounts,
            rewards,
            values,
            bootstrap_value,
            clip_rho_threshold,
            clip_pg_rho_threshold,
            lambda_,
        )
        adv = (
            _td_advantages(v.vs, rewards, discounts, values, bootstrap_value, lambda_)
            if pg_clip
            else v.pg_advantages
        )
    return BatchTargets(v.vs, adv)


def impala_loss(
    behaviour_policy_logits: torch.Tensor,
    target_policy_logits: torch.Tensor,
    actions: torch.Tensor,
    normalized_values: torch.Tensor,
    targets: BatchTargets,
    popart: PopArtState,
    task_ids: int | torch.Tensor,
    *,
    baseline_cost: float,
    entropy_cost: float,
    reduction: str,
    pg_clip: float | None,
    standardize: Callable[[torch.Tensor], torch.Tensor] | None,
) -> ImpalaLoss:
    """The IMPALA loss (Espeholt et al. 2018) in PopArt's normalized form (Hessel et al. 2018, Sec. 3),
    reduced over T*B by ``reduction``; at identity statistics (mu 0, sigma 1: a run without PopArt) it is
    IMPALA's loss, bit for bit.

      value loss: ``0.5 * reduce(((vs - mu) / sigma - n(x_s))^2)``;
      advantage: ``rho^pg_s * ((r_s + gamma_s v_{s+1} - mu) / sigma - n(x_s))``, which equals V-trace's
      ``pg_advantages / sigma`` (since ``V = sigma n + mu``), so it is computed that way.

    Args:
      behaviour_policy_logits: actor logits, shape [T, B, A].
      target_policy_logits: learner logits, shape [T, B, A], differentiable.
      actions: int64, shape [T, B].
      normalized_values: the critic's ``n(x_t)`` for each step's task, shape [T, B], differentiable.
      targets: :func:`vtrace_targets`, in return units.
      popart: the statistics ``normalized_values`` were produced with (before this update's ART).
      task_ids: an int for all steps, or an integer tensor of shape [T, B].
      baseline_cost, entropy_cost: coefficients of the value loss and entropy bonus.
      reduction: "sum" (the paper's and TorchBeast's units) or "mean" over T*B.
      pg_clip: the clipped surrogate (APPO) with this clip on advantages without the rho factor
        (``targets`` made with the same ``pg_clip``); None or 0: IMPALA's ``-rho_bar A grad log pi``.
      standardize: applied to the advantages the policy term uses (:func:`normalized`, over a learner
        group's whole batch where the caller has one); None: used as they are.

    Returns:
      :class:`ImpalaLoss`; ``vtrace.vs`` are the unnormalized targets for the ART update.
    """
    actions = actions.long()
    # In float32 under autocast, as V-trace takes them: the ratio divides small probabilities.
    target_lp = vtrace.action_log_probs(target_policy_logits.float(), actions)
    behaviour_lp = vtrace.action_log_probs(behaviour_policy_logits.float(), actions)
    v = vtrace.VTraceFromLogitsReturns(
        targets.vs.detach(), targets.pg_advantages.detach(), target_lp - behaviour_lp, behaviour_lp, target_lp
    )
    pg_advantages = v.pg_advantages / task_stat(popart.sigma, task_ids, v.pg_advantages)
    value_targets = normalize(popart, v.vs, task_ids).detach()
    adv = standardize(pg_advantages.detach()) if standardize is not None else pg_advantages
    if pg_clip:
        pg = clipped_surrogate_loss(target_lp, behaviour_lp, adv, clip=pg_clip, reduction=reduction)
    else:
        pg = policy_gradient_loss(target_lp, adv, reduction=reduction)
    bl = baseline_loss(value_targets, normalized_values, reduction=reduction)
    per_step = entropy_per_step(target_policy_logits)
    ent = _reduce(per_step, reduction)
    total = pg + baseline_cost * bl - entropy_cost * ent
    return ImpalaLoss(total, pg, bl, ent, per_step.mean().detach(), v, adv.detach(), value_targets)
