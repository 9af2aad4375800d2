"""The PPO learner's compute: ingest trajectory pieces, update, checkpoint. No I/O.

Data flow (serial or distributed, the same calls)::

    actor:   policy = make_policy(cfg, obs_dim, action_dim); policy.load_state_dict(broadcast)
             out = policy.act(obs)                                   # raw action, per-dim log-prob, value
             env.step(env_action(out.action, mode=cfg.action_clip, low=..., high=...))
             ... every T steps send each env's steps as a TrajectoryPiece (source = the env stream)
    learner: learner.ingest(piece)                                   # 'rollout': GAE/returns of the piece now
                                                                     # 'mlagents': of each trajectory it
                                                                     completes
             if learner.ready(): metrics = learner.update(); broadcast(learner.policy.state_dict())

``trajectory_handling='mlagents'`` (#15) runs ML-Agents' AgentProcessor here (:class:`AgentTrajectories`):
trajectories end at an episode end or ``time_horizon`` steps after their own start, whatever the pieces'
sizes, and an unfinished one waits across updates.

Which semantics each step follows is read from :class:`impala.run.ppo_config.PPOConfig`
(rows #n of docs/PPO.md); the math lives in :mod:`impala.algos.ppo`.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from typing import Any, Hashable, Mapping, NamedTuple

import numpy as np
import torch

from impala.algos import ppo
from impala.algos.normalizers import RewardNormalizer, RunningMeanStd
from impala.envs.obs_layout import ObsLayout
from impala.envs.probe import EnvInfo
from impala.nets.onnx_export import export_ppo_onnx, onnx_file_name
from impala.nets.ppo_policy import env_action, make_policy
from impala.run.checkpoint import CheckpointError
from impala.run.config import RunConfig, resolve_device
from impala.run.ppo_config import PPOConfig, actors_wait
from impala.transport import wire
from impala.transport.messages import PPOAgentSpec
from impala.transport.params import state_dict_arrays
from impala.transport.trajectory import ppo_unroll_schema


class TrajectoryPiece(NamedTuple):
    """One env stream's consecutive steps, as an actor sends them. T >= 1.

    obs:        [T, obs_dim] float32 raw observation each action was taken on.
    actions:    [T, A] float32 raw (unclipped) sampled continuous actions (A may be 0).
    log_probs:  [T, A + nb] float32 per-element log-probs at action time (continuous dims, then
                one per discrete branch).
    rewards:    [T] float32 raw env rewards.
    terminated: [T] bool, episode ended for real (no bootstrap).
    truncated:  [T] bool, time limit / Unity ``interrupted`` (bootstrap from next_obs).
    next_obs:   [T, obs_dim] float32 observation after each step *within the
                same episode*, i.e. ``StepResult.final_obs``. Only rows that end
                an episode and the last row are read.
    values:     optional [T] float32 values at action time (used by gae_form='sb3').
    source:     hashable id of the env stream (e.g. (actor_id, env_index)); keys
                the per-stream discounted return of reward normalization.
    discrete_actions: [T, nb] int64 indices, one per branch (None: no discrete branches).
    action_mask: [T, sum(branch sizes)] bool, True where an action was allowed (None: no masks).
    """

    obs: np.ndarray
    actions: np.ndarray
    log_probs: np.ndarray
    rewards: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    next_obs: np.ndarray
    values: np.ndarray | None = None
    source: Hashable = 0
    discrete_actions: np.ndarray | None = None
    action_mask: np.ndarray | None = None


# The per-step arrays a piece may lack (None); `values` only survives a join where every piece has it.
_OPTIONAL_STEPS = ("values", "discrete_actions", "action_mask")


def concat_pieces(pieces: list[TrajectoryPiece]) -> TrajectoryPiece:
    """Consecutive pieces of one env stream as one piece (an optional array kept only if every piece has
    it)."""
    if len(pieces) == 1:
        return pieces[0]
    arrays = [np.concatenate([np.asarray(p[i]) for p in pieces]) for i in range(7)]
    optional = {
        name: None
        if any(getattr(p, name) is None for p in pieces)
        else np.concatenate([np.asarray(getattr(p, name)) for p in pieces])
        for name in _OPTIONAL_STEPS
    }
    return TrajectoryPiece(*arrays, source=pieces[0].source, **optional)


def slice_piece(p: TrajectoryPiece, a: int, b: int) -> TrajectoryPiece:
    """Steps ``a:b`` of a trajectory piece."""
    optional = {
        name: None if getattr(p, name) is None else np.asarray(getattr(p, name))[a:b]
        for name in _OPTIONAL_STEPS
    }
    return TrajectoryPiece(*(np.asarray(x)[a:b] for x in p[:7]), source=p.source, **optional)


class AgentTrajectories:
    """ML-Agents' ``AgentProcessor`` on the learner side (trajectory_handling='mlagents', #15).

    Each env stream (``TrajectoryPiece.source``: one agent) arrives as consecutive pieces of any length
    (the actors' unrolls). Its steps are gathered until the trajectory is complete, exactly where
    ``agent_processor.py::AgentProcessor._process_step`` emits one: at an episode end (terminated or
    truncated/``interrupted``), or when it holds ``time_horizon`` steps counted from *its own* start;
    the next trajectory starts with the next step. An unfinished trajectory is kept for as long as it
    takes (across updates), with whatever the actor recorded at action time (the log-probs).

    A stream must continue where it stopped: ``next_obs`` of the last kept step (the observation the
    next action was taken on) must be the next piece's first ``obs``. When it is not (an unroll was
    dropped on the way, an actor restarted), the unfinished steps can never be completed honestly and
    are discarded (counted in ``broken``), as ``AgentProcessor.end_episode`` discards them on a forced reset.
    """

    def __init__(self, time_horizon: int) -> None:
        if time_horizon < 1:
            raise ValueError(f"AgentTrajectories: time_horizon must be >= 1, got {time_horizon}")
        self.time_horizon = time_horizon
        self._pending: dict[Hashable, list[TrajectoryPiece]] = {}
        self._pending_len: dict[Hashable, int] = {}
        self.broken = 0  # unfinished trajectories discarded because their stream did not continue
        self.broken_steps = 0

    @property
    def pending_steps(self) -> int:
        """Steps held in unfinished trajectories (all streams)."""
        return sum(self._pending_len.values())

    def pending_length(self, source: Hashable) -> int:
        return self._pending_len.get(source, 0)

    def drop(self, source: Hashable) -> None:
        """Discard ``source``'s unfinished trajectory (its stream broke)."""
        n = self._pending_len.pop(source, 0)
        self._pending.pop(source, None)
        if n:
            self.broken += 1
            self.broken_steps += n

    def clear(self) -> None:
        self._pending.clear()
        self._pending_len.clear()

    def add(self, piece: TrajectoryPiece) -> list[TrajectoryPiece]:
        """Append ``piece`` to its stream; return the trajectories it completed, in order."""
        src = piece.source
        kept = self._pending.get(src)
        if kept and not np.array_equal(np.asarray(kept[-1].next_obs[-1]), np.asarray(piece.obs[0])):
            self.drop(src)
            kept = None
        kept = list(kept or [])
        n_kept = self._pending_len.get(src, 0) if kept else 0
        ended = np.asarray(piece.terminated, bool) | np.asarray(piece.truncated, bool)
        done: list[TrajectoryPiece] = []
        start = 0  # first row of `piece` not yet in a completed trajectory
        for t in range(len(ended)):
            if ended[t] or n_kept + (t + 1 - start) >= self.time_horizon:
                done.append(concat_pieces([*kept, slice_piece(piece, start, t + 1)]))
                kept, n_kept, start = [], 0, t + 1
        if start < len(ended):
            kept.append(piece if start == 0 else slice_piece(piece, start, len(ended)))
            n_kept += len(ended) - start
        if kept:
            self._pending[src], self._pending_len[src] = kept, n_kept
        else:
            self._pending.pop(src, None)
            self._pending_len.pop(src, None)
        return done


