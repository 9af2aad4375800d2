"""PopArt value normalization and the (PopArt-)IMPALA losses.

References:
  van Hasselt et al. 2016, "Learning values across many orders of magnitude"
  (arXiv:1602.07714): "ART" adaptively rescales targets, "POP" preserves the
  outputs of the last linear layer while doing so.
  Hessel et al. 2018, "Multi-task deep RL with PopArt" (arXiv:1809.04474):
  PopArt-IMPALA, one normalization per task and the normalized V-trace losses.
  Espeholt et al. 2018, "IMPALA" (arXiv:1802.01561): the unnormalized loss.

The statistics live in an immutable :class:`PopArtState` (``mu`` first moment,
``nu`` second moment, ``sigma`` scale, each shape [num_tasks]), and the math is split
into pure functions as in rlax: :func:`normalize`, :func:`unnormalize`,
:func:`update_stats` (art) and :func:`rescale_linear` (pop).

**One EMA step per update, on the batch mean.** For every task present in a batch,
``mu <- (1 - beta) mu + beta * mean(targets of that task)`` and likewise ``nu`` with
the mean of the squared targets; tasks absent from the batch keep their statistics.
This is what rlax's ``art`` and the PopArt-IMPALA paper do (beta = 3e-4 per learner
update). Counting each target as its own step (a sum) would make the effective step
size grow with T*B and with how many unrolls of a task landed in the batch, so the
same beta would mean different time scales for different batch sizes and tasks.
With the mean, ``1/beta`` is the memory in learner updates whatever the batch. Using
the mean of squares (not the square of the mean) keeps the within-batch variance in
``nu``, so ``sigma`` converges to the stream's standard deviation.

``sigma = sqrt(clip(nu - mu^2, sigma_min^2, sigma_max^2))``: the lower bound stops a
constant-return task from blowing up normalized values, the upper bound guards
against divergence.

**Loss reduction is explicit** (``reduction="sum"`` or ``"mean"`` over T*B and any
trailing dims). The IMPALA paper and TorchBeast *sum* over T*B, and their published
learning rate, RMSProp epsilon and gradient-norm clip (6e-4, 0.01, 40) are numbers in
those units: RMSProp adds epsilon to ``sqrt(v)``, and ``v`` grows with the square of
the loss scale, so the same epsilon on a mean-reduced loss (T*B = 2560 times smaller
gradients) shrinks every step to about 1% of the learning rate. A2C/PPO recipes
(baselines, SB3, cleanrl) publish their numbers for *mean* losses. Each recipe must be
run in the units its numbers were published in; :mod:`impala.config` says which.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from impala import vtrace

__all__ = [
    "PopArtState",
    "PopArtValueHead",
    "ImpalaLoss",
    "init_state",
    "normalize",
    "unnormalize",
    "update_stats",
    "rescale_linear",
    "policy_gradient_loss",
    "baseline_loss",
    "entropy",
    "entropy_per_step",
    "REDUCTIONS",
    "clipped_surrogate_loss",
    "normalized",
    "impala_loss",
    "popart_impala_loss",
]

# Sums a tensor over a learner group's ranks (torch.distributed.all_reduce); None: one learner.
Allreduce = Callable[[torch.Tensor], torch.Tensor]

DEFAULT_BETA = 3e-4
DEFAULT_SIGMA_MIN = 1e-4
DEFAULT_SIGMA_MAX = 1e6


class PopArtState(NamedTuple):
    """PopArt statistics, one entry per task.

    mu: EMA of the targets (first moment), shape [num_tasks].
    nu: EMA of the squared targets (second moment), shape [num_tasks].
    sigma: ``sqrt(clip(nu - mu^2, sigma_min^2, sigma_max^2))``, shape [num_tasks].
    """

    mu: torch.Tensor
    nu: torch.Tensor
    sigma: torch.Tensor


def init_state(num_tasks: int = 1, *, dtype: torch.dtype = torch.float64, device=None) -> PopArtState:
    """Identity statistics (mu = 0, nu = sigma = 1), shape [num_tasks] each.

    float64 by default: ``nu - mu^2`` cancels catastrophically in float32 once the
    returns' mean dwarfs their spread, and the state is only num_tasks numbers.
    """
    if num_tasks < 1:
        raise ValueError(f"num_tasks must be >= 1, got {num_tasks}")
    zeros = torch.zeros(num_tasks, dtype=dtype, device=device)
    return PopArtState(mu=zeros, nu=torch.ones_like(zeros), sigma=torch.ones_like(zeros))


def _select(stat: torch.Tensor, task: int | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``stat[task]`` in ``like``'s dtype; an int task applies to all of ``like``."""
    if isinstance(task, torch.Tensor):
        if task.shape != like.shape:
            raise ValueError(f"task has shape {tuple(task.shape)} but x has shape {tuple(like.shape)}")
        return stat.to(like.dtype)[task.long()]
    return stat[task].to(like.dtype)


