"""V-trace off-policy actor-critic targets (Espeholt et al. 2018, "IMPALA", arXiv:1802.01561).

Keeps DeepMind's public signatures (``from_importance_weights``, ``from_logits``,
``VTraceReturns``) as TorchBeast does, so the learner reads like the paper and the
reference implementations.

For a trajectory ``x_s, a_s, r_s, ...`` collected by a behaviour policy ``mu`` and a
target policy ``pi``, with ``rho_t = min(rho_bar, pi(a_t|x_t) / mu(a_t|x_t))`` and
``c_i = min(1, pi(a_i|x_i) / mu(a_i|x_i))`` (eq. 1 of the paper)::

    v_s = V(x_s) + sum_{t>=s} gamma^{t-s} (prod_{i=s}^{t-1} c_i) rho_t delta_t V,
    delta_t V = r_t + gamma V(x_{t+1}) - V(x_t),

computed with the equivalent backward recursion (Remark 1)::

    v_s - V(x_s) = rho_s delta_s V + gamma_s c_s (v_{s+1} - V(x_{s+1})).

The policy-gradient advantage is ``rho^pg_s (r_s + gamma_s v_{s+1} - V(x_s))`` with
its own clip ``rho^pg_bar``.

Every tensor is time-major ``[T, B, ...]``; any trailing dims (for example one value
per PopArt task) are carried along element-wise. ``gamma`` is per step
(``discounts = gamma * (1 - done)``), which is how episode boundaries inside an
unroll cut the trace.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "VTraceReturns",
    "VTraceFromLogitsReturns",
    "action_log_probs",
    "from_importance_weights",
    "from_logits",
]


class VTraceReturns(NamedTuple):
    """Outputs of :func:`from_importance_weights`; both stop gradients.

    vs: V-trace value targets ``v_s``, shape [T, B, ...].
    pg_advantages: ``rho^pg_s (r_s + gamma_s v_{s+1} - V(x_s))``, shape [T, B, ...].
    """

    vs: torch.Tensor
    pg_advantages: torch.Tensor


class VTraceFromLogitsReturns(NamedTuple):
    """Outputs of :func:`from_logits`.

    vs, pg_advantages: as in :class:`VTraceReturns` (no gradient), shape [T, B, ...].
    log_rhos: ``log pi(a|x) - log mu(a|x)``, shape [T, B, ...]; carries the target
        policy's gradient, like DeepMind's version.
    behaviour_action_log_probs: ``log mu(a_t|x_t)``, shape [T, B, ...].
    target_action_log_probs: ``log pi(a_t|x_t)``, shape [T, B, ...]; keeps its
        gradient so the learner can use it directly in the policy-gradient loss.
    """

    vs: torch.Tensor
    pg_advantages: torch.Tensor
    log_rhos: torch.Tensor
    behaviour_action_log_probs: torch.Tensor
    target_action_log_probs: torch.Tensor


def action_log_probs(logits: torch.Tensor, actions: torch.Tensor) -> torch.Tensor:
    """Log-probability of ``actions`` under the categorical ``softmax(logits)``.

    Args:
      logits: unnormalized log-probabilities, shape [..., A].
      actions: int64 action indices in [0, A), shape [...] (``logits.shape[:-1]``).

    Returns:
      ``log softmax(logits)[..., actions]``, shape [...]; differentiable w.r.t. logits.
    """
    return F.log_softmax(logits, dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)


def from_importance_weights(
    log_rhos: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    lambda_: float = 1.0,
) -> VTraceReturns:
    """V-trace targets from log importance weights (Espeholt et al. 2018, Sec. 4.1).

    Args:
      log_rhos: ``log pi(a_t|x_t) - log mu(a_t|x_t)``, shape [T, B, ...].
      discounts: ``gamma_t``, zero where the episode ended at step t, shape [T, B, ...].
      rewards: ``r_t``, shape [T, B, ...].
      values: ``V(x_t)`` under the target policy's critic, shape [T, B, ...].
      bootstrap_value: ``V(x_T)``, shape [B, ...].
      clip_rho_threshold: ``rho_bar`` for the value targets; ``None`` = no clipping.
      clip_pg_rho_threshold: ``rho^pg_bar`` for the advantages; ``None`` = no clipping.
      lambda_: trace decay in [0, 1] (Sec. 4.2 "Remark 2"; rlax's ``lambda_``): the traces
        become ``c_i = lambda_ * min(1, rho_i)`` and the policy-gradient bootstrap
        ``lambda_ * v_{s+1} + (1 - lambda_) * V(x_{s+1})``. 1 is the paper's V-trace; on-policy,
        ``lambda_ < 1`` gives GAE(lambda) advantages and lambda-returns.

    Returns:
      :class:`VTraceReturns` ``(vs, pg_advantages)``, both shape [T, B, ...] and with
      no gradient.

    Raises:
      ValueError: naming the argument, on wrong rank, mismatched shapes or dtypes,
        or a non-finite entry (NaN in ``log_rhos``; NaN/inf in the others).
    """
    _check_shapes(log_rhos, discounts, rewards, values, bootstrap_value)
    _check_thresholds(clip_rho_threshold, clip_pg_rho_threshold)
    _check_lambda(lambda_)
    _check_finite(
        _finite_flags(log_rhos, discounts, rewards, values, bootstrap_value),
        ("log_rhos", "discounts", "rewards", "values", "bootstrap_value"),
    )
    return _vtrace(
        log_rhos,
        discounts,
        rewards,
        values,
        bootstrap_value,
        clip_rho_threshold,
        clip_pg_rho_threshold,
        lambda_,
    )


def _check_logits(
    behaviour_policy_logits: torch.Tensor, target_policy_logits: torch.Tensor, actions: torch.Tensor
) -> None:
    """The logits' shapes and dtypes against the actions' (:func:`from_logits`)."""
    for name, logits in (
        ("behaviour_policy_logits", behaviour_policy_logits),
        ("target_policy_logits", target_policy_logits),
    ):
        if logits.shape[:-1] != actions.shape or logits.dim() != actions.dim() + 1:
            raise ValueError(
                f"{name} has shape {tuple(logits.shape)} but must be actions.shape + (num_actions,) "
                f"= {tuple(actions.shape)} + (A,)"
            )
        if not logits.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {logits.dtype}")
    if behaviour_policy_logits.shape != target_policy_logits.shape:
        raise ValueError(
            f"behaviour_policy_logits has shape {tuple(behaviour_policy_logits.shape)} but "
            f"target_policy_logits has shape {tuple(target_policy_logits.shape)}"
        )
    if actions.dtype not in (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8):
        raise ValueError(f"actions must be an integer tensor, got {actions.dtype}")


def _check_logit_values(
    behaviour_policy_logits: torch.Tensor,
    target_policy_logits: torch.Tensor,
    actions: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
) -> None:
    """Finite inputs, actions in range and no NaN logits, read in one host sync (:func:`from_logits`)."""
    num_actions = target_policy_logits.shape[-1]
    # Gathered into one host sync: each check would otherwise stall the GPU on its own.
    flags = _finite_flags(None, discounts, rewards, values, bootstrap_value)
    flags = torch.cat(
        [
            flags,
            torch.stack(
                [
                    ((actions >= 0) & (actions < num_actions)).all(),
                    (behaviour_policy_logits == behaviour_policy_logits).all(),  # False only on NaN
                    (target_policy_logits == target_policy_logits).all(),
                ]
            ),
        ]
    )
    _check_finite(
        flags,
        (
            "log_rhos",
            "discounts",
            "rewards",
            "values",
            "bootstrap_value",
            "actions",
            "behaviour_policy_logits",
            "target_policy_logits",
        ),
        extra_reason={"actions": f"actions must lie in [0, {num_actions})"},
    )


def from_logits(
    behaviour_policy_logits: torch.Tensor,
    target_policy_logits: torch.Tensor,
    actions: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: float | None = 1.0,
    clip_pg_rho_threshold: float | None = 1.0,
    lambda_: float = 1.0,
) -> VTraceFromLogitsReturns:
    """V-trace for categorical policies given as logits (Espeholt et al. 2018).

    Args:
      behaviour_policy_logits: logits of ``mu`` the actor sampled from, shape [T, B, ..., A].
      target_policy_logits: logits of ``pi`` being learned, shape [T, B, ..., A].
      actions: int64 actions taken, shape [T, B, ...].
      discounts: ``gamma_t``, zero where the episode ended at step t, shape [T, B, ...].
      rewards: ``r_t``, shape [T, B, ...].
      values: ``V(x_t)``, shape [T, B, ...].
      bootstrap_value: ``V(x_T)``, shape [B, ...].
      clip_rho_threshold: ``rho_bar``; ``None`` = no clipping.
      clip_pg_rho_threshold: ``rho^pg_bar``; ``None`` = no clipping.

    Returns:
      :class:`VTraceFromLogitsReturns`. Only ``vs`` and ``pg_advantages`` stop
      gradients; ``target_action_log_probs`` (and so ``log_rhos``) keep the target
      policy's gradient.

    Raises:
      ValueError: naming the argument, on wrong ranks or shapes, non-integer or
        out-of-range actions, NaN logits, or non-finite rewards/values/discounts.
    """
    _check_shapes(actions, discounts, rewards, values, bootstrap_value, first_name="actions")
    _check_thresholds(clip_rho_threshold, clip_pg_rho_threshold)
    _check_lambda(lambda_)
    _check_logits(behaviour_policy_logits, target_policy_logits, actions)
    _check_logit_values(
        behaviour_policy_logits, target_policy_logits, actions, discounts, rewards, values, bootstrap_value
    )

    actions = actions.long()
    # Under bf16/fp16 autocast the logits arrive in reduced precision; the importance
    # weights divide small probabilities, so take the log-softmax in float32.
    if target_policy_logits.dtype in (torch.float16, torch.bfloat16):
        target_policy_logits = target_policy_logits.float()
    if behaviour_policy_logits.dtype in (torch.float16, torch.bfloat16):
        behaviour_policy_logits = behaviour_policy_logits.float()
    target_action_log_probs = action_log_probs(target_policy_logits, actions)
    behaviour_action_log_probs = action_log_probs(behaviour_policy_logits, actions)
    log_rhos = target_action_log_probs - behaviour_action_log_probs
    returns = _vtrace(
        log_rhos,
        discounts,
        rewards,
        values,
        bootstrap_value,
        clip_rho_threshold,
        clip_pg_rho_threshold,
        lambda_,
    )
    return VTraceFromLogitsReturns(
        vs=returns.vs,
        pg_advantages=returns.pg_advantages,
        log_rhos=log_rhos,
        behaviour_action_log_probs=behaviour_action_log_probs,
        target_action_log_probs=target_action_log_probs,
    )


@torch.no_grad()
def _vtrace(
    log_rhos: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    clip_rho_threshold: float | None,
    clip_pg_rho_threshold: float | None,
    lambda_: float = 1.0,
) -> VTraceReturns:
    # Targets are constants for the loss (the paper's "stop gradient" on v_s): letting
    # gradients flow through them would make the critic chase its own bootstrap.
    log_rhos = log_rhos.detach()
    values = values.detach()
    bootstrap_value = bootstrap_value.detach()

    rhos = torch.exp(log_rhos)
    clipped_rhos = rhos if clip_rho_threshold is None else rhos.clamp(max=clip_rho_threshold)
    # c_i = min(1, rho_i): the trace cut that keeps the operator a contraction (Sec. 4.1).
    cs = lambda_ * rhos.clamp(max=1.0)

    v_tp1 = torch.cat([values[1:], bootstrap_value.unsqueeze(0)], dim=0)
    deltas = clipped_rhos * (rewards + discounts * v_tp1 - values)
    discounted_cs = discounts * cs

    # Backward recursion over time: only this loop is sequential; everything else is
    # vectorized over [T, B, ...].
    vs_minus_v = torch.empty_like(deltas)
    acc = torch.zeros_like(bootstrap_value, dtype=deltas.dtype)
    for t in range(deltas.shape[0] - 1, -1, -1):
        acc = deltas[t] + discounted_cs[t] * acc
        vs_minus_v[t] = acc
    vs = vs_minus_v + values

    vs_tp1 = torch.cat([vs[1:], bootstrap_value.unsqueeze(0)], dim=0)
    if lambda_ != 1.0:
        vs_tp1 = lambda_ * vs_tp1 + (1.0 - lambda_) * v_tp1
    clipped_pg_rhos = rhos if clip_pg_rho_threshold is None else rhos.clamp(max=clip_pg_rho_threshold)
    pg_advantages = clipped_pg_rhos * (rewards + discounts * vs_tp1 - values)
    return VTraceReturns(vs=vs, pg_advantages=pg_advantages)


def _check_shapes(
    first: torch.Tensor,
    discounts: torch.Tensor,
    rewards: torch.Tensor,
    values: torch.Tensor,
    bootstrap_value: torch.Tensor,
    first_name: str = "log_rhos",
) -> None:
    """All [T, B, ...] tensors must match exactly: broadcasting would hide a layout bug."""
    named = ((first_name, first), ("discounts", discounts), ("rewards", rewards), ("values", values))
    for name, x in named + (("bootstrap_value", bootstrap_value),):
        if not isinstance(x, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if values.dim() < 2:
        raise ValueError(
            f"values must have rank >= 2 (time-major [T, B, ...]), got shape {tuple(values.shape)}"
        )
    if values.shape[0] < 1:
        raise ValueError(f"values has shape {tuple(values.shape)}: the unroll length T must be >= 1")
    for name, x in named:
        if x.shape != values.shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)} but values has shape {tuple(values.shape)}")
    if bootstrap_value.shape != values.shape[1:]:
        raise ValueError(
            f"bootstrap_value has shape {tuple(bootstrap_value.shape)} but must be values.shape[1:] "
            f"= {tuple(values.shape[1:])}"
        )
    for name, x in named[1:] + (("bootstrap_value", bootstrap_value),) + ((first_name, first),):
        if name == "actions":
            continue
        if not x.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {x.dtype}")
        if x.dtype != values.dtype:
            raise ValueError(f"{name} has dtype {x.dtype} but values has dtype {values.dtype}")


def _check_lambda(lambda_: float) -> None:
    if not 0.0 <= lambda_ <= 1.0:
        raise ValueError(f"lambda_ must be in [0, 1], got {lambda_}")


def _check_thresholds(clip_rho_threshold: float | None, clip_pg_rho_threshold: float | None) -> None:
    for name, v in (
        ("clip_rho_threshold", clip_rho_threshold),
        ("clip_pg_rho_threshold", clip_pg_rho_threshold),
    ):
        if v is not None and not v > 0:
            raise ValueError(f"{name} must be > 0 or None (no clipping), got {v}")


def _finite_flags(log_rhos: torch.Tensor | None, *others: torch.Tensor) -> torch.Tensor:
    # log_rhos may legitimately be -inf (pi(a) = 0 gives rho = 0); only NaN or +inf is bad.
    first = (
        torch.ones((), dtype=torch.bool, device=others[0].device)
        if log_rhos is None
        else (~torch.isnan(log_rhos) & (log_rhos != float("inf"))).all()
    )
    return torch.stack([first] + [torch.isfinite(x).all() for x in others])


def _check_finite(
    flags: torch.Tensor, names: tuple[str, ...], extra_reason: dict[str, str] | None = None
) -> None:
    ok = flags.tolist()  # the single host sync of the validation
    for name, good in zip(names, ok):
        if not good:
            reason = (extra_reason or {}).get(name, f"{name} contains NaN or inf")
            raise ValueError(reason)
