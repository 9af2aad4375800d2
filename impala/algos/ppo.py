"""PPO math as pure tensor functions, in two exact flavours: ML-Agents and SB3.

Every function here is stateless: no config objects, no module state. Each one
states which implementation it restates; ``docs/PPO.md`` gives the
rows (numbered #1..#15 below) and the source files they were read from.

Shapes: ``T`` time, ``B`` batch (samples or envs), ``A`` action dimensions.
GAE functions are time-major (``[T]`` or ``[T, B]``). Loss functions take flat
minibatches (``[B]`` / ``[B, A]``).

Schulman et al. 2017, "Proximal Policy Optimization Algorithms" (arXiv:1707.06347);
Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized
Advantage Estimation" (arXiv:1506.02438).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# ML-Agents' EPSILON in torch_entities/distributions.py (#9, #4).
MLAGENTS_DIST_EPS = 1e-7
# ML-Agents advantage normalization (#1): trainer/on_policy_trainer.py.
MLAGENTS_ADV_EPS = 1e-10
# SB3 advantage normalization (#1): ppo/ppo.py::train.
SB3_ADV_EPS = 1e-8
# ML-Agents schedule floors (#6): ppo/optimizer_torch.py builds polynomial_decay with these.
MLAGENTS_LR_FLOOR = 1e-10
MLAGENTS_EPSILON_FLOOR = 0.1
MLAGENTS_BETA_FLOOR = 1e-5

_LOG_SQRT_2PI = math.log(math.sqrt(2.0 * math.pi))


class GaeOutput(NamedTuple):
    """Advantages and the value targets ``returns = advantages + values``."""

    advantages: torch.Tensor
    returns: torch.Tensor


class PolicyLossOutput(NamedTuple):
    """Clipped surrogate loss and the diagnostics computed from the same ratio."""

    loss: torch.Tensor  # scalar
    ratio: torch.Tensor  # [B, A] (per_dim) or [B] (summed)
    approx_kl: torch.Tensor  # scalar, no grad
    clip_fraction: torch.Tensor  # scalar, no grad


class TotalLossOutput(NamedTuple):
    """The total loss of one minibatch and the terms it is made of."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    value_loss: torch.Tensor
    entropy: torch.Tensor  # the reduced entropy bonus term (before the coefficient)


# --------------------------------------------------------------------------- GAE


def discount_cumsum(
    x_t: torch.Tensor, *, discount: float, bootstrap: float | torch.Tensor = 0.0
) -> torch.Tensor:
    """``y_t = x_t + discount * y_{t+1}`` with ``y_T = bootstrap``.

    Args:
      x_t: [T] values to discount (ML-Agents ``discount_rewards``).
      discount: per-step factor.
      bootstrap: value carried in after the last step.
    Returns:
      [T] discounted sums.
    """
    out = torch.empty_like(x_t)
    running = torch.as_tensor(bootstrap, dtype=x_t.dtype, device=x_t.device)
    for t in range(x_t.shape[0] - 1, -1, -1):
        running = x_t[t] + discount * running
        out[t] = running
    return out


def mlagents_gae(
    r_t: torch.Tensor, v_t: torch.Tensor, v_next: float | torch.Tensor, *, gamma: float, lambd: float
) -> GaeOutput:
    """ML-Agents GAE over one trajectory segment (#13, ``ppo/trainer.py::get_gae``).

    ``delta_t = r_t + gamma * V_{t+1} - V_t`` with ``V_T = v_next``, then
    ``A = discount(delta, gamma * lambd)`` and ``R = A + V``. The segment never
    spans an episode boundary: ML-Agents cuts trajectories at done or at
    ``time_horizon``.

    Args:
      r_t: [T] rewards.
      v_t: [T] value estimates of the segment's observations.
      v_next: value of the observation after the last step. Per #14 the caller
        passes 0 when the segment ended by a real termination (done and not
        interrupted), and ``V(next_obs)`` otherwise.
      gamma, lambd: discount and GAE lambda.
    Returns:
      GaeOutput with advantages [T] and returns [T].
    """
    v_next = torch.as_tensor(v_next, dtype=v_t.dtype, device=v_t.device).reshape(1)
    v_tp1 = torch.cat([v_t[1:], v_next])
    delta_t = r_t + gamma * v_tp1 - v_t
    adv = discount_cumsum(delta_t, discount=gamma * lambd)
    return GaeOutput(adv, adv + v_t)


