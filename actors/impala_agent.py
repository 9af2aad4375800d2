"""The IMPALA agent adapter: discrete actions sampled from an IMPALA network's policy logits."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from impala.envs.vector import StepResult
from impala.nets.impala_net import build_model
from impala.transport.messages import ImpalaAgentSpec
from impala.transport.params import load_state_arrays, state_dict_schema
from impala.transport.trajectory import impala_unroll_schema

# --sync: the longest an actor waits for an update's weights (a CPU learner's update takes about a second)
SYNC_WAIT_S = 60.0


class ImpalaAgent:
    """Discrete actions sampled from the policy logits of an IMPALA network."""

    def __init__(
        self, spec: ImpalaAgentSpec, *, envs: Any, first_obs: np.ndarray, unroll_length: int, seed: int
    ) -> None:
        obs_shape, obs_dtype = tuple(first_obs.shape[1:]), str(first_obs.dtype)
        num_actions, num_envs = int(envs.action_space.n), envs.num_envs

        self.model = build_model(
            spec.model,
            obs_shape,
            num_actions,
            use_lstm=spec.use_lstm,
            num_tasks=spec.num_tasks,
            obs_norm=spec.obs_norm,
        )
        self.model.eval()
        if hasattr(self.model.torso, "to_channels_last"):
            # NHWC: a 4-env CPU forward pass takes 0.64 ms instead of 1.03 ms (oneDNN). The params
            # schema and the loaded values are the same; only the in-memory layout differs.
            self.model.torso.to_channels_last()
        self.use_lstm = spec.use_lstm
        self.core_size = self.model.core.hidden_size if self.use_lstm else 0
        self.frame_stack = spec.frame_stack
        self.unrolls_per_update = spec.unrolls_per_update
        self.schema = impala_unroll_schema(
            unroll_length, obs_shape, obs_dtype, num_actions, self.core_size, spec.frame_stack, spec.num_tasks
        )
        self._last_obs: np.ndarray | None = (
            None  # frame dedup: the previous observation, to check the stacking rule
        )
        self.params_schema = state_dict_schema(self.model)
        self.generator = torch.Generator().manual_seed(seed)
        self.core_state = self.model.initial_state(num_envs) if self.use_lstm else None

    def load_params(self, arrays: Mapping[str, np.ndarray]) -> None:
        load_state_arrays(self.model, arrays)

    def unroll_start(self, obs: np.ndarray) -> dict[str, np.ndarray]:
        """Arrays recorded once per unroll (per env along axis 0); ``obs`` is the unroll's first
        observation."""
        out = {}
        if self.frame_stack > 1:
            out["obs_head"] = obs[:, :-1]  # the older frames of obs[0]; every later frame travels once
        if self.use_lstm:
            h, c = self.core_state
            # [layers=1, K, H] x2 -> [K, 2, H]
            out["core_state"] = torch.stack([h[0], c[0]], dim=1).numpy()
        return out

    def observation(self, obs: np.ndarray, first: np.ndarray) -> dict[str, np.ndarray]:
        if self.frame_stack <= 1:
            return {"obs": obs, "first": first}
        if obs is not self._last_obs:  # the last obs of an unroll is recorded again as the next one's first
            self._check_stacking(obs, first)
            self._last_obs = obs
        return {"frames": obs[:, -1], "first": first}

    def _check_stacking(self, obs: np.ndarray, first: np.ndarray) -> None:
        """The learner rebuilds stacks by a rule (``impala.transport.trajectory.rebuild_frame_stacks``); an
        env that
        stacks otherwise would train on wrong observations, so say so instead of sending frames."""
        prev = self._last_obs
        for k in range(obs.shape[0]):
            if first[k]:
                ok = bool((obs[k] == obs[k, -1]).all())
            else:
                ok = prev is None or np.array_equal(obs[k, :-1], prev[k, 1:])
            if not ok:
                raise RuntimeError(
                    f"env {k}: its observation is not a sliding stack of {self.frame_stack} frames (an "
                    "episode start "
                    "repeating its first frame), so frames cannot be sent once each; run with "
                    "--no-frame-dedup"
                )

    @torch.inference_mode()
    def act(self, obs: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        obs_t = torch.from_numpy(obs).unsqueeze(0)
        first_t = torch.from_numpy(first).unsqueeze(0)
        out, self.core_state = self.model(obs_t, first_t, self.core_state)
        logits = out.policy_logits[0]
        actions = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=self.generator).squeeze(-1)
        actions_np = actions.numpy()
        return actions_np, {"actions": actions_np, "behaviour_logits": logits.numpy()}

    @torch.inference_mode()
    def act_greedy(self, obs: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """:meth:`act` with the most likely action (argmax of the logits) instead of a sample.

        For evaluation (``impala-eval --policy greedy``); the actor loop never calls it.
        """
        obs_t = torch.from_numpy(obs).unsqueeze(0)
        first_t = torch.from_numpy(first).unsqueeze(0)
        out, self.core_state = self.model(obs_t, first_t, self.core_state)
        logits = out.policy_logits[0]
        actions_np = logits.argmax(dim=-1).numpy()
        return actions_np, {"actions": actions_np, "behaviour_logits": logits.numpy()}

    @staticmethod
    def transition(result: StepResult) -> dict[str, np.ndarray]:
        return {"rewards": result.reward, "dones": result.terminated | result.truncated}

    def params_wait_s(self, unrolls_sent: int) -> float:
        """Off-policy (V-trace corrects): no wait for newer weights, unless ``--sync``: once this actor sent
        its share of a batch with the current weights, it waits for the update's (at most SYNC_WAIT_S, so a
        lost unroll costs one wait, never a deadlock)."""
        if self.unrolls_per_update and unrolls_sent >= self.unrolls_per_update:
            return SYNC_WAIT_S
        return 0.0
