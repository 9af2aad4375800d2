"""Whole-update parity of ``PPOLearner`` (``mlagents`` preset) with ML-Agents 0.28's own trainer code.

As ``test_ppo_math`` runs SB3's own ``PPO.train()``, this runs ML-Agents' own ``PPOTrainer``
(``mlagents==0.28.0``, installed by ``scripts/setup.sh``; ``mlagents_shims`` lets it import on
torch 2.x): its ``TorchPolicy`` (actor, normalizers) and ``TorchPPOOptimizer`` (critic, Adam),
built from the same trainer YAML as ours (``configs/Crawler.yaml`` with hidden 32 instead of 512,
batch = buffer = 160 steps and max_steps 320). The behaviour is Crawler-shaped: two vector
observations (126 + 32), 20 continuous actions, 3 hidden layers, normalization on.

Both sides start from the same weights and normalizer statistics (ML-Agents' initialization with
its normalizers warmed up and its zero biases and log-sigmas set to random values, as after some
training; copied into ours) and take the same trajectories: ML-Agents as
``Trajectory`` objects through ``_process_trajectory`` (normalizer update, value estimates, GAE,
``to_agentbuffer``), ours as ``TrajectoryPiece`` from the same arrays through ``ingest``, each
processed as handed over (``trajectory_handling='rollout'``: they are cut already; how ML-Agents
cuts them is ``test_mlagents_trajectories``). Then
``_update_policy`` against ``update``: 3 epochs of one minibatch = the whole buffer. Twice: the
second round's actions are sampled by ML-Agents' policy after the first update, and its update
runs at max_steps, where every schedule sits on its floor. The trajectories end every way
ML-Agents knows (done, interrupted at max step, cut at time_horizon), and each comes from
its own observation distribution, so the normalizer moves between trajectories. In the second
round three of them reach our learner as one piece spanning two episode ends (``JOINED``), as an
actor's unroll can: ML-Agents' per-trajectory normalizer updates must still come out.

Compared, each to 1e-5 relative (max |ours - theirs| over a tensor divided by max |theirs|) in
float32: normalizer statistics, value estimates, advantages and returns after ingest; every
minibatch's policy loss, value loss, entropy, total loss and the gradient of every parameter;
after each update the learning rate, epsilon and beta, every parameter and Adam's moments.

The tests have teeth: ``PLANTED_BUGS`` flips one option of ours (or perturbs the ingest order)
and the same comparison must fail, every CI run.

Discrete actions (``DISCRETE_CASES``): the same trainer, rounds and comparison for a behaviour with
``ActionSpec(0, (3, 2))`` and a hybrid one with ``ActionSpec(2, (3, 2))``. Every step carries an action
mask that blocks about a third of the actions (some branches down to one choice); ML-Agents' policy
samples the actions under those masks, its trajectories carry them as the env protocol does (one array
per branch, True = blocked: ``AgentExperience.action_mask``), ours as ``TrajectoryPiece.action_mask``
(True = allowed, what ML-Agents' buffer stores as ``ACTION_MASK`` and its optimizer hands to
``evaluate_actions``; checked). Log-probs are ML-Agents' flat layout (continuous dims, then the taken
action's per branch); our ``branch_head`` is ML-Agents' branch layers side by side. Also compared: our
``act`` draws the very actions ML-Agents' ``sample_actions`` drew, from the same seed.
``DISCRETE_PLANTED_BUGS`` patch our discrete math (entropy averaged over branches, masks ignored or
inverted) and must break the comparison. Not among them, because this comparison cannot see it:
dropping the ``+ 1e-7`` inside the categorical log (``log_prob_form='exact'``) leaves every difference
at float32 noise (< 2e-6 relative, as without it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator
from unittest import mock

import numpy as np
import pytest
import torch
import yaml

from mlagents_shims import require_mlagents, vector_observation_specs

require_mlagents()

pytestmark = [
    # ML-Agents 0.28's own code on torch 2.x: harmless performance / deprecation notices.
    pytest.mark.filterwarnings("ignore:Creating a tensor from a list of numpy.ndarrays:UserWarning"),
    pytest.mark.filterwarnings("ignore:The use of `x.T` on tensors:UserWarning"),
]

from mlagents.trainers.behavior_id_utils import BehaviorIdentifiers  # noqa: E402
from mlagents.trainers.buffer import AgentBuffer, BufferKey, ObservationKeyPrefix, RewardSignalUtil  # noqa: E402
from mlagents.trainers.policy.torch_policy import TorchPolicy  # noqa: E402
from mlagents.trainers.ppo.trainer import PPOTrainer as MLAgentsPPOTrainer  # noqa: E402
from mlagents.trainers.settings import TrainerSettings  # noqa: E402
from mlagents.trainers.torch.action_log_probs import LogProbsTuple  # noqa: E402
from mlagents.trainers.torch.utils import ModelUtils  # noqa: E402
from mlagents.trainers.trajectory import AgentExperience, Trajectory  # noqa: E402
from mlagents_envs.base_env import ActionSpec, ActionTuple, BehaviorSpec  # noqa: E402

import impala.algos.ppo  # noqa: E402
from impala.run.ppo_config import PPOConfig, from_mlagents_yaml  # noqa: E402
from learner.ppo_learner import PPOLearner, TrajectoryPiece  # noqa: E402

CRAWLER = Path(__file__).resolve().parents[1] / "configs" / "Crawler.yaml"
BEHAVIOR = "Crawler"
OBS_SIZES = (126, 32)  # Crawler's two vector observations
OBS_DIM = sum(OBS_SIZES)
ACTIONS = 20
HIDDEN = 32  # Crawler: 512; the layout (3 layers, Swish, separate critic) is Crawler's
N_STEPS = 160  # per update; batch_size = buffer_size = N_STEPS: one minibatch = the whole buffer
# Trajectories per update: (length, how it ends). 'done': terminated; 'interrupted': done at max
# step (bootstrap); 'cut': time_horizon reached mid-episode (bootstrap).
ROUNDS = (
    ((40, "done"), (25, "interrupted"), (60, "cut"), (35, "done")),
    ((30, "cut"), (50, "done"), (45, "interrupted"), (35, "done")),
)
# Our side gets these trajectories of a round as ONE TrajectoryPiece (an actor's unroll that spans
# episode ends): ML-Agents' per-trajectory normalizer updates must still be reproduced.
JOINED = {1: (1, 2, 3)}
MAX_STEPS = N_STEPS * len(ROUNDS)  # the second update runs at max_steps: lr, epsilon, beta on their floors
# The trajectories here come already cut (as ML-Agents' AgentProcessor emits them), so our learner
# processes each piece as it is handed over; the cutting itself (trajectory_handling='mlagents', whose
# AgentTrajectories would wait for a 'cut' trajectory to reach time_horizon) is compared with ML-Agents'
# AgentProcessor in test_mlagents_trajectories.
HANDED_OVER = {"trajectory_handling": "rollout"}
RTOL = 1e-5

# Our update() metric -> the decayed value ML-Agents' optimizer reports per minibatch ("Policy/<name>").
SCHEDULE_STATS = {"learning_rate": "Learning Rate", "epsilon": "Epsilon", "beta": "Beta"}


@dataclasses.dataclass(frozen=True)
class Case:
    """The behaviour's actions: ``continuous`` dimensions and/or discrete ``branches`` (ML-Agents'
    ``ActionSpec(continuous, branches)``). Discrete behaviours carry action masks on every step."""

    name: str
    continuous: int
    branches: tuple[int, ...] = ()


CONTINUOUS = Case("continuous", ACTIONS)  # Crawler's
# Discrete: two branches, masks blocking some actions; hybrid: the same branches next to 2 continuous dims.
DISCRETE_CASES = {c.name: c for c in (Case("discrete", 0, (3, 2)), Case("hybrid", 2, (3, 2)))}
CASES = {CONTINUOUS.name: CONTINUOUS, **DISCRETE_CASES}


def params(case: Case) -> dict[str, tuple[str, list[str]]]:
    """Our parameter -> (ML-Agents module, its parameters). log_sigma is [1, A] there, [A] here; our
    ``branch_head`` is ML-Agents' branch layers side by side (their rows concatenated)."""
    out = {
        **{
            f"{body}_body.{i}.{p}": (body, [f"network_body._body_endoder.seq_layers.{i}.{p}"])
            for body in ("actor", "critic")
            for i in (0, 2, 4)
            for p in ("weight", "bias")
        },
        "value_head.weight": ("critic", ["value_heads.value_heads.extrinsic.weight"]),
        "value_head.bias": ("critic", ["value_heads.value_heads.extrinsic.bias"]),
    }
    if case.continuous:
        out["mu_head.weight"] = ("actor", ["action_model._continuous_distribution.mu.weight"])
        out["mu_head.bias"] = ("actor", ["action_model._continuous_distribution.mu.bias"])
        out["log_sigma"] = ("actor", ["action_model._continuous_distribution.log_sigma"])
    for p in ("weight", "bias") if case.branches else ():
        out[f"branch_head.{p}"] = (
            "actor",
            [f"action_model._discrete_distribution.branches.{i}.{p}" for i in range(len(case.branches))],
        )
    return out