def sb3_bootstrap_truncated(
    r_t: torch.Tensor, truncated_t: torch.Tensor, v_terminal_t: torch.Tensor, *, gamma: float
) -> torch.Tensor:
    """SB3's time-limit bootstrap (#14, ``on_policy_algorithm.py::collect_rollouts``).

    ``r_t += gamma * V(terminal_obs_t)`` where the episode was truncated.

    Args:
      r_t: [T, ...] rewards.
      truncated_t: [T, ...] bool, True where a time limit ended the episode
        (and it did not terminate).
      v_terminal_t: [T, ...] value of the final observation of that episode; read
        only where ``truncated_t``.
    Returns:
      [T, ...] rewards with the bootstrap folded in.
    """
    return torch.where(truncated_t, r_t + gamma * v_terminal_t, r_t)


def sb3_gae(
    r_t: torch.Tensor,
    v_t: torch.Tensor,
    episode_start_t: torch.Tensor,
    last_values: torch.Tensor,
    last_dones: torch.Tensor,
    *,
    gamma: float,
    gae_lambda: float,
) -> GaeOutput:
    """SB3 GAE (#13, ``common/buffers.py::RolloutBuffer.compute_returns_and_advantage``).

    Reverse recursion with episode-start masks: for ``t < T-1`` the next step is
    non-terminal unless ``episode_start_{t+1}``; the last step uses
    ``last_values`` masked by ``last_dones``. Rewards are expected to already
    carry the truncation bootstrap (:func:`sb3_bootstrap_truncated`).

    Args:
      r_t: [T, B] rewards.
      v_t: [T, B] values stored at action time.
      episode_start_t: [T, B] bool/float, True when step t is the first of an episode.
      last_values: [B] value of the observation after step T-1.
      last_dones: [B] bool/float, True when step T-1 ended an episode.
    Returns:
      GaeOutput with advantages [T, B] and returns [T, B].
    """
    starts = episode_start_t.to(v_t.dtype)
    adv = torch.empty_like(v_t)
    last_gae = torch.zeros_like(v_t[0])
    n = v_t.shape[0]
    for t in range(n - 1, -1, -1):
        if t == n - 1:
            non_terminal = 1.0 - last_dones.to(v_t.dtype)
            v_tp1 = last_values.to(v_t.dtype)
        else:
            non_terminal = 1.0 - starts[t + 1]
            v_tp1 = v_t[t + 1]
        delta = r_t[t] + gamma * v_tp1 * non_terminal - v_t[t]
        last_gae = delta + gamma * gae_lambda * non_terminal * last_gae
        adv[t] = last_gae
    return GaeOutput(adv, adv + v_t)


# ------------------------------------------------------ advantage normalization


def normalize_advantages_mlagents(adv: torch.Tensor) -> torch.Tensor:
    """Whole-buffer normalization, once per update (#1): population std, ``+1e-10``.

    Args:
      adv: [N] advantages of the whole update buffer.
    """
    return (adv - adv.mean()) / (adv.std(unbiased=False) + MLAGENTS_ADV_EPS)


def normalize_advantages_sb3(adv: torch.Tensor) -> torch.Tensor:
    """Per-minibatch normalization (#1): unbiased std, ``+1e-8``, skipped when B == 1.

    SB3 skips a minibatch of one sample (its std is undefined, GH issue #325).

    Args:
      adv: [B] advantages of one minibatch.
    """
    if adv.numel() <= 1:
        return adv
    return (adv - adv.mean()) / (adv.std(unbiased=True) + SB3_ADV_EPS)


