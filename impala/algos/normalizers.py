"""Observation and reward normalizers, ML-Agents and SB3 (docs/PPO.md #12).

ML-Agents (``torch_entities/encoders.py::Normalizer``) normalizes *inside the
network*: its running statistics are buffers of the model, updated once per
trajectory, and the trainer's buffer keeps raw observations. Here that is
the pure pair :func:`mlagents_normalizer_update` / :func:`mlagents_normalizer_apply`
over an immutable :class:`MLAgentsNormState`, and :class:`MLAgentsNormalizer`,
an ``nn.Module`` holding the state as buffers (the step count in int64, as ML-Agents keeps it).

SB3 (``common/vec_env/vec_normalize.py`` + ``common/running_mean_std.py``)
normalizes *in the env wrapper*: :class:`RunningMeanStd` (Chan's parallel
merge, initial count 1e-4), observations clipped to +-10 with eps 1e-8, and
rewards scaled by the std of a per-env discounted return (:class:`RewardNormalizer`).
:class:`FrozenObsNormalizer` carries a RunningMeanStd snapshot inside a policy
so that actors apply exactly the statistics the learner will store with.
"""

from __future__ import annotations

from typing import Any, Hashable, NamedTuple

import numpy as np
import torch
from torch import nn

MLAGENTS_CLIP = 5.0
SB3_CLIP_OBS = 10.0
SB3_CLIP_REWARD = 10.0
SB3_EPS = 1e-8
SB3_RMS_INIT_COUNT = 1e-4


# ------------------------------------------------------------------ ML-Agents


class MLAgentsNormState(NamedTuple):
    """Welford state: ``steps`` (int64 scalar), ``mean`` [D], ``m2`` [D] (sum of squared deviations).

    The count is an integer, as ML-Agents' ``normalization_steps`` buffer (``torch.tensor(1)``,
    int64): a float32 count stops being exact past 2^24 steps (a Crawler run passes that). It
    enters the float math only inside each division, as there.
    """

    steps: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor


def mlagents_normalizer_init(dim: int, dtype: torch.dtype = torch.float32) -> MLAgentsNormState:
    """Initial state as ML-Agents builds it: steps=1 (int64), mean=0, M2=1 per element (``dtype``)."""
    return MLAgentsNormState(
        torch.ones((), dtype=torch.int64), torch.zeros(dim, dtype=dtype), torch.ones(dim, dtype=dtype)
    )


def mlagents_normalizer_update(state: MLAgentsNormState, x: torch.Tensor) -> MLAgentsNormState:
    """Batch Welford update of one trajectory's observations.

    ``N' = N + n; mu' = mu + sum(x - mu) / N'; M2' = M2 + sum((x - mu') * (x - mu))``.
    ML-Agents calls it once per trajectory (``ppo/trainer.py::_process_trajectory``), before
    that trajectory's value estimates.

    Args:
      state: current statistics.
      x: [n, D] raw observations.
    """
    n = x.shape[0]
    steps = state.steps + n
    to_old = x - state.mean
    mean = state.mean + (to_old / steps).sum(0)
    to_new = x - mean
    m2 = state.m2 + (to_new * to_old).sum(0)
    return MLAgentsNormState(steps, mean, m2)


def mlagents_normalizer_apply(state: MLAgentsNormState, x: torch.Tensor) -> torch.Tensor:
    """``clamp((x - mu) / sqrt(M2 / N), -5, 5)``. Args: x [..., D]."""
    return torch.clamp((x - state.mean) / torch.sqrt(state.m2 / state.steps), -MLAGENTS_CLIP, MLAGENTS_CLIP)


