"""PopArt value normalization (the statistics, ART and POP, and the value head).

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

The losses that use these statistics are in :mod:`impala.algos.impala_losses`.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

__all__ = [
    "PopArtState",
    "PopArtValueHead",
    "init_state",
    "normalize",
    "unnormalize",
    "update_stats",
    "rescale_linear",
]

# Sums a tensor over a learner group's ranks (torch.distributed.all_reduce); None: one learner.
Allreduce = Callable[[torch.Tensor], torch.Tensor]

# sigma's bounds (not options): below, a constant-return task would blow up normalized values; above, a
# diverging one would run away
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


def task_stat(stat: torch.Tensor, task: int | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
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
    return (x - task_stat(state.mu, task, x)) / task_stat(state.sigma, task, x)


def unnormalize(state: PopArtState, x: torch.Tensor, task: int | torch.Tensor = 0) -> torch.Tensor:
    """``sigma[task] * x + mu[task]``, the inverse of :func:`normalize` (same args)."""
    return x * task_stat(state.sigma, task, x) + task_stat(state.mu, task, x)


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
    beta: float,
    sigma_min: float,
    sigma_max: float,
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
            f"weight has shape {tuple(weight.shape)} but must be [num_tasks={old_state.mu.shape[0]}, "
            "in_features]"
        )
    if bias.shape != old_state.mu.shape:
        raise ValueError(
            f"bias has shape {tuple(bias.shape)} but must be [num_tasks={old_state.mu.shape[0]}]"
        )
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
        beta: float,
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
    def update(
        self, targets: torch.Tensor, task_ids: int | torch.Tensor = 0, allreduce: Allreduce | None = None
    ) -> PopArtState:
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
            old,
            targets,
            task_ids,
            beta=self.beta,
            sigma_min=self.sigma_min,
            sigma_max=self.sigma_max,
            allreduce=allreduce,
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
