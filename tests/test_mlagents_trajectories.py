"""Trajectory handling (``trajectory_handling='mlagents'``, #15) against ML-Agents 0.28's own code.

``test_mlagents_parity`` hands both trainers the same, already cut, trajectories. Here the cutting,
the carrying of unfinished trajectories across updates and the schedule step count are put to the
test: one agent step stream goes to

- ML-Agents: its ``AgentProcessor`` (``max_trajectory_length = time_horizon``, as
  ``TrainerController`` builds it) feeding its ``PPOTrainer`` through a trajectory queue, driven as
  ``mlagents-learn`` drives them (``SimpleEnvManager`` + ``TrainerController.advance``: the policy
  acts on the last decision steps, the env steps, ``add_experiences``, ``trainer.advance()``, which
  processes every trajectory emitted and updates once the buffer holds more than ``buffer_size``);
- ours: one ``TrajectoryPiece`` per agent and env step (an unroll of length 1, the finest an actor
  sends), in the order ML-Agents processes the steps (terminal steps first), then ``ready()`` and
  ``update()``.

Three agents whose episodes end at random (terminated or ``interrupted``), ``time_horizon`` 5 so
trajectories are cut mid-episode, buffer 30: trajectories straddle updates. The actions are
sampled by ML-Agents' policy as it stands at each step (so a straddling trajectory holds
log-probs of two policies). Both sides start from the same weights and normalizers.

Compared at every update, which must come at the same env step: the rows the update trains on in
order (obs, actions and log-probs exactly; advantages and returns to 1e-5 relative), the step count
(``trainer.get_step`` / ``policy.get_current_step()`` vs ``total_steps``), the decayed lr/epsilon/beta,
and every parameter after the update (the updates themselves are proven in test_mlagents_parity;
here they run with several minibatches, ML-Agents' shuffle replaced by our permutation).

``PLANTED_BUGS`` break our side one way each; the comparison must then fail.
"""

from __future__ import annotations

import dataclasses
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch
import yaml

from mlagents_shims import require_mlagents, vector_observation_specs

require_mlagents()

pytestmark = [
    pytest.mark.filterwarnings("ignore:Creating a tensor from a list of numpy.ndarrays:UserWarning"),
    pytest.mark.filterwarnings("ignore:The use of `x.T` on tensors:UserWarning"),
]

from mlagents.trainers.action_info import ActionInfo  # noqa: E402
from mlagents.trainers.agent_processor import AgentManagerQueue, AgentProcessor  # noqa: E402
from mlagents.trainers.behavior_id_utils import BehaviorIdentifiers  # noqa: E402
from mlagents.trainers.buffer import BufferKey, ObservationKeyPrefix, RewardSignalUtil  # noqa: E402
from mlagents.trainers.ppo.trainer import PPOTrainer as MLAgentsPPOTrainer  # noqa: E402
from mlagents.trainers.settings import TrainerSettings  # noqa: E402
from mlagents_envs.base_env import ActionSpec, BehaviorSpec, DecisionSteps, TerminalSteps  # noqa: E402

from impala.run.ppo_config import PPOConfig, from_mlagents_yaml  # noqa: E402
from learner.ppo_learner import PPOLearner, TrajectoryPiece  # noqa: E402

BEHAVIOR = "Walker"
OBS_SIZES = (5, 3)
OBS_DIM = sum(OBS_SIZES)
ACTIONS = 2
AGENTS = 3
TIME_HORIZON = 5
BUFFER, BATCH = 30, 8  # update when MORE than 30 steps; 30 // 8 = 3 minibatches, the rest dropped
ENV_STEPS = 70  # about 210 agent steps: six updates
MAX_STEPS = 400
RTOL = 1e-5


def trainer_doc() -> dict:
    return {
        "behaviors": {
            BEHAVIOR: {
                "trainer_type": "ppo",
                "hyperparameters": {
                    "batch_size": BATCH,
                    "buffer_size": BUFFER,
                    "learning_rate": 3e-3,
                    "beta": 5e-3,
                    "epsilon": 0.2,
                    "lambd": 0.95,
                    "num_epoch": 2,
                    "learning_rate_schedule": "linear",
                },
                "network_settings": {"normalize": True, "hidden_units": 16, "num_layers": 2},
                "reward_signals": {"extrinsic": {"gamma": 0.99, "strength": 1.0}},
                "max_steps": MAX_STEPS,
                "time_horizon": TIME_HORIZON,
            }
        }
    }