def normalize(state: PopArtState, x: torch.Tensor, task: int | torch.Tensor = 0) -> torch.Tensor:
    """``(x - mu[task]) / sigma[task]``.

    Args:
      state: the statistics.
      x: unnormalized values or targets, any shape.
      task: one task index for all of ``x``, or an integer tensor of ``x``'s shape.

    Returns:
      Normalized ``x``, same shape and dtype.
    """
    return (x - _select(state.mu, task, x)) / _select(state.sigma, task, x)


def unnormalize(state: PopArtState, x: torch.Tensor, task: int | torch.Tensor = 0) -> torch.Tensor:
    """``sigma[task] * x + mu[task]``, the inverse of :func:`normalize` (same args)."""
    return x * _select(state.sigma, task, x) + _select(state.mu, task, x)


def _check_hparams(beta: float, sigma_min: float, sigma_max: float) -> None:
    if not 0.0 < beta <= 1.0:
        raise ValueError(f"beta must be in (0, 1], got {beta}")
    if not 0.0 < sigma_min <= sigma_max:
        raise ValueError(f"need 0 < sigma_min <= sigma_max, got sigma_min={sigma_min}, sigma_max={sigma_max}")


@torch.no_grad()
def update_stats(
    state: PopArtState,
    targets: torch.Tensor,
    task_ids: int | torch.Tensor = 0,
    *,
    beta: float = DEFAULT_BETA,
    sigma_min: float = DEFAULT_SIGMA_MIN,
    sigma_max: float = DEFAULT_SIGMA_MAX,
    allreduce: Allreduce | None = None,
) -> PopArtState:
    """ART: one EMA step per task present in the batch, on the batch's mean (module doc).

    Args:
      state: current statistics.
      targets: unnormalized targets (e.g. V-trace ``vs``), any shape.
      task_ids: task of each target: an int for all, or an integer tensor of
        ``targets``' shape.
      beta: EMA step size in (0, 1].
      sigma_min, sigma_max: bounds on sigma.
      allreduce: sums a tensor over a learner group (data-parallel ranks that each hold part
        of the batch), so that every rank steps its statistics on the whole batch's moments.

    Returns:
      A new :class:`PopArtState`; ``state`` is not modified.
    """
    _check_hparams(beta, sigma_min, sigma_max)
    num_tasks = state.mu.shape[0]
    x = targets.detach().reshape(-1).to(state.mu.dtype)
    if isinstance(task_ids, torch.Tensor):
        if task_ids.shape != targets.shape:
            raise ValueError(
                f"task_ids has shape {tuple(task_ids.shape)} but targets has shape {tuple(targets.shape)}"
            )
        ids = task_ids.reshape(-1).long()
    else:
        if not 0 <= task_ids < num_tasks:
            raise ValueError(f"task_ids={task_ids} out of range for {num_tasks} task(s)")
        ids = torch.full_like(x, task_ids, dtype=torch.long)
    counts = torch.zeros_like(state.mu).index_add_(0, ids, torch.ones_like(x))
    sums = torch.zeros_like(state.mu).index_add_(0, ids, x)
    sq_sums = torch.zeros_like(state.mu).index_add_(0, ids, x * x)
    if allreduce is not None:
        counts, sums, sq_sums = allreduce(torch.stack([counts, sums, sq_sums]))
    present = counts > 0
    n = counts.clamp(min=1)
    mu = torch.where(present, (1 - beta) * state.mu + beta * (sums / n), state.mu)
    nu = torch.where(present, (1 - beta) * state.nu + beta * (sq_sums / n), state.nu)
    return PopArtState(mu=mu, nu=nu, sigma=_sigma(mu, nu, sigma_min, sigma_max))