# --------------------------------------------------------------------------- settings


def trainer_doc() -> dict:
    """configs/Crawler.yaml, shrunk: the one trainer config both sides read."""
    doc = yaml.safe_load(CRAWLER.read_text())
    b = doc["behaviors"][BEHAVIOR]
    b["hyperparameters"].update(batch_size=N_STEPS, buffer_size=N_STEPS)
    b["network_settings"]["hidden_units"] = HIDDEN
    b["max_steps"] = MAX_STEPS
    return doc


def our_config(**overrides: Any) -> PPOConfig:
    """The same YAML through our reader, ``mlagents`` semantics (the preset's options)."""
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # ML-Agents keys we do not use (summary_freq, ...)
        path = Path(tmp) / "crawler.yaml"
        path.write_text(yaml.safe_dump(trainer_doc()))
        return from_mlagents_yaml(str(path), **overrides)


def behavior_spec(case: Case) -> BehaviorSpec:
    return BehaviorSpec(vector_observation_specs(OBS_SIZES), ActionSpec(case.continuous, case.branches))


# --------------------------------------------------------------------------- data


@dataclasses.dataclass
class TrajectoryArrays:
    obs: np.ndarray  # [T + 1, OBS_DIM]: T observations, then the one after the last step
    actions: np.ndarray  # [T, A] raw samples
    log_probs: np.ndarray  # [T, A + nb] per dimension, then per branch (the taken action's), at action time
    rewards: np.ndarray  # [T]
    end: str  # 'done' | 'interrupted' | 'cut'
    agent: str
    branches: tuple[int, ...] = ()
    discrete: np.ndarray | None = None  # [T, nb] int64 taken actions, one per branch
    allowed: np.ndarray | None = None  # [T, sum(branches)] bool action masks, True = allowed

    def split(self, row: int) -> list[np.ndarray]:
        return list(np.split(self.obs[row], np.cumsum(OBS_SIZES)[:-1]))

    def to_mlagents(self) -> Trajectory:
        T, A, nb = len(self.rewards), self.actions.shape[1], len(self.branches)
        discrete = np.zeros((T, 0), np.int32) if self.discrete is None else self.discrete.astype(np.int32)
        steps = []
        for t in range(T):
            last = t == T - 1
            # The env protocol's mask (DecisionStep.action_mask): one array per branch, True = blocked.
            blocked = (
                None if self.allowed is None else np.split(~self.allowed[t], np.cumsum(self.branches)[:-1])
            )
            steps.append(
                AgentExperience(
                    obs=self.split(t),
                    reward=float(self.rewards[t]),
                    done=last and self.end in ("done", "interrupted"),
                    action=ActionTuple(continuous=self.actions[t], discrete=discrete[t]),
                    action_probs=LogProbsTuple(
                        continuous=self.log_probs[t, :A], discrete=self.log_probs[t, A:]
                    ),
                    action_mask=blocked,
                    prev_action=discrete[t - 1] if t else np.zeros(nb, np.int32),
                    interrupted=last and self.end == "interrupted",
                    memory=None,
                    group_status=[],
                    group_reward=0.0,
                )
            )
        return Trajectory(
            steps=steps,
            next_obs=self.split(T),
            next_group_obs=[],
            agent_id=self.agent,
            behavior_id=f"{BEHAVIOR}?team=0",
        )

    def to_piece(self) -> TrajectoryPiece:
        T = len(self.rewards)
        terminated = np.zeros(T, bool)
        truncated = np.zeros(T, bool)
        terminated[-1] = self.end == "done"
        truncated[-1] = self.end == "interrupted"
        return TrajectoryPiece(
            obs=self.obs[:T],
            actions=self.actions,
            log_probs=self.log_probs,
            rewards=self.rewards,
            terminated=terminated,
            truncated=truncated,
            next_obs=self.obs[1:],
            source=self.agent,
            discrete_actions=self.discrete,
            action_mask=self.allowed,
        )