def our_config(**overrides: Any) -> PPOConfig:
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        path = Path(tmp) / "walker.yaml"
        path.write_text(yaml.safe_dump(trainer_doc()))
        return from_mlagents_yaml(str(path), **overrides)


PARAMS = {
    **{
        f"{side}_body.{i}.{p}": (side, f"network_body._body_endoder.seq_layers.{i}.{p}")
        for side in ("actor", "critic")
        for i in (0, 2)
        for p in ("weight", "bias")
    },
    "mu_head.weight": ("actor", "action_model._continuous_distribution.mu.weight"),
    "mu_head.bias": ("actor", "action_model._continuous_distribution.mu.bias"),
    "log_sigma": ("actor", "action_model._continuous_distribution.log_sigma"),
    "value_head.weight": ("critic", "value_heads.value_heads.extrinsic.weight"),
    "value_head.bias": ("critic", "value_heads.value_heads.extrinsic.bias"),
}


def mlagents_params(trainer: MLAgentsPPOTrainer) -> dict[str, torch.Tensor]:
    nets = {
        "actor": dict(trainer.policy.actor.named_parameters()),
        "critic": dict(trainer.optimizer.critic.named_parameters()),
    }
    return {
        ours: nets[side][name].detach().clone().reshape(-1 if ours == "log_sigma" else nets[side][name].shape)
        for ours, (side, name) in PARAMS.items()
    }


def mlagents_normalizers(trainer: MLAgentsPPOTrainer) -> dict[str, torch.Tensor]:
    out = {}
    for side, net in (("actor", trainer.policy.actor), ("critic", trainer.optimizer.critic)):
        norms = [p.normalizer for p in net.network_body.processors]
        out[f"{side}_norm.steps"] = norms[0].normalization_steps.clone()
        out[f"{side}_norm.mean"] = torch.cat([n.running_mean for n in norms]).clone()
        out[f"{side}_norm.m2"] = torch.cat([n.running_variance for n in norms]).clone()
    return out


# --------------------------------------------------------------------------- the env


class Env:
    """Three agents that request a decision every step. An episode lasts 2..13 steps and ends terminated
    or interrupted (max step); the agent is then in the TerminalSteps with its final observation and, as
    a Unity agent that starts its next episode at once, in the DecisionSteps with the first observation of
    the next one. Each agent's observations have their own offset, so the normalizer moves."""

    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.offset = self.rng.normal(0.0, 2.0, (AGENTS, OBS_DIM))
        self.left = [self._length() for _ in range(AGENTS)]
        self.obs = np.stack([self._obs(i) for i in range(AGENTS)])

    def _length(self) -> int:
        return int(self.rng.integers(2, 14))

    def _obs(self, i: int) -> np.ndarray:
        return (self.offset[i] + self.rng.normal(0.0, 1.0, OBS_DIM)).astype(np.float32)

    @staticmethod
    def split(obs: np.ndarray) -> list[np.ndarray]:
        return [
            np.ascontiguousarray(p, dtype=np.float32)
            for p in np.split(obs, np.cumsum(OBS_SIZES)[:-1], axis=1)
        ]

    def decision_steps(self, reward: np.ndarray) -> DecisionSteps:
        n = AGENTS
        return DecisionSteps(
            self.split(self.obs),
            reward.astype(np.float32),
            np.arange(n),
            None,
            np.zeros(n, np.int32),
            np.zeros(n, np.float32),
        )

    def step(self) -> tuple[DecisionSteps, TerminalSteps, list[dict]]:
        """Returns the new steps and, per agent, what its last action led to (reward, end, next obs)."""
        out, ended, final = [], [], []
        reward = self.rng.normal(0.1, 1.0, AGENTS).astype(np.float32)
        for i in range(AGENTS):
            self.left[i] -= 1
            nxt = self._obs(i)
            if self.left[i] == 0:
                interrupted = bool(self.rng.random() < 0.5)
                out.append(
                    {
                        "agent": i,
                        "reward": reward[i],
                        "terminated": not interrupted,
                        "truncated": interrupted,
                        "next_obs": nxt,
                    }
                )
                ended.append((i, interrupted))
                final.append(nxt)
                self.left[i] = self._length()
                self.obs[i] = self._obs(i)  # the next episode's first observation
            else:
                out.append(
                    {
                        "agent": i,
                        "reward": reward[i],
                        "terminated": False,
                        "truncated": False,
                        "next_obs": nxt,
                    }
                )
                self.obs[i] = nxt
        ids = np.array([i for i, _ in ended], dtype=np.int64)
        terminal = TerminalSteps(
            self.split(np.array(final, np.float32).reshape(len(ended), OBS_DIM)),
            reward[ids],
            np.array([x for _, x in ended], bool),
            ids,
            np.zeros(len(ids), np.int32),
            np.zeros(len(ids), np.float32),
        )
        # A new episode's first decision carries no reward (Unity resets the agent's reward with the episode).
        decision_reward = reward.copy()
        decision_reward[ids] = 0.0
        return self.decision_steps(decision_reward), terminal, out