def _sigma(mu: torch.Tensor, nu: torch.Tensor, sigma_min: float, sigma_max: float) -> torch.Tensor:
    return (nu - mu * mu).clamp(min=sigma_min**2, max=sigma_max**2).sqrt()


@torch.no_grad()
def rescale_linear(
    weight: torch.Tensor, bias: torch.Tensor, old_state: PopArtState, new_state: PopArtState
) -> tuple[torch.Tensor, torch.Tensor]:
    """POP: new last-layer parameters whose unnormalized outputs equal the old ones.

    ``W' = W * sigma / sigma'`` (row-wise), ``b' = (sigma * b + mu - mu') / sigma'``, so
    that ``sigma' (W' h + b') + mu' == sigma (W h + b) + mu`` for every ``h``.

    Args:
      weight: shape [num_tasks, in_features].
      bias: shape [num_tasks].
      old_state, new_state: statistics before and after :func:`update_stats`.

    Returns:
      ``(new_weight, new_bias)`` in the input dtypes.
    """
    if weight.dim() != 2 or weight.shape[0] != old_state.mu.shape[0]:
        raise ValueError(
            f"weight has shape {tuple(weight.shape)} but must be [num_tasks={old_state.mu.shape[0]}, in_features]"
        )
    if bias.shape != old_state.mu.shape:
        raise ValueError(f"bias has shape {tuple(bias.shape)} but must be [num_tasks={old_state.mu.shape[0]}]")
    dt = old_state.mu.dtype  # computed in the (float64) state dtype, then cast back
    ratio = old_state.sigma / new_state.sigma
    new_weight = weight.to(dt) * ratio.unsqueeze(-1)
    new_bias = (old_state.sigma * bias.to(dt) + old_state.mu - new_state.mu) / new_state.sigma
    return new_weight.to(weight.dtype), new_bias.to(bias.dtype)