def random_masks(rng: np.random.Generator, T: int, branches: tuple[int, ...]) -> np.ndarray:
    """[T, sum(branches)] bool, True = allowed: each action blocked with probability 0.4, at least one
    allowed per branch (a branch of two then often has one choice: probability 1, entropy 0)."""
    allowed = rng.random((T, sum(branches))) > 0.4
    for lo, n in zip(np.cumsum((0,) + branches[:-1]), branches):
        none = ~allowed[:, lo : lo + n].any(1)
        allowed[np.flatnonzero(none), lo + rng.integers(0, n, none.sum())] = True
    return allowed


def sample_round(policy: TorchPolicy, k: int, case: Case) -> list[TrajectoryArrays]:
    """One round of trajectories; actions sampled by ML-Agents' policy as it stands (at action time),
    under the steps' action masks (``TorchPolicy`` takes them as its ``_extract_masks`` makes them:
    1 = allowed)."""
    rng = np.random.default_rng(100 + k)
    mask_rng = np.random.default_rng(200 + k)
    scale = rng.uniform(0.2, 3.0, OBS_DIM)
    out = []
    for j, (T, end) in enumerate(ROUNDS[k]):
        # Each trajectory has its own offset: the normalizer moves from one trajectory to the next.
        offset = rng.normal(0.0, 1.5, OBS_DIM) + 2.0 * j
        obs = (offset + scale * rng.normal(size=(T + 1, OBS_DIM))).astype(np.float32)
        parts = [torch.as_tensor(p) for p in np.split(obs[:T], np.cumsum(OBS_SIZES)[:-1], axis=1)]
        allowed = random_masks(mask_rng, T, case.branches) if case.branches else None
        masks = None if allowed is None else torch.as_tensor(allowed, dtype=torch.float32)
        torch.manual_seed(1000 * k + j)
        with torch.no_grad():
            action, log_probs, _, _ = policy.sample_actions(parts, masks=masks)
        rewards = rng.normal(0.1, 1.0, T).astype(np.float32)
        out.append(
            TrajectoryArrays(
                obs,
                action.continuous_tensor.numpy().copy() if case.continuous else np.zeros((T, 0), np.float32),
                log_probs.flatten().numpy().copy(),
                rewards,
                end,
                f"agent-{k}-{j}",
                case.branches,
                # as the trajectory stores it (TorchPolicy.evaluate's run_out['action'])
                action.to_action_tuple().discrete.astype(np.int64) if case.branches else None,
                allowed,
            )
        )
    return out


# --------------------------------------------------------------------------- recording


