"""The PPO agent adapter: a Gaussian actor-critic copy in the actor, filling ``ppo_unroll_schema``.

Built inside the actor's process by ``actors.agents.make_agent`` from a
:class:`impala.transport.messages.PPOAgentSpec` (the PPO trainer makes it in the learner).

What it records per step (docs/PPO.md #9, #10, #12):

- ``obs``: the **raw** observation as float32 (the learner normalizes with its
  own statistics; the network here carries the normalizer buffers it was sent).
- ``actions``: the raw Gaussian sample; the env receives ``env_action(raw)``:
  ``clamp(a, -3, 3) / 3`` for ``action_clip='mlagents'``, ``clip(a, low, high)``
  for ``'bounds'`` (SB3).
- ``discrete_actions``: one index per branch (a ``Discrete`` env gets the index,
  a ``MultiDiscrete`` one the row); ``action_mask`` where the env masks actions.
- ``log_probs``: per action element (continuous dimensions, then branches), in
  the configured form (``log_prob_form``).
- ``rewards``, ``terminated``, ``truncated``; ``final_obs`` = the last obs of an
  episode that ended at t (zeros where none ended), for the truncation bootstrap.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from impala.envs.probe import flat_obs_dim
from impala.envs.vector import StepResult
from impala.nets.ppo_policy import env_action, make_policy
from impala.transport.messages import PPOAgentSpec
from impala.transport.params import load_state_arrays, state_dict_schema
from impala.transport.trajectory import ppo_unroll_schema


class PPOAgent:
    """Samples actions from the broadcast policy; records what ``ppo_unroll_schema`` needs."""

    def __init__(
        self, spec: PPOAgentSpec, *, envs: Any, first_obs: np.ndarray, unroll_length: int, seed: int
    ) -> None:
        self.config = spec.config
        self.num_envs = int(envs.num_envs)
        self.obs_dim = spec.obs_dim
        self.action_dim = spec.action_dim
        self.branches, self.action_space = tuple(spec.branches), spec.action_space
        self.masked = spec.action_mask
        got = flat_obs_dim(tuple(np.shape(first_obs)[1:]))
        if got != self.obs_dim:
            raise ValueError(
                f"PPOAgent: the env's observations have {got} values, the learner expects {self.obs_dim}"
            )
        space = getattr(envs, "action_space", None)
        got_a = int(
            getattr(envs, "action_dim", 0)
            or (np.prod(getattr(space, "shape", None) or (0,)) if self.action_space == "Box" else 0)
        )
        if got_a and got_a != self.action_dim:
            raise ValueError(
                f"PPOAgent: the env takes {got_a} action values, the learner expects {self.action_dim}"
            )
        self.action_low = np.asarray(spec.action_low, np.float32)
        self.action_high = np.asarray(spec.action_high, np.float32)
        got_b = getattr(envs, "action_branches", None)
        if got_b is None and space is not None and self.action_space in ("Discrete", "MultiDiscrete"):
            got_b = (int(space.n),) if self.action_space == "Discrete" else tuple(int(n) for n in space.nvec)
        if got_b is not None and tuple(got_b) != self.branches:
            raise ValueError(
                f"PPOAgent: the env's discrete branches are {list(got_b)}, the learner expects "
                f"{list(self.branches)}"
            )
        self.policy = make_policy(self.config, self.obs_dim, self.action_dim, self.branches, spec.obs_layout)
        self.policy.eval()
        self.schema = ppo_unroll_schema(
            unroll_length, self.obs_dim, self.action_dim, self.branches, self.masked
        )
        self._mask = None  # the env's action mask for the next step [K, sum(branches)] (masked envs)
        self.params_schema = state_dict_schema(self.policy)
        self.generator = torch.Generator().manual_seed(int(seed))
        self._zeros_obs = np.zeros((self.num_envs, self.obs_dim), np.float32)
        self.unrolls_per_update = spec.unrolls_per_update
        self.wait_s = spec.params_wait_s
        # trajectory_handling='mlagents' (#15): the learner cuts each env's steps into trajectories (episode
        # end or time_horizon steps from the trajectory's start) and its buffer fills with completed ones
        # only.
        # The same cut, counted here, tells when this actor sent its share of an update.
        self.count_trajectories = self.config.trajectory_handling == "mlagents"
        self.share_steps = self.unrolls_per_update * unroll_length * self.num_envs
        self._trajectory_len = np.zeros(self.num_envs, np.int64)
        self.completed_steps = 0  # steps of trajectories completed since the current weights arrived
        # The learner's only actor (spec.sole_actor) follows the learner's buffer exactly: the learner adds
        # each unroll's completed trajectories in the order they were sent (env 0, 1, ...) and updates
        # right after the one that fills it, so the rest of that round already counts for the next update.
        self.sole_actor = spec.sole_actor and self.count_trajectories
        self._round_completed = np.zeros(self.num_envs, np.int64)  # per env, this round
        self._buffer_steps = 0  # completed steps in the learner's buffer, as counted here
        self._waiting = False  # the last round filled the buffer: these weights are the old ones

    def load_params(self, arrays: Mapping[str, np.ndarray]) -> None:
        """Weights, log-sigma and the normalizer buffers (ML-Agents stats or the vecnormalize snapshot)."""
        load_state_arrays(self.policy, arrays)
        self.completed_steps = 0
        if not self._waiting:  # weights that came while this actor did not expect an update: count afresh
            self._buffer_steps = 0
        self._waiting = False

    def params_wait_s(self, unrolls_sent: int) -> float:
        """Seconds the actor loop waits for newer weights after sending ``unrolls_sent`` unrolls with the
        current ones.

        On-policy: once this actor sent its share of one update's buffer (``unrolls_per_update``, computed by
        the
        launcher), anything more it collected with these weights would arrive after the update and be dropped
        as
        stale; waiting for the new weights instead saves that work. The wait is bounded, so an estimate that
        is off
        (e.g. a dropped unroll) costs at most ``params_wait_s`` once, never a deadlock.

        trajectory_handling='mlagents': the learner's buffer takes only completed trajectories, so the share
        is
        counted in steps of trajectories this actor completed since the weights arrived
        (``unrolls_per_update``
        rounds' worth); the steps of unfinished ones go on with the new weights, as in ML-Agents.
        """
        if not self.unrolls_per_update:
            return 0.0
        if self.sole_actor:
            self._waiting = self._round_fills_buffer()
            return self.wait_s if self._waiting else 0.0
        if self.count_trajectories:
            return self.wait_s if self.completed_steps >= self.share_steps else 0.0
        return self.wait_s if unrolls_sent >= self.unrolls_per_update else 0.0

    def _round_fills_buffer(self) -> bool:
        """Replay the learner's count over the round just sent, one env's unroll at a time: whether one of
        them filled the buffer (the learner updates after it; the steps after it start the next buffer).

        Exact while every unroll arrives; when one does not, the weights come at another time than
        expected and :meth:`load_params` starts the count afresh, so a miss costs one bounded wait."""
        fills = False
        for steps in self._round_completed.tolist():
            self._buffer_steps += steps
            if self._buffer_steps >= self.config.update_steps:  # the learner's own trigger
                fills, self._buffer_steps = True, 0
        self._round_completed[:] = 0
        return fills

    def unroll_start(self, obs: np.ndarray) -> dict[str, np.ndarray]:
        return {}

    def _flat(self, obs: np.ndarray) -> np.ndarray:
        return np.asarray(obs, dtype=np.float32).reshape(self.num_envs, self.obs_dim)

    def _act(self, obs: np.ndarray, deterministic: bool) -> tuple[Any, dict[str, np.ndarray]]:
        # The actor body and action heads only: the learner recomputes values at ingest (#13), so the
        # acting forward pass skips the critic.
        policy = self.policy
        mask_np = self._mask
        if self.masked and mask_np is None:  # no mask from the env this step: everything allowed
            mask_np = np.ones((self.num_envs, sum(self.branches)), bool)
        mask = None if mask_np is None else torch.from_numpy(mask_np)
        features = policy.actor_features(torch.from_numpy(self._flat(obs)))
        action, log_probs, discrete = policy.sample_from_features(
            features, deterministic, self.generator, mask
        )
        recorded = {"log_probs": log_probs.numpy()}
        to_env: Any = None
        if self.action_dim:
            raw = action.numpy()
            recorded["actions"] = raw
            to_env = env_action(raw, mode=self.config.action_clip, low=self.action_low, high=self.action_high)
        if discrete is not None:
            picks = discrete.numpy()
            recorded["discrete_actions"] = picks
            if mask_np is not None:
                recorded["action_mask"] = mask_np
            if self.action_space == "Discrete":
                to_env = picks[:, 0]
            elif self.action_dim:  # Unity's hybrid actions: both parts
                to_env = (to_env, picks)
            else:  # MultiDiscrete, or Unity's discrete branches
                to_env = picks
        return to_env, recorded

    @torch.inference_mode()
    def act(self, obs: np.ndarray, first: np.ndarray) -> tuple[Any, dict[str, np.ndarray]]:
        """A sampled action per env: what the env receives, and what the unroll records."""
        return self._act(obs, deterministic=False)

    @torch.inference_mode()
    def act_greedy(self, obs: np.ndarray, first: np.ndarray) -> tuple[Any, dict[str, np.ndarray]]:
        """:meth:`act` with the Gaussian's mean and each branch's most likely action instead of samples.

        For evaluation (``impala-eval --policy greedy``); the actor loop never calls it.
        """
        return self._act(obs, deterministic=True)

    def transition(self, result: StepResult) -> dict[str, np.ndarray]:
        ended = result.terminated | result.truncated
        if self.count_trajectories:
            self._trajectory_len += 1
            cut = ended | (self._trajectory_len >= self.config.time_horizon)
            self.completed_steps += int(self._trajectory_len[cut].sum())
            self._round_completed[cut] += self._trajectory_len[cut]
            self._trajectory_len[cut] = 0
        if ended.any():
            final_obs = np.where(ended[:, None], self._flat(result.final_obs), 0.0).astype(np.float32)
        else:
            final_obs = self._zeros_obs
        return {
            "rewards": np.asarray(result.reward, np.float32),
            "terminated": np.asarray(result.terminated, bool),
            "truncated": np.asarray(result.truncated, bool),
            "final_obs": final_obs,
        }

    def observation(self, obs: np.ndarray, first: np.ndarray) -> dict[str, np.ndarray]:
        return {"obs": self._flat(obs)}

    def set_action_mask(self, mask: np.ndarray | None) -> None:
        """The env's action mask [K, sum(branches)] (True: allowed) for the next :meth:`act`."""
        if self.masked:
            self._mask = None if mask is None else np.asarray(mask, bool).reshape(self.num_envs, -1)