class TrajectoryBuffer:
    """Processed steps waiting for an update: flat [N, ...] tensors after :meth:`stacked`."""

    KEYS = ("obs", "actions", "log_probs", "advantages", "returns", "values")
    DISCRETE_KEYS = ("discrete_actions", "action_mask")  # kept when given (policies with branches / masks)

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._parts: dict[str, list[torch.Tensor]] = {k: [] for k in self.KEYS}
        self.num_steps = 0

    def add(self, **arrays: torch.Tensor) -> None:
        n = arrays["obs"].shape[0]
        for k in self.DISCRETE_KEYS:
            if arrays.get(k) is not None:
                self._parts.setdefault(k, [])
        for k in self._parts:
            if arrays[k].shape[0] != n:
                raise ValueError(f"TrajectoryBuffer.add: {k} has {arrays[k].shape[0]} rows, obs has {n}")
            self._parts[k].append(arrays[k])
        self.num_steps += n

    def stacked(self) -> dict[str, torch.Tensor]:
        return {k: torch.cat(v) for k, v in self._parts.items()}


class PPOLearner:
    """PPO with option-by-option ML-Agents / SB3 semantics.

    Args:
      config: the PPOConfig.
      obs_dim, action_dim: flat observation and continuous action sizes.
      action_low, action_high: the env's action bounds (used by action_clip='bounds').
      device: torch device for the networks and the update.
      branches: each discrete branch's action count (empty: continuous actions only).
      action_mask: pieces carry the env's action masks (``TrajectoryPiece.action_mask``).
      obs_layout: which parts of the flat observation are images (``impala.envs.obs_layout``).
    """

    def __init__(
        self,
        config: PPOConfig,
        obs_dim: int,
        action_dim: int,
        action_low: np.ndarray | float = -1.0,
        action_high: np.ndarray | float = 1.0,
        device: str | torch.device = "cpu",
        branches: tuple[int, ...] = (),
        action_mask: bool = False,
        obs_layout: ObsLayout | None = None,
    ):
        self.config = config
        self.obs_dim, self.action_dim = obs_dim, action_dim
        self.branches, self.action_mask = tuple(branches), action_mask
        self.action_low = np.broadcast_to(np.asarray(action_low, np.float32), (action_dim,)).copy()
        self.action_high = np.broadcast_to(np.asarray(action_high, np.float32), (action_dim,)).copy()
        self.device = torch.device(device)
        self.policy = make_policy(config, obs_dim, action_dim, self.branches, obs_layout).to(self.device)
        # One Adam over actor + critic + log-sigma (#7); normalizer stats are buffers, not parameters.
        self.optimizer = torch.optim.Adam(
            self.policy.parameters(), lr=config.learning_rate, eps=config.adam_eps
        )
        self.obs_rms = RunningMeanStd(shape=(obs_dim,)) if config.obs_norm == "vecnormalize" else None
        self.reward_normalizer = RewardNormalizer(config.gamma) if config.reward_norm else None
        self.buffer = TrajectoryBuffer()
        # #15: ML-Agents' per-agent trajectories (None: every piece is processed as it arrives).
        self.trajectories = (
            AgentTrajectories(config.time_horizon) if config.trajectory_handling == "mlagents" else None
        )
        self.rng = np.random.default_rng(config.seed)
        # agent steps processed (for 'mlagents' #15: in completed trajectories), the schedules' step (#6)
        self.total_steps = 0
        self.update_count = 0
        self.rejected_batches = 0
        self._sync_obs_snapshot()

    # ------------------------------------------------------------- actors

    def env_action(self, raw_action: np.ndarray | torch.Tensor):
        """The action the env receives for a raw policy sample (#10, ``config.action_clip``)."""
        return env_action(
            raw_action, mode=self.config.action_clip, low=self.action_low, high=self.action_high
        )

    # ------------------------------------------------------------- ingest

    def _check(self, p: TrajectoryPiece) -> int:
        T = len(p.rewards)
        if T == 0:
            raise ValueError("TrajectoryPiece: empty (T == 0)")
        want = {
            "obs": (T, self.obs_dim),
            "actions": (T, self.action_dim),
            "log_probs": (T, self.action_dim + len(self.branches)),
            "rewards": (T,),
            "terminated": (T,),
            "truncated": (T,),
            "next_obs": (T, self.obs_dim),
        }
        if p.values is not None:
            want["values"] = (T,)
        if self.branches:
            want["discrete_actions"] = (T, len(self.branches))
        if self.action_mask:
            want["action_mask"] = (T, sum(self.branches))
        for name, shape in want.items():
            value = getattr(p, name)
            got = None if value is None else tuple(np.shape(value))
            if got != shape:
                raise ValueError(f"TrajectoryPiece.{name}: expected shape {shape}, got {got}")
        if self.branches:
            problem = discrete_action_problem(p.discrete_actions, p.action_mask, self.branches)
            if problem:
                raise ValueError(f"TrajectoryPiece: {problem}")
        return T

    @staticmethod
    def _finite(p: TrajectoryPiece) -> bool:
        arrays = [p.obs, p.actions, p.log_probs, p.rewards, p.next_obs] + (
            [p.values] if p.values is not None else []
        )
        return all(np.isfinite(np.asarray(a, dtype=np.float64)).all() for a in arrays)

    def ingest(self, piece: TrajectoryPiece) -> bool:
        """Take one piece of an env stream.

        ``trajectory_handling='rollout'``: the piece is processed now (advantages/returns into the buffer).
        ``'mlagents'``: it joins its stream's unfinished trajectory; each trajectory it completes is
        processed now, in order, as ``ppo/trainer.py::PPOTrainer._process_trajectory`` does when
        ML-Agents' AgentProcessor emits it.

        Returns False (and counts ``rejected_batches``) for a piece with NaN/inf: it touches neither the
        normalizers nor the buffer (and, for 'mlagents', its stream's unfinished trajectory is discarded:
        the stream has a hole).
        """
        self._check(piece)
        if not self._finite(piece):
            self.rejected_batches += 1
            if self.trajectories is not None:
                self.trajectories.drop(piece.source)
            return False
        if self.trajectories is None:
            self._process(piece)
        else:
            for trajectory in self.trajectories.add(piece):
                self._process(trajectory)
        return True

    def _process(self, piece: TrajectoryPiece) -> None:
        """Normalizer update, value estimates, GAE and returns of one checked piece; into the buffer.

        Its steps count for the schedules now (ML-Agents: ``RLTrainer._process_trajectory`` ->
        ``_increment_step(len(trajectory.steps))``, the step ``TorchPPOOptimizer.update`` decays with).
        """
        T = len(piece.rewards)
        cfg = self.config
        dev = self.device
        # a copy: the wire decodes arrays zero-copy over the message's read-only bytes, which torch may
        # not share (it warned once per run)
        obs = torch.tensor(np.asarray(piece.obs, np.float32), device=dev)
        terminated = np.asarray(piece.terminated, bool)
        truncated = np.asarray(piece.truncated, bool) & ~terminated  # terminal wins when both are set
        ended = terminated | truncated
        self.total_steps += T

        if cfg.obs_norm == "vecnormalize":
            self.obs_rms.update(np.asarray(piece.obs, np.float64))

        rewards = np.asarray(piece.rewards, np.float64)
        if self.reward_normalizer is not None:
            rewards = self.reward_normalizer.normalize_piece(rewards, ended, piece.source).astype(np.float64)

        bootstrap = truncated if cfg.bootstrap_truncated else np.zeros_like(truncated)
        need_next = bootstrap.copy()
        need_next[-1] |= not ended[-1]  # the piece was cut mid-episode (time_horizon): bootstrap at the cut
        next_obs = np.asarray(piece.next_obs, np.float32)
        recompute = cfg.gae_form == "mlagents" or piece.values is None
        values = (
            torch.empty(T, dtype=torch.float64, device=dev)
            if recompute
            else torch.as_tensor(np.asarray(piece.values, np.float64), device=dev)
        )
        v_next = torch.zeros(T, dtype=torch.float64, device=dev)
        # #12: ML-Agents folds each trajectory into both normalizers *before* that trajectory's value
        # estimates, one trajectory (here: the piece's part up to and including an episode end) at a time.
        parts = self._episode_parts(ended) if cfg.obs_norm == "mlagents" else [(0, T)]
        with torch.no_grad():
            for a, b in parts:
                if cfg.obs_norm == "mlagents":
                    self.policy.update_normalizer(obs[a:b])
                if recompute:
                    values[a:b] = self.policy.value(obs[a:b]).double()
                idx = a + np.flatnonzero(need_next[a:b])
                if idx.size:
                    nxt = torch.as_tensor(next_obs[idx], device=dev)
                    v_next[torch.as_tensor(idx, device=dev)] = self.policy.value(nxt).double()
        r = torch.as_tensor(rewards, device=dev)

        if cfg.gae_form == "mlagents":
            adv, ret = self._gae_mlagents(r, values, v_next, ended)
        else:
            adv, ret = self._gae_sb3(r, values, v_next, ended, bootstrap)

        stored_obs = self.policy.normalize_obs(obs) if cfg.obs_norm == "vecnormalize" else obs
        self.buffer.add(
            obs=stored_obs,
            actions=torch.as_tensor(np.asarray(piece.actions, np.float32), device=dev),
            log_probs=torch.as_tensor(np.asarray(piece.log_probs, np.float32), device=dev),
            advantages=adv.float(),
            returns=ret.float(),
            values=values.float(),
            discrete_actions=None
            if piece.discrete_actions is None
            else torch.as_tensor(np.asarray(piece.discrete_actions, np.int64), device=dev),
            action_mask=None
            if piece.action_mask is None
            else torch.as_tensor(np.asarray(piece.action_mask, bool), device=dev),
        )

    @staticmethod
    def _episode_parts(ended: np.ndarray) -> list[tuple[int, int]]:
        """[start, stop) of each part of a piece that ML-Agents would see as its own trajectory:
        cut after every episode end, and at the piece's end."""
        stops = [int(e) + 1 for e in np.flatnonzero(ended)]
        if not stops or stops[-1] != len(ended):
            stops.append(len(ended))
        return list(zip([0, *stops[:-1]], stops))

    def _gae_mlagents(self, r, values, v_next, ended) -> tuple[torch.Tensor, torch.Tensor]:
        """#13/#14: one ML-Agents trajectory per episode segment, value_next = 0 only on real termination."""
        cfg = self.config
        adv = torch.empty_like(values)
        ret = torch.empty_like(values)
        for a, b in self._episode_parts(ended):
            # v_next is zero at real terminations (and at truncations when bootstrap_truncated is off).
            out = ppo.mlagents_gae(r[a:b], values[a:b], v_next[b - 1], gamma=cfg.gamma, lambd=cfg.lambd)
            adv[a:b], ret[a:b] = out.advantages, out.returns
        return adv, ret

    def _gae_sb3(self, r, values, v_next, ended, bootstrap) -> tuple[torch.Tensor, torch.Tensor]:
        """#13/#14: SB3's reward bootstrap on truncation, then masked reverse GAE (B = 1)."""
        cfg = self.config
        dev = values.device
        r = ppo.sb3_bootstrap_truncated(r, torch.as_tensor(bootstrap, device=dev), v_next, gamma=cfg.gamma)
        starts = torch.zeros(len(ended), dtype=torch.bool, device=dev)
        starts[1:] = torch.as_tensor(ended[:-1], device=dev)
        last_done = torch.as_tensor(ended[-1:], device=dev)
        out = ppo.sb3_gae(
            r[:, None],
            values[:, None],
            starts[:, None],
            v_next[-1:],
            last_done,
            gamma=cfg.gamma,
            gae_lambda=cfg.lambd,
        )
        return out.advantages[:, 0], out.returns[:, 0]

    def ready(self) -> bool:
        """#8: ML-Agents updates once the buffer holds MORE than buffer_size steps; SB3 at buffer_size."""
        return self.buffer.num_steps >= self.config.update_steps

    # ------------------------------------------------------------- update

    def schedules(self, step: int | None = None) -> dict[str, float]:
        """learning_rate, epsilon, beta at ``step`` total agent steps (default: now)."""
        cfg = self.config
        s = self.total_steps if step is None else step
        return {
            "learning_rate": ppo.scheduled_value(
                cfg.lr_schedule, cfg.learning_rate, cfg.lr_floor, s, cfg.max_steps
            ),
            "epsilon": ppo.scheduled_value(
                cfg.epsilon_schedule, cfg.epsilon, cfg.epsilon_floor, s, cfg.max_steps
            ),
            "beta": ppo.scheduled_value(cfg.beta_schedule, cfg.beta, cfg.beta_floor, s, cfg.max_steps),
        }

    def minibatch_slices(self, n: int) -> list[slice]:
        """#8: 'drop' -> n // batch_size full minibatches; 'keep' -> also the last partial one."""
        bs = self.config.batch_size
        if self.config.minibatch_remainder == "drop":
            return [slice(i, i + bs) for i in range(0, (n // bs) * bs, bs)]
        return [slice(i, min(i + bs, n)) for i in range(0, n, bs)]

    def update(self) -> dict[str, float]:
        """Epochs of minibatch PPO updates on the whole buffer, then clear it. Returns metrics."""
        cfg = self.config
        data = self.buffer.stacked()
        n = data["obs"].shape[0]
        sched = self.schedules()
        lr, eps, beta = sched["learning_rate"], sched["epsilon"], sched["beta"]
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        adv_all = data["advantages"]
        if cfg.advantage_norm == "buffer":
            adv_all = ppo.normalize_advantages_mlagents(adv_all)
        params = list(self.policy.parameters())

        stats: dict[str, list[float]] = {
            k: [] for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "loss")
        }
        grad_norms: list[float] = []
        early_stop = False
        n_minibatches = 0
        self.policy.train()
        for _ in range(cfg.num_epoch):
            perm = torch.as_tensor(self.rng.permutation(n), device=self.device)
            for sl in self.minibatch_slices(n):
                pl, total = self._minibatch_loss(data, perm[sl], adv_all, eps, beta, stats)
                n_minibatches += 1
                # SB3 checks before the optimizer step of this minibatch (#7).
                if cfg.target_kl is not None and float(pl.approx_kl) > 1.5 * cfg.target_kl:
                    early_stop = True
                    break
                self.optimizer.zero_grad(set_to_none=True)
                total.loss.backward()
                if cfg.max_grad_norm is not None:
                    grad_norms.append(float(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)))
                self.optimizer.step()
            if early_stop:
                break

        metrics = self._update_metrics(data, stats, grad_norms, (lr, eps, beta), n_minibatches, early_stop)
        self.buffer.clear()
        self.update_count += 1
        metrics["update_count"] = float(self.update_count)
        self._sync_obs_snapshot()
        return metrics

    def _minibatch_loss(
        self,
        data: Mapping[str, torch.Tensor],
        idx: torch.Tensor,
        adv_all: torch.Tensor,
        eps: float,
        beta: float,
        stats: dict[str, list[float]],
    ) -> tuple[Any, Any]:
        """The clipped policy loss and the total loss of one minibatch (rows ``idx``); appends its
        statistics to ``stats``."""
        cfg = self.config
        ev = self.policy.evaluate(
            data["obs"][idx],
            data["actions"][idx],
            normalized=cfg.obs_norm == "vecnormalize",
            discrete_actions=data["discrete_actions"][idx] if "discrete_actions" in data else None,
            action_mask=data["action_mask"][idx] if "action_mask" in data else None,
        )
        adv = adv_all[idx]
        if cfg.advantage_norm == "minibatch":
            adv = ppo.normalize_advantages_sb3(adv)
        pl = ppo.clipped_policy_loss(
            ev.log_prob, data["log_probs"][idx], adv, epsilon=eps, per_dim=cfg.ratio == "per_dim"
        )
        v_old, ret = data["values"][idx], data["returns"][idx]
        if cfg.value_loss == "mlagents":
            vl = ppo.value_loss_mlagents_as_run(ev.value, ret, epsilon=eps)
        elif cfg.value_loss == "mlagents_intended":
            vl = ppo.value_loss_mlagents_intended(ev.value, v_old, ret, epsilon=eps)
        elif cfg.value_loss == "mse":
            vl = ppo.value_loss_mse(ev.value, ret)
        else:
            vl = ppo.value_loss_sb3_clipped(ev.value, v_old, ret, clip_range_vf=cfg.clip_range_vf)
        ent = ppo.reduce_hybrid_entropy(ev.entropy, ev.discrete_entropy, over_dims=cfg.entropy_reduce)
        # Both libraries' totals are the same sum (#5); ppo.total_loss_sb3 is its SB3 spelling.
        total = ppo.total_loss_mlagents(pl.loss, vl, ent, beta=beta, vf_coef=cfg.vf_coef)
        for k, v in (
            ("policy_loss", pl.loss),
            ("value_loss", vl),
            ("entropy", ent),
            ("approx_kl", pl.approx_kl),
            ("clip_fraction", pl.clip_fraction),
            ("loss", total.loss),
        ):
            stats[k].append(float(v.detach()))
        return pl, total

    def _update_metrics(
        self,
        data: Mapping[str, torch.Tensor],
        stats: dict[str, list[float]],
        grad_norms: list[float],
        schedules: tuple[float, float, float],
        n_minibatches: int,
        early_stop: bool,
    ) -> dict[str, float]:
        """An update's metrics: the minibatches' means, the schedules' values and the buffer's counts."""
        lr, eps, beta = schedules
        metrics = {k: (float(np.mean(v)) if v else float("nan")) for k, v in stats.items()}
        metrics.update(
            explained_variance=ppo.explained_variance(data["values"].double(), data["returns"].double()),
            learning_rate=lr,
            epsilon=eps,
            beta=beta,
            buffer_steps=float(data["obs"].shape[0]),
            n_minibatches=float(n_minibatches),
            early_stop=float(early_stop),
            total_steps=float(self.total_steps),
            rejected_batches=float(self.rejected_batches),
        )
        if self.action_dim:
            metrics["log_sigma_mean"] = float(self.policy.log_sigma.detach().mean())
        if self.trajectories is not None:
            # Steps waiting in unfinished trajectories: they train in a later update (#15).
            metrics["pending_steps"] = float(self.trajectories.pending_steps)
            metrics["broken_trajectories"] = float(self.trajectories.broken)
        if grad_norms:
            metrics["grad_norm"] = float(np.mean(grad_norms))
        return metrics

    def _sync_obs_snapshot(self) -> None:
        """vecnormalize: actors act with the stats of the last update, and the learner stores obs
        normalized with those same stats (SB3 refreshes them every env step; an actor-learner split
        can only refresh them with the weights)."""
        if self.obs_rms is not None:
            self.policy.obs_norm.set_stats(self.obs_rms.mean, self.obs_rms.var)

    # --------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Model (with normalizer buffers), optimizer, host-side normalizers, counters, shuffle RNG.

        The pending (not yet updated) buffer is not saved, nor are unfinished trajectories (#15): after a
        resume each stream starts a new trajectory. Returned as a deep copy: torch's
        ``Optimizer.load_state_dict`` would otherwise share moment tensors with this learner.
        """
        return copy.deepcopy(
            {
                "config": dataclasses.asdict(self.config),
                "policy": self.policy.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "obs_rms": self.obs_rms.state_dict() if self.obs_rms is not None else None,
                "reward_normalizer": self.reward_normalizer.state_dict()
                if self.reward_normalizer is not None
                else None,
                "total_steps": self.total_steps,
                "update_count": self.update_count,
                "rejected_batches": self.rejected_batches,
                "rng": self.rng.bit_generator.state,
            }
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state["policy"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.obs_rms is not None:
            self.obs_rms.load_state_dict(state["obs_rms"])
        if self.reward_normalizer is not None:
            self.reward_normalizer.load_state_dict(state["reward_normalizer"])
        self.total_steps = int(state["total_steps"])
        self.update_count = int(state["update_count"])
        self.rejected_batches = int(state["rejected_batches"])
        self.rng.bit_generator.state = state["rng"]
        # The policy's obs snapshot came back with its state_dict; the live obs_rms may be ahead of it.
        self.buffer.clear()
        if self.trajectories is not None:
            self.trajectories.clear()


# --------------------------------------------------------------------------- the runtime's adapter

# PPOLearner.update() key -> logged key (CleanRL's grouping); launch_impala logs the same names
# (losses/policy_loss, losses/value_loss, losses/entropy, losses/total, losses/grad_norm,
# losses/clip_fraction, health/explained_variance), so runs of either launcher compare column for column.
METRIC_KEYS = {
    "policy_loss": "losses/policy_loss",
    "value_loss": "losses/value_loss",
    "entropy": "losses/entropy",
    "loss": "losses/total",
    "approx_kl": "losses/approx_kl",
    "clip_fraction": "losses/clip_fraction",
    "explained_variance": "health/explained_variance",
    "grad_norm": "losses/grad_norm",
    "learning_rate": "charts/learning_rate",
    "epsilon": "charts/epsilon",
    "beta": "charts/beta",
    "log_sigma_mean": "charts/log_sigma_mean",
    "buffer_steps": "charts/buffer_steps",
    "n_minibatches": "charts/n_minibatches",
    "early_stop": "charts/early_stop",
    "total_steps": "charts/agent_steps_trained",
    "update_count": "charts/updates",
    "pending_steps": "charts/pending_steps",
    "broken_trajectories": "charts/broken_trajectories",
}


def unrolls_per_update(config: PPOConfig, unroll_length: int, n_envs: int) -> int:
    """Rounds of unrolls (one per env of every actor) that fill one update's buffer."""
    return math.ceil(config.update_steps / (unroll_length * n_envs))


def piece_from_unroll(arrays: Mapping[str, np.ndarray], source: Any = 0) -> TrajectoryPiece:
    """One ``ppo_unroll_schema`` unroll -> a TrajectoryPiece.

    ``next_obs[t]`` is ``final_obs[t]`` where the episode ended at t (terminated or
    truncated) and ``obs[t + 1]`` otherwise; the last row bootstraps the cut.
    """
    obs = arrays["obs"]
    ended = arrays["terminated"] | arrays["truncated"]
    next_obs = np.where(ended[:, None], arrays["final_obs"], obs[1:])
    T = len(arrays["rewards"])
    return TrajectoryPiece(
        obs=obs[:-1],
        actions=arrays["actions"] if "actions" in arrays else np.zeros((T, 0), np.float32),
        log_probs=arrays["log_probs"],
        rewards=arrays["rewards"],
        terminated=arrays["terminated"],
        truncated=arrays["truncated"],
        next_obs=next_obs,
        values=None,
        source=source,
        discrete_actions=arrays.get("discrete_actions"),
        action_mask=arrays.get("action_mask"),
    )


def discrete_action_problem(
    actions: np.ndarray, mask: np.ndarray | None, branches: tuple[int, ...]
) -> str | None:
    """What is wrong with recorded discrete actions [T, nb] (masks [T, sum(branches)]), or None: every
    index must lie in its branch, and (masked) be an action the mask allowed, as a sampling actor's
    always is."""
    actions = np.asarray(actions)
    sizes = np.asarray(branches)
    if actions.size and (actions.min() < 0 or (actions >= sizes).any()):
        return f"discrete actions outside their branches {list(branches)}"
    if mask is not None and actions.size:
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        taken = np.take_along_axis(np.asarray(mask, bool), actions + offsets, axis=1)
        if not taken.all():
            return "a discrete action its action mask blocked"
    return None


def _to_torch(x: Any) -> Any:
    """Numpy -> tensors (recursively): checkpoints load with ``weights_only=True``, which refuses numpy
    arrays."""
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.array(x))
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, dict):
        return {k: _to_torch(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_torch(v) for v in x]
    return x


class PPOTrainer:
    """The runtime's Trainer for PPO: unrolls -> TrajectoryPieces -> PPOLearner."""

    # on-policy: its actors wait for each update's weights, so there is no next batch to stage meanwhile
    overlaps_updates = False

    def __init__(
        self, config: PPOConfig, run: RunConfig, env: EnvInfo, *, params_wait_s: float = 0.0
    ) -> None:
        """``run`` as resolved by the launcher: ``unroll_length`` is T, ``envs_per_worker`` the envs
        (Unity: agents) per actor. On-policy (``max_policy_lag`` 0), and always with
        trajectory_handling='mlagents' (ML-Agents does not step its envs during an update), each actor
        waits for new weights once it sent its share of an update (``unrolls_per_update`` rounds of
        unrolls; for 'mlagents' that many rounds' worth of steps in *completed* trajectories), for at
        most ``params_wait_s``."""
        env.require_ppo_spaces("launch_ppo")
        T = run.unroll_length  # resolved by impala.run.ppo_config.ppo_run_config
        self.config = config
        self.env_spec, self.obs_sizes = env.spec, env.obs_sizes  # for export_onnx: the file's name and inputs
        branches = env.ppo_branches
        low = env.action_low if env.action_low is not None else np.zeros(0, np.float32)
        high = env.action_high if env.action_high is not None else np.zeros(0, np.float32)
        self.learner = PPOLearner(
            config,
            env.obs_dim,
            env.action_dim,
            low,
            high,
            resolve_device(run.device),
            branches=branches,
            action_mask=env.action_mask,
            obs_layout=env.obs_layout,
        )
        self.schema = ppo_unroll_schema(T, env.obs_dim, env.action_dim, branches, env.action_mask)
        self.n_envs = max(run.workers, 1) * run.envs_per_worker
        wait = actors_wait(run, config)
        self.agent = PPOAgentSpec(
            config,
            env.obs_dim,
            env.action_dim,
            tuple(map(float, low)),
            tuple(map(float, high)),
            unrolls_per_update(config, T, self.n_envs) if wait else 0,
            params_wait_s,
            branches,
            "Unity" if env.spec.is_unity else env.action_space,
            env.action_mask,
            env.obs_layout,
            # one local actor: it alone fills the buffer, so it can wait exactly where the learner updates
            sole_actor=wait and config.trajectory_handling == "mlagents" and run.workers == 1,
        )
        self.frames_per_step = 1.0  # gym control tasks and Unity: one frame per agent step
        self.max_abs_value = run.max_abs_value
        self.queue_size = run.queue_size or max(16, 2 * self.n_envs)

    @property
    def device(self) -> torch.device:
        return self.learner.device

    def close(self) -> None:
        """Nothing to release (one learner process)."""

    def validate(self, arrays: Mapping[str, np.ndarray]) -> str | None:
        """Finite but huge floats (a peer's, or a diverging env's) are dropped on receipt, and so are
        behaviour log-probabilities the update cannot survive.

        The update takes exp(new - old log-probability); -1e6 (within --max-abs-value) overflows it.
        Per step, with the policy's current log-sigma, an action's log-probability is
        -0.5 * sum(z^2) - sum(log sigma) - A/2 log(2 pi): an unroll whose 0.5 * sum(z^2) exceeds 80
        (so that the ratio could pass e^80 of float32's e^88) is dropped. An honest sample gets there
        with chi-square(A) > 160: never, for action sizes up to ~50.
        """
        problem = wire.check_bounded(arrays, self.max_abs_value)
        if problem is not None:
            return problem
        A = self.learner.action_dim
        log_probs = arrays["log_probs"].astype(np.float64)
        if A:
            log_sigma = self.learner.policy.log_sigma.detach().cpu().numpy().astype(np.float64)
            half_z2 = -(log_probs[:, :A] + log_sigma + 0.5 * np.log(2 * np.pi)).sum(axis=-1)
            if half_z2.size and half_z2.max() > 80.0:
                low, depth = float(log_probs[:, :A].min()), float(half_z2.max())
                return (
                    f"log_probs {low:.3g} put an action {depth:.3g} nats below the policy's mode: "
                    "the update's ratio would overflow float32"
                )
        if self.learner.branches:
            # A sampled action's log-probability is <= 0, and an honest sampler never draws one of
            # probability e^-80 (ML-Agents' form cannot go below log(1e-7) = -16.1).
            discrete = log_probs[:, A:]
            if discrete.size and (discrete.min() < -80.0 or discrete.max() > 1e-4):
                return (
                    f"discrete log_probs in [{discrete.min():.3g}, {discrete.max():.3g}]: a sampled action's "
                    "log-probability lies in [-80, 0]"
                )
            return discrete_action_problem(
                arrays["discrete_actions"], arrays.get("action_mask"), self.learner.branches
            )
        return None

    def ingest(self, msg: wire.Message, version: int) -> bool:
        """False when the unroll held NaN/inf: counted (``transport/rejected_nan``), never trained on."""
        # (actor, env index) keys SB3's per-env discounted return (reward normalization, #12).
        env = msg.info.get("env", 0)
        source = (msg.actor, env if isinstance(env, int) else 0)
        return self.learner.ingest(piece_from_unroll(msg.arrays, source))

    @property
    def rejected_nan(self) -> int:
        return self.learner.rejected_batches

    def ready(self) -> bool:
        return self.learner.ready()

    def update(self, frames_done: int) -> dict[str, float]:
        raw = self.learner.update()
        out = {METRIC_KEYS.get(k, f"charts/{k}"): float(v) for k, v in raw.items() if k != "rejected_batches"}
        out["transport/rejected_nan"] = float(self.rejected_nan)
        return out

    def params(self) -> dict[str, np.ndarray]:
        # Weights, log-sigma and the normalizer buffers: actors act with exactly these statistics.
        return state_dict_arrays(self.learner.policy)

    def state_dict(self) -> dict[str, Any]:
        return _to_torch(self.learner.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        saved = dict(state.get("policy", {}))
        mine = self.learner.policy.state_dict()
        for name, tensor in mine.items():
            if name not in saved or tuple(saved[name].shape) != tuple(tensor.shape):
                got = "missing" if name not in saved else tuple(saved[name].shape)
                raise CheckpointError(
                    f"the checkpoint's network differs from this run's ({name}: checkpoint {got}, now "
                    f"{tuple(tensor.shape)}); "
                    "resume with the same env and network options, or use a new --logdir"
                )
        self.learner.load_state_dict(dict(state))

    def export_onnx(self, directory: str) -> str:
        """Write the current policy as ``<behaviour>.onnx`` in ``directory`` (ML-Agents 0.28's format, for
        Unity; ``impala.nets.onnx_export``) and return its path. Raises ``ExportError`` (one line) when
        onnx is not installed or the file cannot be written."""
        path = os.path.join(directory, onnx_file_name(self.env_spec))
        return export_ppo_onnx(
            self.learner.policy,
            path,
            action_clip=self.config.action_clip,
            action_low=self.agent.action_low,
            action_high=self.agent.action_high,
            obs_sizes=self.obs_sizes or None,
        )