class MinibatchLog:
    """Per minibatch: loss components, the total loss backpropagated, every parameter's gradient."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []
        self._pending: dict[str, float] = {}

    def note(self, **values: float) -> None:
        self._pending.update(values)

    @contextlib.contextmanager
    def backward_hook(self) -> Iterator[None]:
        """Record the loss each ``backward()`` starts from: the total loss really optimized."""
        original = torch.Tensor.backward
        log = self

        def backward(tensor, *args, **kwargs):
            log.rows.append({**log._pending, "loss": float(tensor.detach())})
            log._pending = {}
            return original(tensor, *args, **kwargs)

        with mock.patch.object(torch.Tensor, "backward", backward):
            yield

    @contextlib.contextmanager
    def step_hook(
        self, optimizer: torch.optim.Optimizer, named: Callable[[], dict[str, torch.Tensor]]
    ) -> Iterator[None]:
        original = optimizer.step
        log = self

        def step(*args, **kwargs):
            log.rows[-1]["grads"] = {k: g.clone() for k, g in named().items()}
            return original(*args, **kwargs)

        with mock.patch.object(optimizer, "step", step):
            yield


@dataclasses.dataclass
class Record:
    """What one side did, per round: ingest results, every minibatch, the state after the update."""

    ingest: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    minibatches: list[list[dict[str, Any]]] = dataclasses.field(default_factory=list)
    after: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def permutations(seed: int, epochs: int) -> list[np.ndarray]:
    """The shuffles our learner draws: ``np.random.default_rng(seed).permutation(n)`` per epoch."""
    g = np.random.default_rng(seed)
    return [g.permutation(N_STEPS) for _ in range(len(ROUNDS) * epochs)]


def shuffle_as(buffer: AgentBuffer, perms: list[np.ndarray]) -> None:
    """Make ML-Agents' ``update_buffer.shuffle`` give our learner's sample order.

    ML-Agents reshuffles its buffer in place each epoch; we index the unshuffled buffer with a
    fresh permutation. The same order gives the same float32 summation order; with one minibatch =
    the whole buffer it changes nothing else."""
    order = np.arange(N_STEPS)  # position -> index in the unshuffled buffer

    def shuffle(sequence_length: int, key_list=None) -> None:
        nonlocal order
        want = perms.pop(0)
        s = np.argsort(order)[want]
        for key in list(buffer.keys()):
            field = buffer[key]
            field.set([field[i] for i in s])
        order = want

    buffer.shuffle = shuffle


# --------------------------------------------------------------------------- ML-Agents' side


def mlagents_named(
    trainer: MLAgentsPPOTrainer, case: Case, read: Callable[[torch.nn.Parameter], torch.Tensor | None]
) -> dict[str, torch.Tensor | None]:
    """``read(parameter)`` for every parameter, under our names and shapes."""
    theirs = {
        "actor": dict(trainer.policy.actor.named_parameters()),
        "critic": dict(trainer.optimizer.critic.named_parameters()),
    }
    out: dict[str, torch.Tensor | None] = {}
    for ours, (side, names) in params(case).items():
        ts = [read(theirs[side][name]) for name in names]
        if any(t is None for t in ts):
            out[ours] = None
            continue
        t = torch.cat([t.detach() for t in ts])
        out[ours] = t.reshape(-1) if ours == "log_sigma" else t
    return out


def mlagents_normalizers(trainer: MLAgentsPPOTrainer) -> dict[str, np.ndarray]:
    """Actor and critic normalizers, each obs's processor concatenated, under our buffer names."""
    out = {}
    for side, net in (("actor", trainer.policy.actor), ("critic", trainer.optimizer.critic)):
        norms = [p.normalizer for p in net.network_body.processors]
        assert len({int(n.normalization_steps) for n in norms}) == 1
        out[f"{side}_norm.steps"] = np.array(float(norms[0].normalization_steps))
        out[f"{side}_norm.mean"] = torch.cat([n.running_mean for n in norms]).numpy().copy()
        out[f"{side}_norm.m2"] = torch.cat([n.running_variance for n in norms]).numpy().copy()
    return out


def build_mlagents(tmp: Path, case: Case) -> MLAgentsPPOTrainer:
    settings = TrainerSettings.structure(trainer_doc()["behaviors"][BEHAVIOR], TrainerSettings)
    settings.checkpoint_interval = 10**12  # never write a checkpoint
    trainer = MLAgentsPPOTrainer(BEHAVIOR, 100, settings, True, False, 0, str(tmp))
    behavior_id = BehaviorIdentifiers.from_name_behavior_id(f"{BEHAVIOR}?team=0")
    trainer.add_policy(behavior_id, trainer.create_policy(behavior_id, behavior_spec(case)))
    # Warm the normalizers up, so that the statistics we copy are not a fresh normalizer's.
    rng = np.random.default_rng(7)
    warm = AgentBuffer()
    for row in rng.normal(0.3, 2.0, (64, OBS_DIM)).astype(np.float32):
        for i, part in enumerate(np.split(row, np.cumsum(OBS_SIZES)[:-1])):
            warm[(ObservationKeyPrefix.OBSERVATION, i)].append(part)
    trainer.policy.update_normalization(warm)
    trainer.optimizer.critic.update_normalization(warm)
    # And start from a trained-looking state: ML-Agents initializes biases and log_sigma to 0, where
    # sigma = 1 hides formula slips and Adam's first steps are all +-lr.
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in [
            *trainer.policy.actor.named_parameters(),
            *trainer.optimizer.critic.named_parameters(),
        ]:
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("log_sigma"):
                p.copy_(-0.5 + 0.2 * torch.randn(p.shape, generator=g))
    return trainer


@dataclasses.dataclass
class Reference:
    case: Case
    initial_params: dict[str, torch.Tensor]
    initial_norms: dict[str, np.ndarray]
    rounds: list[list[TrajectoryArrays]]
    record: Record
    epochs: int
    clip_binds: float  # round 1: share of samples whose |V - V_old| exceeds epsilon when the update starts