# --------------------------------------------------------------------------- running both


@dataclasses.dataclass
class Update:
    env_step: int
    rows: dict[str, np.ndarray]  # what the update trains on, in order
    step: int  # the schedule's step count at the update
    schedule: dict[str, float]
    params: dict[str, torch.Tensor]  # after the update
    versions: np.ndarray  # per row: the number of updates before its action was taken


@dataclasses.dataclass
class Stream:
    """The agent step stream as ML-Agents saw it, for our side: per env step, each agent's transition."""

    steps: list[list[dict]] = dataclasses.field(default_factory=list)
    trajectories: list[dict] = dataclasses.field(default_factory=list)  # what ML-Agents' processor emitted


def build_mlagents(tmp: Path) -> tuple[MLAgentsPPOTrainer, AgentProcessor]:
    settings = TrainerSettings.structure(trainer_doc()["behaviors"][BEHAVIOR], TrainerSettings)
    settings.checkpoint_interval = 10**12
    trainer = MLAgentsPPOTrainer(BEHAVIOR, 100, settings, True, False, 0, str(tmp))
    name = f"{BEHAVIOR}?team=0"
    behavior_id = BehaviorIdentifiers.from_name_behavior_id(name)
    spec = BehaviorSpec(vector_observation_specs(OBS_SIZES), ActionSpec.create_continuous(ACTIONS))
    trainer.add_policy(behavior_id, trainer.create_policy(behavior_id, spec))
    # As TrainerController._create_trainer_and_manager: max_trajectory_length = time_horizon.
    processor = AgentProcessor(
        trainer.policy, name, trainer.stats_reporter, trainer.trainer_settings.time_horizon
    )
    queue = AgentManagerQueue(name)
    processor.publish_trajectory_queue(queue)
    trainer.subscribe_trajectory_queue(queue)
    return trainer, processor


def shuffle_like_ours(trainer: MLAgentsPPOTrainer, seed: int) -> None:
    """ML-Agents reshuffles its update buffer in place each epoch; our learner indexes its buffer with
    ``np.random.default_rng(seed).permutation(n)`` per epoch. Make ML-Agents' shuffles give our order."""
    g = np.random.default_rng(seed)
    buffer = trainer.update_buffer
    state = {"order": None}
    update_policy = trainer._update_policy

    def shuffle(sequence_length: int, key_list=None) -> None:
        n = buffer.num_experiences
        order = state["order"] if state["order"] is not None else np.arange(n)
        want = g.permutation(n)
        s = np.argsort(order)[want]
        for key in list(buffer.keys()):
            field = buffer[key]
            field.set([field[i] for i in s])
        state["order"] = want

    def update() -> bool:
        state["order"] = None
        return update_policy()

    buffer.shuffle = shuffle
    trainer._update_policy = update