class PopArtValueHead(nn.Module):
    """Linear value head with PopArt statistics (``in_features -> num_tasks``).

    ``forward`` returns *normalized* values; :meth:`unnormalized` returns values in
    return units; :meth:`update` applies ART then POP in place. The statistics are
    float64 buffers, so they follow ``.to(device)`` and live in ``state_dict``.
    The layer runs in its own dtype (float32), even under autocast: normalized values are
    mapped back through ``sigma`` (up to 1e6), which would magnify bf16 rounding.

    Notes: optimizer moments of ``weight``/``bias`` are not rescaled by POP (neither
    are they in the reference implementations). ``module.to(torch.float32)`` or
    ``.float()`` also casts these buffers down to float32; move devices with
    ``.to(device)`` only.
    """

    def __init__(
        self,
        in_features: int,
        num_tasks: int = 1,
        *,
        beta: float = DEFAULT_BETA,
        sigma_min: float = DEFAULT_SIGMA_MIN,
        sigma_max: float = DEFAULT_SIGMA_MAX,
    ) -> None:
        super().__init__()
        _check_hparams(beta, sigma_min, sigma_max)
        self.beta = beta
        self.sigma_min = sigma_min
        self.sigma_max = sigma_max
        self.linear = nn.Linear(in_features, num_tasks)
        state = init_state(num_tasks)
        self.register_buffer("mu", state.mu)
        self.register_buffer("nu", state.nu)
        self.register_buffer("sigma", state.sigma)

    @property
    def num_tasks(self) -> int:
        return self.linear.out_features

    @property
    def state(self) -> PopArtState:
        """The current statistics as an immutable tuple (shares storage with the buffers)."""
        return PopArtState(mu=self.mu, nu=self.nu, sigma=self.sigma)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized values ``n(x)``: shape [..., in_features] -> [..., num_tasks], in the
        layer's dtype (float32 unless the module was converted)."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            return self.linear(x.to(self.linear.weight.dtype))

    def unnormalized(self, x: torch.Tensor) -> torch.Tensor:
        """Values in return units, ``sigma * n(x) + mu``, shape [..., num_tasks]."""
        n = self(x)
        return n * self.sigma.to(n.dtype) + self.mu.to(n.dtype)

    @torch.no_grad()
    def update(self, targets: torch.Tensor, task_ids: int | torch.Tensor = 0, allreduce: Allreduce | None = None) -> PopArtState:
        """ART + POP in place: update the statistics from unnormalized ``targets``, then
        rescale the layer so that :meth:`unnormalized` outputs are unchanged.

        Args:
          targets: unnormalized targets (e.g. V-trace ``vs``), any shape.
          task_ids: an int, or an integer tensor of ``targets``' shape.
          allreduce: see :func:`update_stats` (a learner group's ranks stay identical).

        Returns:
          The new statistics.
        """
        old = PopArtState(self.mu.clone(), self.nu.clone(), self.sigma.clone())
        new = update_stats(
            old, targets, task_ids, beta=self.beta, sigma_min=self.sigma_min, sigma_max=self.sigma_max, allreduce=allreduce
        )
        w, b = rescale_linear(self.linear.weight, self.linear.bias, old, new)
        self.linear.weight.copy_(w)
        self.linear.bias.copy_(b)
        self.mu.copy_(new.mu)
        self.nu.copy_(new.nu)
        self.sigma.copy_(new.sigma)
        return self.state

    def extra_repr(self) -> str:
        return f"beta={self.beta}, sigma_min={self.sigma_min}, sigma_max={self.sigma_max}"


# ---------------------------------------------------------------------------------
# Losses. Both front ends (plain and PopArt) are built from the same three pieces.
# ---------------------------------------------------------------------------------


class ImpalaLoss(NamedTuple):
    """Scalar losses and the V-trace quantities behind them.

    total: ``pg_loss + baseline_cost * baseline_loss - entropy_cost * entropy``.
    pg_loss: ``-reduce(log pi(a|x) * advantage)``.
    baseline_loss: ``0.5 * reduce((target - value)^2)`` (normalized units under PopArt).
    entropy: reduced policy entropy (the bonus; enters ``total`` with a minus sign).
    mean_entropy: the policy's entropy per step, whatever the reduction (for display).
    vtrace: the :class:`~impala.vtrace.VTraceFromLogitsReturns`; ``vtrace.vs`` are the
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


REDUCTIONS = ("sum", "mean")


def _reduce(x: torch.Tensor, reduction: str) -> torch.Tensor:
    if reduction == "sum":
        return x.sum()
    if reduction == "mean":
        return x.mean()
    raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def policy_gradient_loss(action_log_probs: torch.Tensor, advantages: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """``-reduce(log pi(a_t|x_t) * A_t)``; advantages are constants (detached).

    Args:
      action_log_probs: shape [T, B, ...], differentiable.
      advantages: shape [T, B, ...].
      reduction: "sum" or "mean" over all elements.
    """
    return -_reduce(action_log_probs * advantages.detach(), reduction)


def baseline_loss(targets: torch.Tensor, values: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
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


def entropy(logits: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Entropy of ``softmax(logits)`` reduced over all leading dims; logits shape [..., A]."""
    return _reduce(entropy_per_step(logits), reduction)