# ---------------------------------------------------------------- Gaussian policy


def gaussian_log_prob_mlagents(x: torch.Tensor, mu: torch.Tensor, log_sigma: torch.Tensor) -> torch.Tensor:
    """ML-Agents per-dimension Gaussian log-density (#9, ``GaussianDistInstance.log_prob``).

    ``-(x-mu)^2 / (2 sigma^2 + 1e-7) - log(sigma + 1e-7) - log(sqrt(2 pi))``.

    Args:
      x, mu: [B, A]; log_sigma: [A] or [B, A].
    Returns:
      [B, A] per-dimension log-probabilities (not summed).
    """
    sigma = torch.exp(log_sigma)
    var = sigma**2
    return (
        -((x - mu) ** 2) / (2 * var + MLAGENTS_DIST_EPS)
        - torch.log(sigma + MLAGENTS_DIST_EPS)
        - _LOG_SQRT_2PI
    )


def gaussian_entropy_mlagents(log_sigma: torch.Tensor) -> torch.Tensor:
    """ML-Agents per-dimension entropy (#4): ``0.5 * log(2 pi e sigma^2 + 1e-7)``.

    Args:
      log_sigma: [..., A]. Returns the same shape (not reduced).
    """
    sigma = torch.exp(log_sigma)
    return 0.5 * torch.log(2 * math.pi * math.e * sigma**2 + MLAGENTS_DIST_EPS)


def gaussian_log_prob_exact(x: torch.Tensor, mu: torch.Tensor, log_sigma: torch.Tensor) -> torch.Tensor:
    """Exact ``torch.distributions.Normal`` log-density per dimension (#9, SB3).

    Args:
      x, mu: [B, A]; log_sigma: [A] or [B, A]. Returns [B, A].
    """
    sigma = torch.exp(log_sigma).expand_as(mu)
    return torch.distributions.Normal(mu, sigma).log_prob(x)


def gaussian_entropy_exact(log_sigma: torch.Tensor) -> torch.Tensor:
    """Exact Normal entropy per dimension (SB3): ``0.5 + 0.5 log(2 pi) + log(sigma)``."""
    return torch.distributions.Normal(torch.zeros_like(log_sigma), torch.exp(log_sigma)).entropy()


# ---------------------------------------------------------- categorical policy (discrete branches)

# A blocked action's logit: ML-Agents ``MultiCategoricalDistribution._mask_branch`` and sb3-contrib's
# ``MaskableCategorical.apply_masking`` both use -1e8.
MASKED_LOGIT = -1e8


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """Blocked actions' logits set to -1e8; allowed ones unchanged.

    ML-Agents writes it ``logits * mask - 1e8 * (1 - mask)`` (Barracuda-friendly), sb3-contrib
    ``where(mask, logits, -1e8)``: the same numbers (``x * 1 - 1e8 * 0 == x``, ``x * 0 - 1e8 == -1e8``).

    Args:
      logits: [B, n] one branch's logits; allowed: [B, n] bool (None: every action allowed).
    """
    if allowed is None:
        return logits
    return torch.where(allowed, logits, torch.full_like(logits, MASKED_LOGIT))


