"""Agent adapters: what an actor runs between the env and the wire.

An adapter owns the actor-side policy copy, says which trajectory schema it
fills, turns a batch of observations into env actions plus the arrays to record,
and loads published parameters. The actor loop (``actors.loop``) is the same
for every adapter; ``make_agent`` picks one by the type of its spec.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol

import numpy as np

from actors.impala_agent import ImpalaAgent
from actors.ppo_agent import PPOAgent
from impala.envs.vector import StepResult
from impala.transport.messages import AgentSpec, ImpalaAgentSpec, PPOAgentSpec
from impala.transport.trajectory import TrajectorySchema


class Agent(Protocol):
    """What an actor steps its envs with: loads weights, acts on a batch of observations, fills unrolls."""

    schema: TrajectorySchema  # what one unroll holds
    params_schema: TrajectorySchema  # what a weights message holds

    def load_params(self, arrays: Mapping[str, np.ndarray]) -> None: ...
    def unroll_start(self, obs: np.ndarray) -> dict[str, np.ndarray]: ...
    def observation(self, obs: np.ndarray, first: np.ndarray) -> dict[str, np.ndarray]: ...
    def act(self, obs: np.ndarray, first: np.ndarray) -> tuple[np.ndarray, dict[str, np.ndarray]]: ...
    def act_greedy(
        self, obs: np.ndarray, first: np.ndarray
    ) -> tuple[np.ndarray, dict[str, np.ndarray]]: ...  # evaluation only
    def transition(self, result: StepResult) -> dict[str, np.ndarray]: ...
    def params_wait_s(self, unrolls_sent: int) -> float: ...


def make_agent(spec: AgentSpec, *, envs: Any, first_obs: np.ndarray, unroll_length: int, seed: int) -> Agent:
    """The adapter for ``spec``, built in the actor's process.

    ``envs``: the vector env; ``first_obs``: [K, ...] from reset.
    """
    if isinstance(spec, ImpalaAgentSpec):
        return ImpalaAgent(spec, envs=envs, first_obs=first_obs, unroll_length=unroll_length, seed=seed)
    if isinstance(spec, PPOAgentSpec):
        return PPOAgent(spec, envs=envs, first_obs=first_obs, unroll_length=unroll_length, seed=seed)
    raise TypeError(f"no agent adapter for {type(spec).__name__}")