def _td_advantages(
    vs: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor, values: torch.Tensor, bootstrap_value: torch.Tensor,
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
    clip: float,
    reduction: str = "mean",
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
    n, s, sq = allreduce(torch.stack([torch.tensor(float(x.numel()), dtype=x.dtype, device=x.device), x.sum(), (x * x).sum()]))
    mean = s / n
    if n < 2:
        return (x - mean).to(advantages.dtype)
    std = ((sq - n * mean * mean).clamp(min=0) / (n - 1)).sqrt()
    return ((x - mean) / (std + 1e-8)).to(advantages.dtype)


def _assemble(
    v: vtrace.VTraceFromLogitsReturns,
    target_policy_logits: torch.Tensor,
    pg_advantages: torch.Tensor,
    value_targets: torch.Tensor,
    values: torch.Tensor,
    baseline_cost: float,
    entropy_cost: float,
    reduction: str,
    pg_clip: float | None = None,
    normalize_advantages: bool = False,
    allreduce: Allreduce | None = None,
) -> ImpalaLoss:
    """The policy term is IMPALA's ``-rho_bar A grad log pi`` by default; with ``pg_clip`` it is
    the clipped surrogate on advantages without the rho factor; ``normalize_advantages``
    standardizes whichever advantages the term uses over the batch (over a learner group's whole
    batch with ``allreduce``)."""
    adv = normalized(pg_advantages.detach(), allreduce) if normalize_advantages else pg_advantages
    if pg_clip:
        pg = clipped_surrogate_loss(v.target_action_log_probs, v.behaviour_action_log_probs, adv, pg_clip, reduction)
    else:
        pg = policy_gradient_loss(v.target_action_log_probs, adv, reduction)
    bl = baseline_loss(value_targets, values, reduction)
    per_step = entropy_per_step(target_policy_logits)
    ent = _reduce(per_step, reduction)
    total = pg + baseline_cost * bl - entropy_cost * ent
    return ImpalaLoss(total, pg, bl, ent, per_step.mean().detach(), v, adv.detach(), value_targets.detach())


def impala_loss(
    behaviour_policy_logits: torch.Tensor,
    target_policy_logits: torch.Tensor,
    actions: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    *,
    baseline_cost: float = 0.5,
    entropy_cost: float = 0.01,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    reduction: str = "mean",
    pg_clip: float | None = None,
    normalize_advantages: bool = False,
    lambda_: float = 1.0,
    allreduce: Allreduce | None = None,
) -> ImpalaLoss:
    """IMPALA loss (Espeholt et al. 2018), reduced over T*B by ``reduction``.

    Args:
      behaviour_policy_logits: actor logits, shape [T, B, A].
      target_policy_logits: learner logits, shape [T, B, A], differentiable.
      actions: int64, shape [T, B].
      discounts: ``gamma * (1 - done)``, shape [T, B].
      rewards: shape [T, B] (already clipped/scaled as the learner wants).
      values: ``V(x_t)``, shape [T, B], differentiable.
      bootstrap_value: ``V(x_T)``, shape [B].
      baseline_cost, entropy_cost: coefficients of the value loss and entropy bonus.
      clip_rho_threshold, clip_pg_rho_threshold: V-trace clips (``None`` = no clip).
      reduction: "sum" (the paper's and TorchBeast's units) or "mean" over T*B.
      pg_clip, normalize_advantages: the APPO variant of the policy term, see :func:`_assemble`.
      lambda_: V-trace's trace decay (:func:`impala.vtrace.from_importance_weights`).
      allreduce: sums a tensor over a learner group (advantage normalization over the whole batch).

    Returns:
      :class:`ImpalaLoss`.
    """
    v = vtrace.from_logits(
        behaviour_policy_logits, target_policy_logits, actions, discounts, rewards,
        values, bootstrap_value, clip_rho_threshold, clip_pg_rho_threshold, lambda_,
    )
    pg_advantages = _td_advantages(v.vs, rewards, discounts, values, bootstrap_value, lambda_) if pg_clip else v.pg_advantages
    return _assemble(
        v, target_policy_logits, pg_advantages, v.vs, values, baseline_cost, entropy_cost, reduction,
        pg_clip, normalize_advantages, allreduce,
    )


def popart_impala_loss(
    behaviour_policy_logits: torch.Tensor,
    target_policy_logits: torch.Tensor,
    actions: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    normalized_values: torch.Tensor,
    normalized_bootstrap_value: torch.Tensor,
    state: PopArtState,
    task_ids: int | torch.Tensor = 0,
    *,
    baseline_cost: float = 0.5,
    entropy_cost: float = 0.01,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    reduction: str = "mean",
    pg_clip: float | None = None,
    normalize_advantages: bool = False,
    lambda_: float = 1.0,
    allreduce: Allreduce | None = None,
) -> ImpalaLoss:
    """PopArt-IMPALA loss (Hessel et al. 2018, Sec. 3), reduced over T*B by ``reduction``.

    V-trace runs in return units on ``V = sigma * n + mu``. Then:
      value loss: ``0.5 * mean(((vs - mu) / sigma - n(x_s))^2)``;
      advantage: ``rho^pg_s * ((r_s + gamma_s v_{s+1} - mu) / sigma - n(x_s))``, which
      equals V-trace's ``pg_advantages / sigma`` (since ``V = sigma n + mu``), so it
      is computed that way.

    Args:
      behaviour_policy_logits: actor logits, shape [T, B, A].
      target_policy_logits: learner logits, shape [T, B, A], differentiable.
      actions: int64, shape [T, B].
      discounts: ``gamma * (1 - done)``, shape [T, B].
      rewards: shape [T, B], unnormalized.
      normalized_values: ``n(x_t)`` for each step's task, shape [T, B], differentiable.
      normalized_bootstrap_value: ``n(x_T)``, shape [B].
      state: PopArt statistics used to produce the values (before this update's ART).
      task_ids: an int for all steps, or an integer tensor of shape [T, B].
      baseline_cost, entropy_cost: coefficients of the value loss and entropy bonus.
      clip_rho_threshold, clip_pg_rho_threshold: V-trace clips (``None`` = no clip).
      reduction: "sum" (the paper's and TorchBeast's units) or "mean" over T*B.
      pg_clip, normalize_advantages: the APPO variant of the policy term, see :func:`_assemble`.
      lambda_: V-trace's trace decay (:func:`impala.vtrace.from_importance_weights`).

    Returns:
      :class:`ImpalaLoss`; ``vtrace.vs`` are unnormalized targets for the ART update.
    """
    if isinstance(task_ids, torch.Tensor):
        boot_task = task_ids[-1]
    else:
        boot_task = task_ids
    # The critic's output is detached inside V-trace; only the regression sees n(x_s).
    values = unnormalize(state, normalized_values.detach(), task_ids)
    bootstrap_value = unnormalize(state, normalized_bootstrap_value.detach(), boot_task)
    v = vtrace.from_logits(
        behaviour_policy_logits, target_policy_logits, actions, discounts, rewards,
        values, bootstrap_value, clip_rho_threshold, clip_pg_rho_threshold, lambda_,
    )
    raw = _td_advantages(v.vs, rewards, discounts, values, bootstrap_value, lambda_) if pg_clip else v.pg_advantages
    pg_advantages = raw / _select(state.sigma, task_ids, raw)
    value_targets = normalize(state, v.vs, task_ids)
    return _assemble(
        v, target_policy_logits, pg_advantages, value_targets, normalized_values, baseline_cost, entropy_cost, reduction,
        pg_clip, normalize_advantages, allreduce,
    )