def categorical_log_prob_mlagents(logits: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """ML-Agents ``CategoricalDistInstance.log_prob``: ``log(softmax(logits)[a] + 1e-7)``.

    Args:
      logits: [B, n] (already masked); action: [B] integer indices. Returns [B].
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.log(probs.gather(-1, action.long().unsqueeze(-1)).squeeze(-1) + MLAGENTS_DIST_EPS)


def categorical_entropy_mlagents(logits: torch.Tensor) -> torch.Tensor:
    """ML-Agents ``CategoricalDistInstance.entropy``: ``-sum(p * log(p + 1e-7))``. [B, n] -> [B]."""
    probs = torch.softmax(logits, dim=-1)
    return -(probs * torch.log(probs + MLAGENTS_DIST_EPS)).sum(-1)


def categorical_log_prob_exact(logits: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
    """``torch.distributions.Categorical(logits=...).log_prob`` (SB3; sb3-contrib's MaskableCategorical
    with masked logits): ``log_softmax(logits)[a]``. [B, n], [B] -> [B]."""
    return torch.log_softmax(logits, dim=-1).gather(-1, action.long().unsqueeze(-1)).squeeze(-1)


def categorical_entropy_exact(logits: torch.Tensor, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """``Categorical.entropy`` (SB3): ``-sum(p * log_softmax(logits))``; with a mask, sb3-contrib's
    ``MaskableCategorical.entropy`` counts allowed actions only. [B, n] -> [B]."""
    log_p = torch.log_softmax(logits, dim=-1)
    p_log_p = log_p.exp() * log_p
    if (
        allowed is not None
    ):  # sb3-contrib's step; blocked actions' p is exactly 0 already, so it changes nothing
        p_log_p = torch.where(allowed, p_log_p, torch.zeros_like(p_log_p))
    return -p_log_p.sum(-1)


def reduce_hybrid_entropy(
    continuous: torch.Tensor, discrete: torch.Tensor, *, over_dims: str
) -> torch.Tensor:
    """Batch-mean entropy of a policy with continuous dimensions and discrete branches (#4).

    The continuous dimensions are reduced as :func:`reduce_entropy` does (ML-Agents: mean, SB3: sum);
    the branches are summed in both libraries (ML-Agents ``ActionModel.evaluate`` sums the entropy
    columns, one per branch and one for all continuous dimensions; SB3's ``MultiCategoricalDistribution``
    sums its branches).

    Args:
      continuous: [B, A] per-dimension entropies (A may be 0); discrete: [B, nb] per-branch entropies.
    """
    per_sample = discrete.sum(-1)
    if continuous.shape[-1]:
        if over_dims == "mean":
            per_sample = per_sample + continuous.mean(-1)
        elif over_dims == "sum":
            per_sample = per_sample + continuous.sum(-1)
        else:
            raise ValueError(f"over_dims must be 'mean' or 'sum', got {over_dims!r}")
    return per_sample.mean()


# ------------------------------------------------------------------------ losses


def clipped_policy_loss(
    logp_new: torch.Tensor, logp_old: torch.Tensor, adv: torch.Tensor, *, epsilon: float, per_dim: bool
) -> PolicyLossOutput:
    """Clipped surrogate loss in either ratio form (#2).

    per_dim=True (ML-Agents ``trust_region_policy_loss``): ``r = exp(logp - logp_old)``
    per action dimension, shape [B, A]; the advantage is broadcast over A and
    the mean runs over all B*A elements.

    per_dim=False (SB3): log-probs are summed over dimensions first, ``r`` has
    shape [B].

    In both: ``L = -mean(min(r A, clamp(r, 1-eps, 1+eps) A))``. The
    diagnostics use the same ratio: ``approx_kl = mean((r - 1) - log r)``
    (Schulman's k3 estimator, as SB3 logs it) and
    ``clip_fraction = mean(|r - 1| > eps)``.

    Args:
      logp_new: [B, A] per-dimension log-probs under the current policy.
      logp_old: [B, A] per-dimension log-probs stored at action time.
      adv: [B] (already normalized if wanted).
      epsilon: clip range (decayed, for ML-Agents).
      per_dim: which ratio form.
    """
    if per_dim:
        log_ratio = logp_new - logp_old
        a = adv.unsqueeze(-1)
    else:
        log_ratio = logp_new.sum(-1) - logp_old.sum(-1)
        a = adv
    ratio = torch.exp(log_ratio)
    surr1 = ratio * a
    surr2 = torch.clamp(ratio, 1.0 - epsilon, 1.0 + epsilon) * a
    loss = -torch.min(surr1, surr2).mean()
    with torch.no_grad():
        kl = approx_kl(log_ratio)
        frac = clip_fraction(ratio, epsilon=epsilon)
    return PolicyLossOutput(loss, ratio, kl, frac)


def approx_kl(log_ratio: torch.Tensor) -> torch.Tensor:
    """``mean((r - 1) - log r)``, r = exp(log_ratio): Schulman's k3 estimate of KL(old||new), as SB3 logs it.

    Args:
      log_ratio: [B, A] or [B], in the same form as the ratio the loss uses.
    """
    return (torch.exp(log_ratio) - 1.0 - log_ratio).mean()


def clip_fraction(ratio: torch.Tensor, *, epsilon: float) -> torch.Tensor:
    """Fraction of ratio elements outside ``1 +- epsilon``. Args: ratio [B, A] or [B]."""
    return ((ratio - 1.0).abs() > epsilon).to(ratio.dtype).mean()


def value_loss_mlagents_intended(
    v_new: torch.Tensor, v_old: torch.Tensor, returns: torch.Tensor, *, epsilon: float
) -> torch.Tensor:
    """ML-Agents' clipped value loss as written (#3, ``torch/utils.py::trust_region_value_loss``).

    ``Vc = V_old + clamp(V - V_old, -eps, eps)``;
    ``L = mean(max((R - V)^2, (R - Vc)^2))``. ``epsilon`` is the *decayed
    policy epsilon*, there is no separate value clip. This is what ML-Agents
    *intends*; what 0.28 trains with is :func:`value_loss_mlagents_as_run`.

    Args:
      v_new, v_old, returns: [B].
    """
    v_clipped = v_old + torch.clamp(v_new - v_old, -epsilon, epsilon)
    return torch.max((returns - v_new) ** 2, (returns - v_clipped) ** 2).mean()


def value_loss_mlagents_as_run(v_new: torch.Tensor, returns: torch.Tensor, *, epsilon: float) -> torch.Tensor:
    """The value loss ML-Agents 0.28 actually computes (#3; Unity-Technologies/ml-agents#6281).

    In ``trainers/buffer.py`` ``RewardSignalUtil.value_estimates_key(name)`` returns the same
    key as ``returns_key(name)`` (``RewardSignalKeyPrefix.RETURNS``). So in
    ``ppo/trainer.py::_process_trajectory`` the value estimates, stored under that key and used
    for GAE, are then overwritten by ``set(local_return)``, and ``TorchPPOOptimizer.update``
    reads the returns back as ``old_values``. Its ``trust_region_value_loss`` therefore clips
    around the returns: ``max((R - V)^2, (R - (R + clamp(V - R, +-eps)))^2) = (R - V)^2``,
    because ``|clamp(V - R, +-eps)| <= |V - R|``. The clip never binds: this equals
    ``mean((R - V)^2)`` (:func:`value_loss_mse`) in value and gradient, up to rounding.

    Restated literally (the intended loss with ``V_old = R``) so that it rounds as ML-Agents does.

    Args:
      v_new, returns: [B]; epsilon: the decayed policy epsilon ML-Agents passes (it has no effect).
    """
    return value_loss_mlagents_intended(v_new, returns, returns, epsilon=epsilon)


def value_loss_mse(v_new: torch.Tensor, returns: torch.Tensor) -> torch.Tensor:
    """SB3 default value loss (#3, ``clip_range_vf=None``): ``mse(R, V)``. Args: [B]."""
    return ((returns - v_new) ** 2).mean()


def value_loss_sb3_clipped(
    v_new: torch.Tensor, v_old: torch.Tensor, returns: torch.Tensor, *, clip_range_vf: float
) -> torch.Tensor:
    """SB3 value loss with ``clip_range_vf`` set (#3): ``mse(R, V_old + clamp(V - V_old, +-c))``, no max.

    Args:
      v_new, v_old, returns: [B].
    """
    v_pred = v_old + torch.clamp(v_new - v_old, -clip_range_vf, clip_range_vf)
    return ((returns - v_pred) ** 2).mean()


def reduce_entropy(entropy: torch.Tensor, *, over_dims: str) -> torch.Tensor:
    """Batch-mean entropy after reducing the action dimensions (#4).

    Args:
      entropy: [B, A] per-dimension entropies.
      over_dims: "mean" (ML-Agents) or "sum" (SB3).
    Returns:
      scalar ``mean_B(reduce_A(H))``.
    """
    if over_dims == "mean":
        per_sample = entropy.mean(-1)
    elif over_dims == "sum":
        per_sample = entropy.sum(-1)
    else:
        raise ValueError(f"over_dims must be 'mean' or 'sum', got {over_dims!r}")
    return per_sample.mean()


def total_loss_mlagents(
    policy_loss: torch.Tensor,
    value_loss: torch.Tensor,
    entropy: torch.Tensor,
    *,
    beta: float,
    vf_coef: float = 0.5,
) -> TotalLossOutput:
    """ML-Agents total (#5, ``ppo/optimizer_torch.py::update``): ``L_pi + 0.5 L_v - beta mean(H)``."""
    loss = policy_loss + vf_coef * value_loss - beta * entropy
    return TotalLossOutput(loss, policy_loss, value_loss, entropy)


def total_loss_sb3(
    policy_loss: torch.Tensor,
    value_loss: torch.Tensor,
    entropy: torch.Tensor,
    *,
    ent_coef: float,
    vf_coef: float,
) -> TotalLossOutput:
    """SB3 total (#5): ``L_pi + ent_coef * (-mean(H)) + vf_coef * L_v``.

    Algebraically the same as the ML-Agents form; kept separate so each is a
    literal restatement of its source.
    """
    entropy_loss = -entropy
    loss = policy_loss + ent_coef * entropy_loss + vf_coef * value_loss
    return TotalLossOutput(loss, policy_loss, value_loss, entropy)


# --------------------------------------------------------------------- schedules


def polynomial_decay(initial: float, floor: float, step: int, max_step: int, power: float = 1.0) -> float:
    """ML-Agents ``polynomial_decay`` (#6): ``(init - floor) * (1 - min(step, max)/max)^power + floor``.

    ``step`` is the total number of agent steps over all agents.
    """
    global_step = min(step, max_step)
    return (initial - floor) * (1.0 - float(global_step) / max_step) ** power + floor


def progress_remaining(step: int, total: int) -> float:
    """SB3 ``_current_progress_remaining`` (#6): ``1 - step / total``."""
    return 1.0 - float(step) / float(total)


def sb3_linear_schedule(initial: float, progress: float) -> float:
    """rl-zoo/SB3 ``linear_schedule``: ``progress_remaining * initial``."""
    return progress * initial


def scheduled_value(kind: str, initial: float, floor: float, step: int, max_step: int) -> float:
    """Schedule dispatch: "constant" -> ``initial``; "linear" -> :func:`polynomial_decay`.

    With ``floor == 0`` the linear form equals SB3's ``initial * progress_remaining``
    while ``step <= max_step``.
    """
    if kind == "constant":
        return initial
    if kind == "linear":
        return polynomial_decay(initial, floor, step, max_step)
    raise ValueError(f"schedule must be 'linear' or 'constant', got {kind!r}")


# ------------------------------------------------------------------- diagnostics


def explained_variance(y_pred: torch.Tensor, y_true: torch.Tensor) -> float:
    """``1 - Var[y_true - y_pred] / Var[y_true]`` (SB3 ``common/utils.py``); NaN when Var[y_true] == 0."""
    var_y = torch.var(y_true, unbiased=False)
    if var_y == 0:
        return float("nan")
    return float(1.0 - torch.var(y_true - y_pred, unbiased=False) / var_y)
