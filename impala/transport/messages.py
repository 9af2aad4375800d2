"""Typed contracts for what travels between processes as plain data.

An actor needs to know which agent adapter to run and with what settings
(:class:`ImpalaAgentSpec`, :class:`PPOAgentSpec`); a remote actor learns the whole run
(:class:`RunInfo`: env, agent, unroll length, envs per actor) from the learner's weights
messages. Each type has ``to_dict`` (what the wire codec carries: JSON-like data, never
pickles) and ``from_dict``, which validates a peer's data and raises ``ValueError`` with
what is wrong.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping, Union

from impala.envs import EnvSpec
from impala.envs.obs_layout import ObsLayout
from impala.run.config import MAX_TASKS, POPART_BETA
from impala.run.ppo_config import PPOConfig


def _get(d: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str) -> Any:
    if not isinstance(d, Mapping) or key not in d:
        raise ValueError(f"{what}: missing {key!r}")
    value = d[key]
    if isinstance(value, bool) and kind is not bool and (kind is int or kind == (int, float)):
        raise ValueError(f"{what}: {key} must be a number, got {value!r}")
    if not isinstance(value, kind):
        raise ValueError(
            f"{what}: {key} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}"
        )
    return value


MAX_SYNC_ROUNDS = 1 << 16  # --sync: unrolls an actor sends per update (--batch-size over the local envs)


@dataclass(frozen=True)
class ImpalaAgentSpec:
    """Discrete actions from an IMPALA network (``impala.nets.impala_net.build_model``)."""

    model: str
    use_lstm: bool = False
    popart_beta: float = POPART_BETA
    frame_stack: int = 0  # > 1: send each frame once (impala.transport.trajectory.impala_unroll_schema)
    num_tasks: int = 1  # > 1: multi-task; PopArt value heads, and every unroll carries its task index
    obs_norm: bool = False  # the image torso standardizes pixels by running statistics (in the weights)
    # --sync: after this many unrolls (rounds of its envs) with one set of weights, wait for newer ones
    unrolls_per_update: int = 0
    kind: str = dataclasses.field(default="impala", init=False)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "model": self.model,
            "use_lstm": self.use_lstm,
            "popart_beta": self.popart_beta,
            "frame_stack": self.frame_stack,
            "num_tasks": self.num_tasks,
            "obs_norm": self.obs_norm,
            "unrolls_per_update": self.unrolls_per_update,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ImpalaAgentSpec":
        what = "impala agent settings"
        model = _get(d, "model", str, what)
        if model not in ("auto", "shallow", "nature", "deep", "mlp"):
            raise ValueError(f"{what}: unknown model {model!r}")
        beta = float(_get(d, "popart_beta", (int, float), what))
        if not 0 < beta <= 1:
            raise ValueError(f"{what}: popart_beta must be in (0, 1], got {beta}")
        stack = d.get("frame_stack", 0)  # absent in checkpoints written before frames travelled once
        if isinstance(stack, bool) or not isinstance(stack, int) or not 0 <= stack <= 64:
            raise ValueError(f"{what}: frame_stack must be an int in [0, 64], got {stack!r}")
        tasks = d.get("num_tasks", 1)  # absent before multi-task runs
        if isinstance(tasks, bool) or not isinstance(tasks, int) or not 1 <= tasks <= MAX_TASKS:
            raise ValueError(f"{what}: num_tasks must be an int in [1, {MAX_TASKS}], got {tasks!r}")
        obs_norm = d.get("obs_norm", False)  # absent before --obs-norm
        if not isinstance(obs_norm, bool):
            raise ValueError(f"{what}: obs_norm must be a bool, got {obs_norm!r}")
        rounds = d.get("unrolls_per_update", 0)  # absent before --sync
        if isinstance(rounds, bool) or not isinstance(rounds, int) or not 0 <= rounds <= MAX_SYNC_ROUNDS:
            raise ValueError(
                f"{what}: unrolls_per_update must be an int in [0, {MAX_SYNC_ROUNDS}], got {rounds!r}"
            )
        return cls(model, _get(d, "use_lstm", bool, what), beta, stack, tasks, obs_norm, rounds)


# The env action spaces a PPO actor can drive (Unity: continuous, discrete branches or both).
PPO_ACTION_SPACES = ("Box", "Discrete", "MultiDiscrete", "Unity")
MAX_BRANCHES = 64  # discrete branches a PPO policy may have (bounds what a peer's run info can ask for)
MAX_BRANCH_SIZE = 4096  # actions in one branch


@dataclass(frozen=True)
class PPOAgentSpec:
    """The PPO policy's actions: ``action_dim`` continuous ones and/or one index per entry of
    ``branches`` (``action_space``: the env's space, which says how the env takes them; ``action_mask``:
    the env masks discrete actions). ``unrolls_per_update`` / ``params_wait_s`` make an on-policy actor
    wait for new weights once it sent its share of an update; ``sole_actor``: it is the learner's only
    local actor, so it can tell exactly which of its unrolls fill the buffer (trajectory_handling
    'mlagents') and wait there, which makes a seeded single-actor run repeat itself."""

    config: PPOConfig
    obs_dim: int
    action_dim: int
    action_low: tuple[float, ...]
    action_high: tuple[float, ...]
    unrolls_per_update: int = 0
    params_wait_s: float = 0.0
    branches: tuple[int, ...] = ()
    action_space: str = "Box"
    action_mask: bool = False
    obs_layout: ObsLayout = ObsLayout()  # which parts of the flat observation are images
    sole_actor: bool = False
    kind: str = dataclasses.field(default="ppo", init=False)

    def __post_init__(self) -> None:
        if self.obs_layout.shapes and sum(self.obs_layout.sizes) != self.obs_dim:
            raise ValueError(
                f"ppo agent settings: observation layout {self.obs_layout.shapes} does not add up to obs_dim "
                f"{self.obs_dim}"
            )
        if self.obs_dim < 1 or self.action_dim < 0 or not (self.action_dim or self.branches):
            raise ValueError(
                f"ppo agent settings: obs_dim must be >= 1 and there must be continuous or discrete actions, "
                f"got obs_dim {self.obs_dim}, action_dim {self.action_dim}, branches {self.branches}"
            )
        if (
            any(type(n) is not int or not 1 <= n <= MAX_BRANCH_SIZE for n in self.branches)
            or len(self.branches) > MAX_BRANCHES
        ):
            raise ValueError(
                f"ppo agent settings: up to {MAX_BRANCHES} branches of 1..{MAX_BRANCH_SIZE} actions each, "
                f"got {self.branches}"
            )
        if self.action_space not in PPO_ACTION_SPACES:
            raise ValueError(
                f"ppo agent settings: action_space must be one of {PPO_ACTION_SPACES}, got "
                f"{self.action_space!r}"
            )
        if self.action_mask and not self.branches:
            raise ValueError("ppo agent settings: an action mask needs discrete branches")
        if len(self.action_low) != self.action_dim or len(self.action_high) != self.action_dim:
            raise ValueError(f"ppo agent settings: action bounds must have {self.action_dim} values")
        if not all(math.isfinite(x) for x in (*self.action_low, *self.action_high, self.params_wait_s)):
            raise ValueError("ppo agent settings: action bounds and params_wait_s must be finite")
        if self.unrolls_per_update < 0 or self.params_wait_s < 0:
            raise ValueError("ppo agent settings: unrolls_per_update and params_wait_s must be >= 0")

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "config": dataclasses.asdict(self.config),
            "obs_dim": self.obs_dim,
            "action_dim": self.action_dim,
            "action_low": list(self.action_low),
            "action_high": list(self.action_high),
            "unrolls_per_update": self.unrolls_per_update,
            "params_wait_s": self.params_wait_s,
            "branches": list(self.branches),
            "action_space": self.action_space,
            "action_mask": self.action_mask,
            "obs_layout": self.obs_layout.to_dict(),
            "sole_actor": self.sole_actor,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "PPOAgentSpec":
        what = "ppo agent settings"
        raw = _get(d, "config", Mapping, what)
        known = {f.name for f in dataclasses.fields(PPOConfig)}
        if set(raw) - known:
            raise ValueError(f"{what}: unknown PPO options {sorted(set(raw) - known)}")
        try:
            config = PPOConfig(**raw)
        except (ValueError, TypeError) as e:  # ConfigError is a ValueError
            raise ValueError(f"{what}: {e}") from None
        bounds = [_get(d, k, list, what) for k in ("action_low", "action_high")]
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for b in bounds for x in b):
            raise ValueError(f"{what}: action bounds must be numbers")
        return cls(
            config,
            _get(d, "obs_dim", int, what),
            _get(d, "action_dim", int, what),
            tuple(float(x) for x in bounds[0]),
            tuple(float(x) for x in bounds[1]),
            _get(d, "unrolls_per_update", int, what),
            float(_get(d, "params_wait_s", (int, float), what)),
            # absent from the settings of runs (and checkpoints) from before discrete actions
            tuple(_get(d, "branches", list, what)) if "branches" in d else (),
            _get(d, "action_space", str, what) if "action_space" in d else "Box",
            _get(d, "action_mask", bool, what) if "action_mask" in d else False,
            # absent from runs (and checkpoints) from before visual observations: one vector
            ObsLayout.from_dict(_get(d, "obs_layout", Mapping, what)) if "obs_layout" in d else ObsLayout(),
            # absent from runs (and checkpoints) from before single-actor runs waited exactly
            _get(d, "sole_actor", bool, what) if "sole_actor" in d else False,
        )


AgentSpec = Union[ImpalaAgentSpec, PPOAgentSpec]
AGENT_SPECS: dict[str, Any] = {"impala": ImpalaAgentSpec, "ppo": PPOAgentSpec}


def agent_spec_from_dict(d: Mapping[str, Any]) -> AgentSpec:
    """A peer's agent settings as the typed spec of their kind; ValueError for anything else."""
    kind = d.get("kind") if isinstance(d, Mapping) else None
    if kind not in AGENT_SPECS:
        raise ValueError(f"unknown agent kind {kind!r} (known: {', '.join(AGENT_SPECS)})")
    return AGENT_SPECS[kind].from_dict(d)