def run_mlagents(tmp: Path, seed: int) -> tuple[list[Update], Stream, dict[str, torch.Tensor]]:
    """Drive ML-Agents as mlagents-learn does and record every update."""
    torch.manual_seed(0)
    trainer, processor = build_mlagents(tmp)
    policy, opt = trainer.policy, trainer.optimizer
    initial = {**mlagents_params(trainer), **mlagents_normalizers(trainer)}
    shuffle_like_ours(trainer, seed)
    updates: list[Update] = []
    stream = Stream()
    version_of: dict[bytes, int] = {}  # action row -> updates done before it was taken
    env_step = 0
    process_trajectory = trainer._process_trajectory

    def record_trajectory(trajectory):
        stream.trajectories.append(
            {
                "agent": trajectory.agent_id,
                "len": len(trajectory.steps),
                "env_step": env_step,
                "done": trajectory.done_reached,
                "interrupted": trajectory.interrupted,
            }
        )
        return process_trajectory(trajectory)

    update_policy = trainer._update_policy

    def record_update() -> bool:
        buf = trainer.update_buffer
        rows = {
            "obs": np.concatenate(
                [
                    np.asarray(buf[(ObservationKeyPrefix.OBSERVATION, i)].get_batch(), np.float32)
                    for i in range(len(OBS_SIZES))
                ],
                axis=1,
            ),
            "actions": np.asarray(buf[BufferKey.CONTINUOUS_ACTION].get_batch(), np.float32),
            "log_probs": np.asarray(buf[BufferKey.CONTINUOUS_LOG_PROBS].get_batch(), np.float32),
            "advantages": np.asarray(
                buf[BufferKey.ADVANTAGES].get_batch(), np.float32
            ),  # before _update_policy normalizes
            "returns": np.asarray(buf[RewardSignalUtil.returns_key("extrinsic")].get_batch(), np.float32),
        }
        step = policy.get_current_step()
        assert step == trainer.get_step
        schedule = {
            "learning_rate": opt.decay_learning_rate.get_value(step),
            "epsilon": opt.decay_epsilon.get_value(step),
            "beta": opt.decay_beta.get_value(step),
        }
        versions = np.array([version_of[a.tobytes()] for a in rows["actions"]])
        ok = update_policy()
        updates.append(
            Update(
                env_step,
                rows,
                step,
                schedule,
                {**mlagents_params(trainer), **mlagents_normalizers(trainer)},
                versions,
            )
        )
        return ok

    trainer._process_trajectory = record_trajectory
    trainer._update_policy = record_update

    env = Env(seed=5)
    decision = env.decision_steps(np.zeros(AGENTS, np.float32))
    # TrainerController's first advance: the reset's steps, with no action yet.
    processor.add_experiences(decision, TerminalSteps.empty(policy.behavior_spec), 0, ActionInfo.empty())
    trainer.advance()
    for env_step in range(1, ENV_STEPS + 1):
        action_info = policy.get_action(decision, 0)  # the policy as it stands now (updated in place)
        actions = action_info.outputs["action"].continuous
        log_probs = action_info.outputs["log_probs"].continuous
        for a in actions:
            version_of[a.astype(np.float32).tobytes()] = len(updates)
        acted_on = env.obs.copy()
        decision, terminal, transitions = env.step()
        for tr in transitions:
            i = tr["agent"]
            tr.update(
                obs=acted_on[i],
                action=actions[i].astype(np.float32),
                log_prob=log_probs[i].astype(np.float32),
            )
        # ML-Agents' order: the agents in the TerminalSteps first, then the rest
        # (AgentProcessor.add_experiences).
        ended = [tr for tr in transitions if tr["terminated"] or tr["truncated"]]
        stream.steps.append(ended + [tr for tr in transitions if not (tr["terminated"] or tr["truncated"])])
        processor.add_experiences(decision, terminal, 0, action_info)
        trainer.advance()
    return updates, stream, initial