def run_mlagents(tmp: Path, seed: int, epochs: int, case: Case) -> Reference:
    """ML-Agents' PPOTrainer through both rounds: _process_trajectory, then _update_policy."""
    trainer = build_mlagents(tmp, case)
    opt = trainer.optimizer
    initial_params = {k: v.clone() for k, v in mlagents_named(trainer, case, lambda p: p).items()}
    initial_norms = mlagents_normalizers(trainer)
    perms = permutations(seed, epochs)
    rec, rounds, clip_binds = Record(), [], float("nan")
    for k in range(len(ROUNDS)):
        data = sample_round(trainer.policy, k, case)
        rounds.append(data)
        values: list[np.ndarray] = []
        estimate = opt.get_trajectory_value_estimates

        def get_estimates(*args, **kwargs):
            v, v_next, mem = estimate(*args, **kwargs)
            values.append(np.asarray(v["extrinsic"]).copy())
            return v, v_next, mem

        with mock.patch.object(opt, "get_trajectory_value_estimates", get_estimates):
            for traj in data:
                trainer._process_trajectory(traj.to_mlagents())
        buf = trainer.update_buffer
        assert buf.num_experiences == N_STEPS
        if case.branches:
            # What the trainer's buffer stores as the action mask (and its optimizer hands to
            # evaluate_actions): 1 - the env's mask, i.e. 1 = allowed, as our TrajectoryPiece.action_mask.
            stored = np.asarray(buf[BufferKey.ACTION_MASK].get_batch())
            np.testing.assert_array_equal(
                stored, np.concatenate([t.allowed for t in data]).astype(stored.dtype)
            )
        rec.ingest.append(
            {
                **mlagents_normalizers(trainer),
                "values": np.concatenate(values),
                "advantages": np.asarray(buf[BufferKey.ADVANTAGES].get_batch()),
                "returns": np.asarray(buf[RewardSignalUtil.returns_key("extrinsic")].get_batch()),
            }
        )
        # #6281, read from the installed code: the buffer field the optimizer reads as the old value
        # estimates is the returns field, so it holds the returns, not the values GAE used.
        assert RewardSignalUtil.value_estimates_key("extrinsic") == RewardSignalUtil.returns_key("extrinsic")
        old_values = np.asarray(buf[RewardSignalUtil.value_estimates_key("extrinsic")].get_batch())
        np.testing.assert_array_equal(
            old_values, np.asarray(buf[RewardSignalUtil.returns_key("extrinsic")].get_batch())
        )
        assert not np.allclose(old_values, rec.ingest[-1]["values"], atol=0.1)
        if k == 0:
            # The intended clip (around V_old) only differs from what runs where |V - V_old| > eps.
            with torch.no_grad():
                obs = torch.as_tensor(np.concatenate([t.obs[:-1] for t in data]))
                v_now = opt.critic.critic_pass(list(torch.split(obs, OBS_SIZES, dim=1)))[0][
                    "extrinsic"
                ].numpy()
            eps = opt.decay_epsilon.get_value(trainer.policy.get_current_step())
            clip_binds = float(np.mean(np.abs(v_now - rec.ingest[0]["values"]) > eps))

        log, stats = MinibatchLog(), []
        update = opt.update
        value_loss, policy_loss = ModelUtils.trust_region_value_loss, ModelUtils.trust_region_policy_loss
        evaluate_actions = TorchPolicy.evaluate_actions

        def opt_update(*args, **kwargs):
            stats.append(update(*args, **kwargs))
            return stats[-1]

        def vl(*args, **kwargs):
            out = value_loss(*args, **kwargs)
            log.note(value_loss=float(out.detach()))
            return out

        def pl(*args, **kwargs):
            out = policy_loss(*args, **kwargs)
            log.note(policy_loss=float(out.detach()))
            return out

        def ev(self, *args, **kwargs):
            log_probs, entropy = evaluate_actions(self, *args, **kwargs)
            log.note(entropy=float(entropy.detach().mean()))  # masked_mean with every mask on
            return log_probs, entropy

        shuffle_as(buf, perms)
        with (
            log.backward_hook(),
            log.step_hook(opt.optimizer, lambda: mlagents_named(trainer, case, lambda p: p.grad)),
            mock.patch.object(opt, "update", opt_update),
            mock.patch.object(ModelUtils, "trust_region_value_loss", staticmethod(vl)),
            mock.patch.object(ModelUtils, "trust_region_policy_loss", staticmethod(pl)),
            mock.patch.object(TorchPolicy, "evaluate_actions", ev),
        ):
            assert trainer._update_policy()
        assert len(log.rows) == epochs, "one minibatch per epoch"
        rec.minibatches.append(log.rows)
        rec.after.append(
            {
                "params": {n: v.clone() for n, v in mlagents_named(trainer, case, lambda p: p).items()},
                "exp_avg": mlagents_named(trainer, case, lambda p: opt.optimizer.state[p]["exp_avg"].clone()),
                "exp_avg_sq": mlagents_named(
                    trainer, case, lambda p: opt.optimizer.state[p]["exp_avg_sq"].clone()
                ),
                "adam_lr": float(opt.optimizer.param_groups[0]["lr"]),
                "adam_eps": float(opt.optimizer.param_groups[0]["eps"]),
                **{
                    key: np.array([s[f"Policy/{stat}"] for s in stats])
                    for key, stat in SCHEDULE_STATS.items()
                },
            }
        )
    return Reference(case, initial_params, initial_norms, rounds, rec, epochs, clip_binds)


# --------------------------------------------------------------------------- our side


def pieces(data: list[TrajectoryArrays], joined: tuple[int, ...]) -> list[TrajectoryPiece]:
    """One piece per trajectory, except the ``joined`` ones: consecutive, concatenated into one."""
    out: list[TrajectoryPiece] = []
    for j, traj in enumerate(data):
        piece = traj.to_piece()
        if j in joined and j - 1 in joined:
            prev = out.pop()
            piece = TrajectoryPiece(
                *(np.concatenate([a, b]) for a, b in zip(prev[:7], piece[:7])),
                None,
                prev.source,
                *(None if a is None else np.concatenate([a, b]) for a, b in zip(prev[9:], piece[9:])),
            )
        out.append(piece)
    return out


def whole_piece_normalizer_ingest(learner: PPOLearner, piece: TrajectoryPiece) -> bool:
    """Planted bug: fold the whole piece into the normalizers before any values (not per trajectory)."""
    learner.policy.update_normalizer(torch.as_tensor(np.asarray(piece.obs, np.float32)))
    with mock.patch.object(learner.policy, "update_normalizer", lambda obs: None):
        return learner.ingest(piece)