class MLAgentsNormalizer(nn.Module):
    """ML-Agents' in-network normalizer; statistics live in buffers so they travel in ``state_dict``."""

    def __init__(self, dim: int):
        super().__init__()
        init = mlagents_normalizer_init(dim)
        self.register_buffer("steps", init.steps)  # int64, as ML-Agents' normalization_steps
        self.register_buffer("mean", init.mean)
        self.register_buffer("m2", init.m2)

    @property
    def state(self) -> MLAgentsNormState:
        return MLAgentsNormState(self.steps, self.mean, self.m2)

    @torch.no_grad()
    def update(self, x: torch.Tensor) -> None:
        """Fold one trajectory's raw observations [n, D] into the statistics."""
        new = mlagents_normalizer_update(self.state, x.to(self.mean.dtype))
        self.steps.copy_(new.steps)
        self.mean.copy_(new.mean)
        self.m2.copy_(new.m2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return mlagents_normalizer_apply(self.state, x)


# ------------------------------------------------------------------------ SB3


def rms_merge(
    mean: np.ndarray,
    var: np.ndarray,
    count: float,
    batch_mean: np.ndarray,
    batch_var: np.ndarray,
    batch_count: float,
) -> tuple[np.ndarray, np.ndarray, float]:
    """Chan et al.'s parallel merge of (mean, population var, count) moments.

    Exact: merging batches one by one gives the same moments as one merge of
    their union (up to rounding), whatever the batch sizes.
    """
    delta = batch_mean - mean
    tot = count + batch_count
    new_mean = mean + delta * batch_count / tot
    m2 = var * count + batch_var * batch_count + np.square(delta) * count * batch_count / tot
    return new_mean, m2 / tot, tot


class RunningMeanStd:
    """SB3-style running moments in float64; starts at mean 0, var 1, count 1e-4."""

    def __init__(self, shape: tuple[int, ...] = (), epsilon: float = SB3_RMS_INIT_COUNT):
        self.mean = np.zeros(shape, np.float64)
        self.var = np.ones(shape, np.float64)
        self.count = float(epsilon)

    def update(self, x: np.ndarray) -> None:
        """Fold a batch [n, *shape] in."""
        x = np.asarray(x, dtype=np.float64)
        self.mean, self.var, self.count = rms_merge(
            self.mean, self.var, self.count, x.mean(0), x.var(0), float(x.shape[0])
        )

    def state_dict(self) -> dict[str, Any]:
        return {"mean": self.mean.copy(), "var": self.var.copy(), "count": self.count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.mean = np.array(state["mean"], dtype=np.float64)
        self.var = np.array(state["var"], dtype=np.float64)
        self.count = float(state["count"])


def vecnormalize_obs(
    x: np.ndarray | torch.Tensor, mean, var, *, clip_obs: float = SB3_CLIP_OBS, eps: float = SB3_EPS
):
    """``clip((x - mean) / sqrt(var + eps), -clip_obs, clip_obs)`` (numpy or torch)."""
    if isinstance(x, torch.Tensor):
        return torch.clamp((x - mean) / torch.sqrt(var + eps), -clip_obs, clip_obs)
    return np.clip((x - mean) / np.sqrt(var + eps), -clip_obs, clip_obs)


class FrozenObsNormalizer(nn.Module):
    """A RunningMeanStd snapshot applied inside a policy (VecNormalize's obs transform).

    The learner owns the live :class:`RunningMeanStd` and copies it in with
    :meth:`set_stats` at update boundaries, so that the statistics an actor
    acted with are the ones the learner normalizes the stored obs with.
    """

    def __init__(self, dim: int, clip_obs: float = SB3_CLIP_OBS, eps: float = SB3_EPS):
        super().__init__()
        self.clip_obs = clip_obs
        self.eps = eps
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self.register_buffer("var", torch.ones(dim, dtype=torch.float64))

    @torch.no_grad()
    def set_stats(self, mean: np.ndarray, var: np.ndarray) -> None:
        self.mean.copy_(torch.as_tensor(mean, dtype=torch.float64))
        self.var.copy_(torch.as_tensor(var, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = vecnormalize_obs(x.to(torch.float64), self.mean, self.var, clip_obs=self.clip_obs, eps=self.eps)
        return out.to(x.dtype)


class RewardNormalizer:
    """VecNormalize's reward scaling: divide by the std of the discounted return.

    Per env stream: ``ret = ret * gamma + r``; ``ret_rms.update(ret)``;
    ``r' = clip(r / sqrt(ret_rms.var + eps), -10, 10)``; ``ret = 0`` where done.
    Streams are keyed by any hashable ``source`` (e.g. (actor, env index)).
    """

    def __init__(self, gamma: float, clip_reward: float = SB3_CLIP_REWARD, eps: float = SB3_EPS):
        self.gamma = gamma
        self.clip_reward = clip_reward
        self.eps = eps
        self.ret_rms = RunningMeanStd(shape=())
        self.returns: dict[Hashable, float] = {}

    def step(self, rewards: np.ndarray, dones: np.ndarray, sources: list[Hashable]) -> np.ndarray:
        """One vectorized env step over K streams, exactly as ``VecNormalize.step_wait``.

        Args:
          rewards: [K]; dones: [K] bool; sources: K stream keys.
        Returns:
          [K] float32 normalized rewards.
        """
        rewards = np.asarray(rewards, dtype=np.float64)
        ret = np.array([self.returns.get(s, 0.0) for s in sources], dtype=np.float64) * self.gamma + rewards
        self.ret_rms.update(ret)
        out = np.clip(rewards / np.sqrt(self.ret_rms.var + self.eps), -self.clip_reward, self.clip_reward)
        for i, s in enumerate(sources):
            self.returns[s] = 0.0 if dones[i] else float(ret[i])
        return out.astype(np.float32)

    def normalize_piece(self, rewards: np.ndarray, dones: np.ndarray, source: Hashable) -> np.ndarray:
        """A trajectory piece of one stream, one step at a time (K = 1 per step). Args: [T], [T]."""
        out = np.empty(len(rewards), dtype=np.float32)
        for t in range(len(rewards)):
            out[t] = self.step(rewards[t : t + 1], dones[t : t + 1], [source])[0]
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"ret_rms": self.ret_rms.state_dict(), "returns": dict(self.returns)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ret_rms.load_state_dict(state["ret_rms"])
        self.returns = dict(state["returns"])