def run_ours(
    stream: Stream,
    initial: dict[str, torch.Tensor],
    config: PPOConfig,
    ingest: Callable[[PPOLearner, TrajectoryPiece], bool] | None = None,
    update: Callable[[PPOLearner], dict] | None = None,
) -> list[Update]:
    learner = PPOLearner(config, OBS_DIM, ACTIONS)
    state = learner.policy.state_dict()
    state.update({k: v.clone().reshape(state[k].shape) for k, v in initial.items()})
    learner.policy.load_state_dict(state)
    ingest = ingest or PPOLearner.ingest
    update = update or PPOLearner.update
    named = dict(learner.policy.named_parameters())
    updates: list[Update] = []
    for env_step, transitions in enumerate(stream.steps, start=1):
        for tr in transitions:
            piece = TrajectoryPiece(
                obs=tr["obs"][None],
                actions=tr["action"][None],
                log_probs=tr["log_prob"][None],
                rewards=np.array([tr["reward"]], np.float32),
                terminated=np.array([tr["terminated"]]),
                truncated=np.array([tr["truncated"]]),
                next_obs=tr["next_obs"][None],
                source=tr["agent"],
            )
            assert ingest(learner, piece)
        if not learner.ready():
            continue
        data = learner.buffer.stacked()
        rows = {k: data[k].numpy().copy() for k in ("obs", "actions", "log_probs", "advantages", "returns")}
        step = learner.total_steps
        m = update(learner)
        norms = {k: v.clone() for k, v in learner.policy.state_dict().items() if "_norm." in k}
        updates.append(
            Update(
                env_step,
                rows,
                step,
                {k: m[k] for k in ("learning_rate", "epsilon", "beta")},
                {**{k: p.detach().clone() for k, p in named.items()}, **norms},
                np.zeros(0),
            )
        )
    return updates


# --------------------------------------------------------------------------- comparison


def rel(ours: Any, theirs: Any) -> float:
    a = np.asarray(ours.numpy() if isinstance(ours, torch.Tensor) else ours, np.float64)
    b = np.asarray(theirs.numpy() if isinstance(theirs, torch.Tensor) else theirs, np.float64)
    if a.shape != b.shape:
        return float("inf")
    scale = np.max(np.abs(b)) if b.size else 0.0
    diff = np.max(np.abs(a - b)) if b.size else 0.0
    return float(diff / scale) if scale else (0.0 if diff == 0 else float("inf"))


def differences(ours: list[Update], theirs: list[Update]) -> list[str]:
    """What differs, as readable lines (empty: the same)."""
    out = []
    if [u.env_step for u in ours] != [u.env_step for u in theirs]:
        out.append(
            f"updates at env steps {[u.env_step for u in ours]}, ML-Agents at {[u.env_step for u in theirs]}"
        )
    for k, (a, b) in enumerate(zip(ours, theirs)):
        for name in ("obs", "actions", "log_probs"):
            if a.rows[name].shape != b.rows[name].shape or not np.array_equal(a.rows[name], b.rows[name]):
                out.append(
                    f"update {k + 1}: {name} rows differ ({len(a.rows[name])} vs {len(b.rows[name])} rows)"
                )
        for name in ("advantages", "returns"):
            if not rel(a.rows[name], b.rows[name]) <= RTOL:
                out.append(f"update {k + 1}: {name} differ by {rel(a.rows[name], b.rows[name]):.1e}")
        if a.step != b.step:
            out.append(f"update {k + 1}: step count {a.step}, ML-Agents {b.step}")
        for name, v in b.schedule.items():
            if not rel(a.schedule[name], v) <= RTOL:
                out.append(f"update {k + 1}: {name} {a.schedule[name]:.6g}, ML-Agents {v:.6g}")
        for name, v in b.params.items():
            if not rel(a.params[name], v) <= RTOL:
                out.append(
                    f"update {k + 1}: after the update, {name} differs by {rel(a.params[name], v):.1e}"
                )
    return out


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    with torch.random.fork_rng():
        return run_mlagents(tmp_path_factory.mktemp("mlagents"), our_config().seed)


def test_mlagents_preset_reads_trajectory_handling_mlagents():
    cfg = our_config()
    assert (
        cfg.trajectory_handling == "mlagents"
        and cfg.time_horizon == TIME_HORIZON
        and cfg.buffer_size == BUFFER
    )