def late_normalizer_ingest(learner: PPOLearner, piece: TrajectoryPiece) -> bool:
    """Planted bug: fold the trajectory into the normalizers *after* its values were computed."""
    with mock.patch.object(learner.policy, "update_normalizer", lambda obs: None):
        ok = learner.ingest(piece)
    learner.policy.update_normalizer(torch.as_tensor(np.asarray(piece.obs, np.float32)))
    return ok


def our_learner(ref: Reference, config: PPOConfig) -> PPOLearner:
    """Our PPOLearner with ML-Agents' initial weights and normalizers."""
    case = ref.case
    learner = PPOLearner(
        config, OBS_DIM, case.continuous, branches=case.branches, action_mask=bool(case.branches)
    )
    state = learner.policy.state_dict()
    state.update({k: v.clone().reshape(state[k].shape) for k, v in ref.initial_params.items()})
    state.update({k: torch.as_tensor(v).reshape(state[k].shape) for k, v in ref.initial_norms.items()})
    learner.policy.load_state_dict(state)
    return learner


def run_ours(
    ref: Reference, config: PPOConfig, ingest: Callable[[PPOLearner, TrajectoryPiece], bool] | None = None
) -> Record:
    """Our PPOLearner, from ML-Agents' initial weights and normalizers, through the same rounds."""
    learner = our_learner(ref, config)
    ingest = ingest or PPOLearner.ingest
    named = dict(learner.policy.named_parameters())
    rec = Record()
    for k, data in enumerate(ref.rounds):
        for piece in pieces(data, JOINED.get(k, ())):
            assert ingest(learner, piece)
        stacked = learner.buffer.stacked()
        norms = {k: v.numpy().copy() for k, v in learner.policy.state_dict().items() if "_norm." in k}
        rec.ingest.append(
            {**norms, **{k: stacked[k].numpy().copy() for k in ("values", "advantages", "returns")}}
        )

        log = MinibatchLog()
        total_loss = impala.algos.ppo.total_loss_mlagents

        def total(policy_loss, value_loss, entropy, **kwargs):
            log.note(
                policy_loss=float(policy_loss.detach()),
                value_loss=float(value_loss.detach()),
                entropy=float(entropy.detach()),
            )
            return total_loss(policy_loss, value_loss, entropy, **kwargs)

        with (
            log.backward_hook(),
            log.step_hook(learner.optimizer, lambda: {k: p.grad for k, p in named.items()}),
            mock.patch.object(impala.algos.ppo, "total_loss_mlagents", total),
        ):
            metrics = learner.update()
        rec.minibatches.append(log.rows)
        opt = learner.optimizer
        rec.after.append(
            {
                "params": {k: p.detach().clone() for k, p in named.items()},
                "exp_avg": {k: opt.state[p]["exp_avg"].clone() for k, p in named.items()},
                "exp_avg_sq": {k: opt.state[p]["exp_avg_sq"].clone() for k, p in named.items()},
                "adam_lr": float(opt.param_groups[0]["lr"]),
                "adam_eps": float(opt.param_groups[0]["eps"]),
                **{key: np.full(len(log.rows), metrics[key]) for key in SCHEDULE_STATS},
            }
        )
    return rec


# --------------------------------------------------------------------------- comparison