def deal_task(actor_id: int, env_index: int, envs_per_worker: int, num_tasks: int) -> int:
    """Which task env ``env_index`` of actor ``actor_id`` plays: the run's env slots (actor-major, K per
    actor) are dealt to the tasks round-robin, so every task gets ``workers * K / N`` envs (within one)
    however few actors there are. The envs of one actor step in lockstep, so equal envs are equal frames:
    with 2 actors of 5 envs and 5 games, each actor plays every game once. Local and remote actors alike;
    the learner checks every unroll's task against this."""
    return (actor_id * envs_per_worker + env_index) % num_tasks


def task_shares(workers: int, envs_per_worker: int, num_tasks: int) -> list[int]:
    """How many of ``workers`` actors' envs :func:`deal_task` gives each task."""
    shares = [0] * num_tasks
    for actor in range(workers):
        for k in range(envs_per_worker):
            shares[deal_task(actor, k, envs_per_worker, num_tasks)] += 1
    return shares


@dataclass(frozen=True)
class RunInfo:
    """What a remote actor runs, sent with every weights message: a new ``run_id`` means a new
    learner process (actors say hello again)."""

    run_id: str
    env: EnvSpec  # task 0's env (the only one in a single-task run)
    agent: AgentSpec
    unroll_length: int
    envs_per_worker: int
    tasks: tuple[EnvSpec, ...] = ()  # a multi-task run's envs, in task order (see deal_task)

    @property
    def task_envs(self) -> tuple[EnvSpec, ...]:
        return self.tasks or (self.env,)

    def task_of(self, actor_id: int, env_index: int = 0) -> int:
        """The task of env ``env_index`` of actor ``actor_id`` (:func:`deal_task`)."""
        return deal_task(actor_id, env_index, self.envs_per_worker, len(self.task_envs))

    def actor_tasks(self, actor_id: int) -> tuple[int, ...]:
        """The task of each of actor ``actor_id``'s envs, in env order."""
        return tuple(self.task_of(actor_id, k) for k in range(self.envs_per_worker))

    def for_remote_actors(self) -> "RunInfo":
        """What the learner tells actors it did not start: none of them is its only actor (a PPO spec's
        ``sole_actor`` is for the one local actor it started)."""
        if not getattr(self.agent, "sole_actor", False):
            return self
        return dataclasses.replace(self, agent=dataclasses.replace(self.agent, sole_actor=False))

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "env": self.env.to_dict(),
            "agent": self.agent.to_dict(),
            "unroll_length": self.unroll_length,
            "envs_per_worker": self.envs_per_worker,
            "tasks": [t.to_dict() for t in self.tasks],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "RunInfo":
        what = "run info"
        T, K = _get(d, "unroll_length", int, what), _get(d, "envs_per_worker", int, what)
        if not (1 <= T <= 100_000 and 1 <= K <= 10_000):
            raise ValueError(f"{what}: unroll_length {T} / envs_per_worker {K} out of range")
        tasks = d.get("tasks", [])  # absent before multi-task runs
        if not isinstance(tasks, list) or len(tasks) > MAX_TASKS:
            raise ValueError(f"{what}: tasks must be a list of at most {MAX_TASKS} env specs")
        agent = agent_spec_from_dict(_get(d, "agent", Mapping, what))
        if tasks and getattr(agent, "num_tasks", 1) != len(tasks):
            raise ValueError(
                f"{what}: {len(tasks)} tasks but the agent has {getattr(agent, 'num_tasks', 1)} value heads"
            )
        return cls(
            _get(d, "run_id", str, what),
            EnvSpec.from_dict(_get(d, "env", Mapping, what)),
            agent,
            T,
            K,
            tuple(EnvSpec.from_dict(t) for t in tasks),
        )