def test_the_stream_exercises_what_is_compared(reference):
    """Not vacuous: several updates; trajectories cut at time_horizon mid-episode, off any fixed grid;
    terminated and interrupted ones; buffers holding steps acted on by an earlier policy."""
    updates, stream, _ = reference
    assert len(updates) >= 5
    trajs = stream.trajectories
    assert any(t["len"] == TIME_HORIZON and not t["done"] for t in trajs)
    assert any(t["done"] and not t["interrupted"] for t in trajs) and any(t["interrupted"] for t in trajs)
    # Each agent's trajectories cover its steps in order; a cut at time_horizon that does not end at a
    # multiple of time_horizon of the agent's own step count shows the cut counts from the trajectory start.
    ends = {}
    off_grid = 0
    for t in trajs:
        ends[t["agent"]] = ends.get(t["agent"], 0) + t["len"]
        off_grid += t["len"] == TIME_HORIZON and not t["done"] and ends[t["agent"]] % TIME_HORIZON != 0
    assert off_grid > 0
    straddling = [
        u for u in updates[1:] if (u.versions < len([v for v in updates if v.env_step < u.env_step])).any()
    ]
    assert len(straddling) >= 2, "updates that train on steps acted on before the previous update"
    assert max(len(u.rows["obs"]) for u in updates) > BUFFER + 1  # whole trajectories: the size varies


def test_trajectories_and_updates_match_mlagents(reference):
    updates, stream, initial = reference
    ours = run_ours(stream, initial, our_config())
    diffs = differences(ours, updates)
    assert not diffs, "\n".join(diffs[:20])


def _drop_unfinished_at_update(learner: PPOLearner) -> dict:
    """Planted bug: unfinished trajectories do not survive an update (the old on-policy way)."""
    out = PPOLearner.update(learner)
    learner.trajectories.clear()
    return out


def _count_on_arrival(learner: PPOLearner, piece: TrajectoryPiece) -> bool:
    """Planted bug: steps count for the schedules when they arrive, not when their trajectory is processed."""
    before = learner.total_steps
    ok = PPOLearner.ingest(learner, piece)
    learner.total_steps = before + len(piece.rewards)
    return ok


def _log_probs_of_the_current_policy(learner: PPOLearner, piece: TrajectoryPiece) -> bool:
    """Planted bug: log-probs of the policy at ingest instead of those recorded at action time."""
    with torch.no_grad():
        ev = learner.policy.evaluate(torch.as_tensor(piece.obs), torch.as_tensor(piece.actions))
    return PPOLearner.ingest(learner, piece._replace(log_probs=ev.log_prob.numpy().astype(np.float32)))


PLANTED_BUGS: dict[str, tuple[dict[str, Any], Callable | None, Callable | None, str]] = {
    # name: (our config overrides, our ingest, our update, what must then differ)
    "each piece processed as it arrives (rollout)": (
        {"trajectory_handling": "rollout"},
        None,
        None,
        "obs rows differ",
    ),
    "unfinished trajectories dropped at an update": (
        {},
        None,
        _drop_unfinished_at_update,
        "update 2: obs rows differ",
    ),
    "time_horizon one step longer": (
        {"time_horizon": TIME_HORIZON + 1},
        None,
        None,
        "update 1: obs rows differ",
    ),
    "steps counted on arrival": ({}, _count_on_arrival, None, "update 1: step count"),
    "log-probs recomputed at ingest": ({}, _log_probs_of_the_current_policy, None, "log_probs rows differ"),
}


@pytest.mark.parametrize("bug", sorted(PLANTED_BUGS))
def test_planted_bug_breaks_trajectory_parity(reference, bug):
    updates, stream, initial = reference
    overrides, ingest, update, where = PLANTED_BUGS[bug]
    diffs = differences(run_ours(stream, initial, our_config(**overrides), ingest, update), updates)
    assert diffs, f"planted bug {bug!r} went unnoticed"
    assert any(where in d for d in diffs), diffs[:10]