def rel_diff(ours: Any, theirs: Any, floor: float = 0.0) -> float:
    """max |ours - theirs| / max(max |theirs|, floor) over the tensor (a scalar: relative difference).

    ``floor``: the size of the terms a scalar was averaged from, where they cancel (the policy loss
    is a mean of ``r * A`` with normalized advantages of std 1, and itself near 0)."""
    a = np.asarray(ours.numpy() if isinstance(ours, torch.Tensor) else ours, np.float64)
    b = np.asarray(theirs.numpy() if isinstance(theirs, torch.Tensor) else theirs, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(np.max(np.abs(b)), floor) if b.size else 0.0
    diff = np.max(np.abs(a - b)) if b.size else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return float(diff / scale)


def compare(ours: Record, theirs: Record) -> dict[str, float]:
    """Every compared quantity -> its relative difference, named ``round/what[/minibatch]/name``."""
    out: dict[str, float] = {}
    for k in range(len(ROUNDS)):
        for name, v in theirs.ingest[k].items():
            out[f"r{k + 1}/ingest/{name}"] = rel_diff(ours.ingest[k][name], v)
        assert len(ours.minibatches[k]) == len(theirs.minibatches[k])
        for m, (mine, ref) in enumerate(zip(ours.minibatches[k], theirs.minibatches[k])):
            for name in ("policy_loss", "value_loss", "entropy", "loss"):
                floor = 1.0 if name == "policy_loss" else 0.0
                out[f"r{k + 1}/mb{m + 1}/{name}"] = rel_diff(mine[name], ref[name], floor)
            for name, g in ref["grads"].items():
                out[f"r{k + 1}/mb{m + 1}/grad/{name}"] = rel_diff(mine["grads"][name], g)
        a, b = ours.after[k], theirs.after[k]
        for what in ("params", "exp_avg", "exp_avg_sq"):
            for name, v in b[what].items():
                out[f"r{k + 1}/after/{what}/{name}"] = rel_diff(a[what][name], v)
        for what in ("adam_lr", "adam_eps", *SCHEDULE_STATS):
            out[f"r{k + 1}/after/{what}"] = rel_diff(a[what], b[what])
    return out


def failures(diffs: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in diffs.items() if not v <= RTOL}


# --------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def references(tmp_path_factory) -> Callable[[str], Reference]:
    """ML-Agents' run of a case (``CASES``), made the first time a test asks for it."""
    made: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in made:
            config = our_config()
            with torch.random.fork_rng():
                torch.manual_seed(0)
                made[name] = run_mlagents(
                    tmp_path_factory.mktemp(f"mlagents-{name}"), config.seed, config.num_epoch, CASES[name]
                )
        return made[name]

    return get


@pytest.fixture(scope="module")
def reference(references) -> Reference:
    return references(CONTINUOUS.name)


def test_our_yaml_reading_is_the_mlagents_preset_with_the_files_values():
    cfg = our_config()
    preset = PPOConfig.preset("mlagents")
    for f in dataclasses.fields(PPOConfig):
        if f.name not in (
            "batch_size",
            "buffer_size",
            "learning_rate",
            "beta",
            "epsilon",
            "lambd",
            "num_epoch",
            "hidden_units",
            "num_layers",
            "gamma",
            "max_steps",
            "time_horizon",
        ):
            assert getattr(cfg, f.name) == getattr(preset, f.name), f.name
    assert (cfg.batch_size, cfg.buffer_size, cfg.hidden_units, cfg.num_layers, cfg.gamma, cfg.max_steps) == (
        N_STEPS,
        N_STEPS,
        HIDDEN,
        3,
        0.995,
        MAX_STEPS,
    )
    assert cfg.value_loss == "mlagents"


def test_two_updates_match_mlagents_trainer(reference):
    """Ingest and two full updates of the mlagents preset equal ML-Agents' PPOTrainer to 1e-5."""
    diffs = compare(run_ours(reference, our_config(**HANDED_OVER)), reference.record)
    worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    print("largest relative differences:", ", ".join(f"{k} {v:.1e}" for k, v in worst))
    assert not failures(diffs), failures(diffs)
    # The comparison is not vacuous: both updates moved the weights, and the second ran on the floors.
    assert (
        rel_diff(
            reference.record.after[0]["params"]["critic_body.0.weight"],
            reference.initial_params["critic_body.0.weight"],
        )
        > 1e-4
    )
    after = reference.record.after[1]
    assert (after["learning_rate"][0], after["epsilon"][0], after["beta"][0]) == pytest.approx(
        (1e-10, 0.1, 1e-5)
    )
    assert len(reference.record.minibatches[0]) == 3
    joined = pieces(reference.rounds[1], JOINED[1])
    assert len(joined) == 2 and joined[1].terminated.sum() == 2 and joined[1].truncated.sum() == 1


PLANTED_BUGS: dict[str, tuple[dict[str, Any], Callable | None, str]] = {
    # name: (our config overrides, our ingest, a quantity that must then differ)
    "value loss clipped around the old values": (
        {"value_loss": "mlagents_intended"},
        None,
        "grad/value_head.weight",
    ),
    "advantages normalized per minibatch": ({"advantage_norm": "minibatch"}, None, "grad/mu_head"),
    "entropy summed over action dims": ({"entropy_reduce": "sum"}, None, "entropy"),
    "normalizer updated after its values": ({}, late_normalizer_ingest, "ingest/values"),
    "normalizer updated per piece, not per trajectory": (
        {},
        whole_piece_normalizer_ingest,
        "r2/ingest/values",
    ),
    "GAE lambda 0.9": ({"lambd": 0.9}, None, "ingest/advantages"),
    "Adam eps 1e-5": ({"adam_eps": 1e-5}, None, "after/params"),
    "lr floor 0": ({"lr_floor": 0.0}, None, "after/adam_lr"),
}


@pytest.mark.parametrize("bug", sorted(PLANTED_BUGS))
def test_planted_bug_breaks_parity(reference, bug):
    """Each deliberately planted bug must make the same comparison fail, where the bug lives."""
    overrides, ingest, where = PLANTED_BUGS[bug]
    if "value loss" in bug:
        assert reference.clip_binds > 0.1, "the data must make the intended value clip bind"
    failed = failures(
        compare(run_ours(reference, our_config(**HANDED_OVER, **overrides), ingest), reference.record)
    )
    assert failed, f"planted bug {bug!r} went unnoticed"
    assert any(where in k for k in failed), sorted(failed)[:10]


def test_normalizer_counts_past_2_24_like_mlagents():
    """ML-Agents counts normalizer steps in int64; a float32 count is exact only to 2^24 (a Crawler run of
    10M steps per normalizer gets close, several runs' worth passes it): ours must count and divide as it
    does."""
    from mlagents.trainers.torch.encoders import Normalizer

    from impala.algos.normalizers import MLAgentsNormalizer

    D, start = 7, 2**24 + 3
    rng = np.random.default_rng(11)
    theirs, ours = Normalizer(D), MLAgentsNormalizer(D)
    mean = rng.normal(size=D).astype(np.float32)
    m2 = rng.uniform(1.0, 2.0, D).astype(np.float32) * start
    with torch.no_grad():
        theirs.normalization_steps = torch.tensor(start)
        theirs.running_mean = torch.as_tensor(mean.copy())
        theirs.running_variance = torch.as_tensor(m2.copy())
        ours.steps.fill_(start)
        ours.mean.copy_(torch.as_tensor(mean))
        ours.m2.copy_(torch.as_tensor(m2))
    for n in (1, 1, 1, 5, 1):  # single steps are what a float32 count loses past 2^24
        x = torch.as_tensor(rng.normal(2.0, 3.0, (n, D)).astype(np.float32))
        theirs.update(x)
        ours.update(x)
    assert int(ours.steps) == int(theirs.normalization_steps) == start + 9
    assert np.float32(start) + np.float32(1) == np.float32(start)  # why a float32 count would not do
    np.testing.assert_array_equal(ours.mean.numpy(), theirs.running_mean.numpy())
    np.testing.assert_array_equal(ours.m2.numpy(), theirs.running_variance.numpy())
    x = torch.as_tensor(rng.normal(0.0, 2.0, (5, D)).astype(np.float32))
    np.testing.assert_array_equal(ours(x).numpy(), theirs(x).numpy())


# --------------------------------------------------------------------------- discrete branches, masks


@pytest.mark.parametrize("name", sorted(DISCRETE_CASES))
def test_discrete_updates_match_mlagents_trainer(references, name):
    """The same comparison for discrete branches (3, 2) under action masks, alone and next to 2 continuous
    dimensions: ingest and two updates equal ML-Agents' PPOTrainer to 1e-5."""
    ref = references(name)
    diffs = compare(run_ours(ref, our_config(**HANDED_OVER)), ref.record)
    worst = sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    print(f"{name}: largest relative differences:", ", ".join(f"{k} {v:.1e}" for k, v in worst))
    assert not failures(diffs), failures(diffs)
    # Not vacuous: the masks block actions (a third of them; some branches down to one choice), ML-Agents'
    # policy sampled only allowed ones and spread over them, and the first update moved the branch layers
    # (the second runs at the learning-rate floor, 1e-10: its gradients and Adam moments are compared).
    steps = [t for data in ref.rounds for t in data]
    allowed = np.concatenate([t.allowed for t in steps])
    taken = np.concatenate([t.discrete for t in steps])
    assert 0.25 < 1 - allowed.mean() < 0.5
    lo = np.cumsum((0,) + ref.case.branches[:-1])
    assert allowed[np.arange(len(taken))[:, None], lo + taken].all()
    assert (allowed[:, lo[1] :].sum(1) == 1).mean() > 0.2  # branch 2: one allowed action, entropy 0
    for b, n in enumerate(ref.case.branches):
        assert np.bincount(taken[:, b], minlength=n).min() > 10
    after = ref.record.after[0]["params"]["branch_head.weight"]
    assert rel_diff(after, ref.initial_params["branch_head.weight"]) > 1e-4


@pytest.mark.parametrize("name", sorted(CASES))
def test_sampling_matches_mlagents_policy(references, name):
    """Our policy's ``act`` draws what ML-Agents' ``TorchPolicy.sample_actions`` drew for the first round
    (same weights and normalizers, same torch seed, same masks): the same random stream (continuous noise,
    then one ``multinomial`` per branch), so the same discrete actions, the same continuous samples and the
    same log-probabilities at action time, to 1e-5."""
    ref = references(name)
    policy = our_learner(ref, our_config()).policy
    for j, traj in enumerate(ref.rounds[0]):
        T = len(traj.rewards)
        mask = None if traj.allowed is None else torch.as_tensor(traj.allowed)
        torch.manual_seed(j)  # sample_round's seed for round 1, trajectory j
        out = policy.act(torch.as_tensor(traj.obs[:T]), action_mask=mask)
        assert rel_diff(out.action, traj.actions) <= RTOL
        assert rel_diff(out.log_prob, traj.log_probs) <= RTOL
        if ref.case.branches:
            np.testing.assert_array_equal(out.discrete_action.numpy(), traj.discrete)


def branch_mean_entropy() -> contextlib.AbstractContextManager:
    """Planted bug: the branches' entropies averaged (as ML-Agents averages continuous dims), not summed."""
    reduce = impala.algos.ppo.reduce_hybrid_entropy

    def mean_over_branches(continuous, discrete, *, over_dims):
        return reduce(continuous, discrete.mean(-1, keepdim=True), over_dims=over_dims)

    return mock.patch.object(impala.algos.ppo, "reduce_hybrid_entropy", mean_over_branches)


def masks_ignored() -> contextlib.AbstractContextManager:
    """Planted bug: the update evaluates the taken actions without their masks."""
    return mock.patch.object(impala.algos.ppo, "mask_logits", lambda logits, allowed: logits)


def masks_inverted() -> contextlib.AbstractContextManager:
    """Planted bug: the stored masks read with the env protocol's convention (True = blocked)."""
    mask_logits = impala.algos.ppo.mask_logits
    return mock.patch.object(
        impala.algos.ppo,
        "mask_logits",
        lambda logits, allowed: mask_logits(logits, None if allowed is None else ~allowed),
    )


DISCRETE_PLANTED_BUGS: dict[
    str, tuple[dict[str, Any], Callable[[], contextlib.AbstractContextManager] | None, str, tuple[str, ...]]
] = {
    # name: (our config overrides, a patch of our code, a quantity that must then differ, the cases)
    "entropy averaged over branches": ({}, branch_mean_entropy, "entropy", ("discrete", "hybrid")),
    "action masks ignored in the update": ({}, masks_ignored, "grad/branch_head", ("discrete", "hybrid")),
    "action masks read as True = blocked": ({}, masks_inverted, "policy_loss", ("discrete", "hybrid")),
    # The continuous dims' mean next to the branches' sum ('discrete' has no continuous dim to reduce).
    "entropy summed over continuous dims": ({"entropy_reduce": "sum"}, None, "entropy", ("hybrid",)),
}


@pytest.mark.parametrize(
    "name, bug", [(name, bug) for bug, (*_, cases) in sorted(DISCRETE_PLANTED_BUGS.items()) for name in cases]
)
def test_discrete_planted_bug_breaks_parity(references, name, bug):
    """Each planted discrete bug must make the discrete comparison fail, where the bug lives."""
    overrides, patch, where, _ = DISCRETE_PLANTED_BUGS[bug]
    ref = references(name)
    with patch() if patch else contextlib.nullcontext():
        failed = failures(compare(run_ours(ref, our_config(**HANDED_OVER, **overrides)), ref.record))
    assert failed, f"planted bug {bug!r} went unnoticed"
    assert any(where in k for k in failed), sorted(failed)[:10]
