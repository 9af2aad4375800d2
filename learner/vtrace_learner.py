"""The IMPALA learner: its compute (``VTraceLearner``: ``step(batch) -> metrics``; no I/O, no
sockets, no threads) and its adapter to the runtime (``ImpalaTrainer``).

One update step (:meth:`VTraceLearner.step`): forward the network over the unrolls, V-trace's targets (from
this network, or fixed for the batch's passes with ``--targets per_batch``), the one (PopArt-)IMPALA loss,
backward, the gradients summed over a learner group and clipped by their global norm, the optimizer (Adam by
default, RMSProp for the paper's preset) at a linearly decaying learning rate, then with ``--popart`` the
statistics update, which rescales the value head so its unnormalized outputs are preserved. Without
``--popart`` the value head keeps identity statistics, where the loss is IMPALA's, bit for bit. Around the
step: the batch's staging, the health metrics and the CPU heuristics (:mod:`learner.update`), and the
learner group's start (:mod:`learner.cli.group_start`).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch

from impala.algos.impala_losses import BatchTargets, ImpalaLoss, impala_loss, normalized, vtrace_targets
from impala.algos.popart import unnormalize
from impala.envs.probe import EnvInfo
from impala.nets.impala_net import ImpalaNet, build_model
from impala.options import ConfigError
from impala.run.config import ImpalaConfig, RunConfig, resolve_device
from impala.transport import wire
from impala.transport.messages import ImpalaAgentSpec
from impala.transport.params import state_dict_arrays
from impala.transport.trajectory import TrajectorySchema, impala_unroll_schema
from learner.group import STOP, SYNC, UPDATE, LearnerGroup, LearnerGroupError, lost_peer, peer_error
from learner.update.health import UpdateHealth
from learner.update.precision import bf16_torso_cost, cpu_has_native_bf16, torso_precision  # noqa: F401 (tests)
from learner.update.staging import BatchStaging, core_state, select_unrolls, task_ids

log = logging.getLogger(__name__)


def make_optimizer(model: torch.nn.Module, config: ImpalaConfig) -> torch.optim.Optimizer:
    """Adam or RMSProp over the model's parameters, as ``config`` says."""
    if config.optimizer == "adam":
        # fused: Adam's arithmetic in one pass per tensor; the same update, 5x faster on CPU than the
        # per-tensor loop (4.3 vs 0.8 ms a step for the shallow net), which ran 32 times a batch
        try:
            return torch.optim.Adam(
                model.parameters(), lr=config.learning_rate, eps=config.adam_eps, fused=True
            )
        except RuntimeError:  # a device or dtype without the fused kernel
            return torch.optim.Adam(model.parameters(), lr=config.learning_rate, eps=config.adam_eps)
    return torch.optim.RMSprop(
        model.parameters(),
        lr=config.learning_rate,
        alpha=config.rmsprop_alpha,
        eps=config.rmsprop_eps,
        momentum=config.rmsprop_momentum,
    )


# The least behaviour log-probability of a taken action an unroll may carry. The update takes
# exp(target - behaviour log-probability) (V-trace's rho; with --pg-clip, the surrogate's ratio), which
# overflows float32 past ~88: logits at +-1e6 that pass --max-abs-value made whole updates non-finite.
# An honest actor samples an action this unlikely with probability below e^-50 (2e-22).
MIN_BEHAVIOUR_LOG_PROB = -50.0


def untrainable_behaviour(logits: np.ndarray, actions: np.ndarray) -> str | None:
    """Why an unroll's behaviour policy cannot be trained on (its taken actions' log-probabilities,
    computed in float64, fall below MIN_BEHAVIOUR_LOG_PROB), else None."""
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    log_z = top[..., 0] + np.log(np.exp(x - top).sum(axis=-1))
    taken = np.take_along_axis(x, actions[..., None], axis=-1)[..., 0] - log_z
    if taken.size and not taken.min() >= MIN_BEHAVIOUR_LOG_PROB:
        return (
            f"behaviour_logits give a taken action log-probability {taken.min():.3g} < "
            f"{MIN_BEHAVIOUR_LOG_PROB:g}: the update's importance ratio would overflow"
        )
    return None


def sync_rounds(config: ImpalaConfig, run: RunConfig) -> int:
    """``--sync``: the unrolls each local actor sends per update (0 without it). Every local env sends one
    unroll a round, so a batch is ``--batch-size / (workers x envs per worker)`` rounds of all of them."""
    if not config.sync:
        return 0
    if run.weights_delay():
        raise ConfigError(
            f"--sync waits for each update's weights; with the actors' weights {run.weights_delay()} "
            "update(s) behind the learner's (--publish-delay, or --cpu-affinity learner-first) none would "
            "come: use --publish-delay 0"
        )
    envs = run.workers * run.envs_per_worker
    if run.workers < 1 or config.batch_size % envs:
        raise ConfigError(
            f"--sync needs local actors whose envs divide a batch: --batch-size {config.batch_size} is not a "
            f"multiple of --workers {run.workers} x --envs-per-worker {run.envs_per_worker}"
        )
    return config.batch_size // envs


class VTraceLearner:
    """Owns the model and optimizer; ``step`` runs one update on a time-major batch."""

    def __init__(
        self,
        model: ImpalaNet,
        config: ImpalaConfig,
        device: torch.device,
        *,
        total_frames: int,
        seed: int = 0,
        group: LearnerGroup | None = None,
        task_names: tuple[str, ...] = (),
    ) -> None:
        """``total_frames``: the run's length in env frames, over which the learning rate decays to 0.
        ``group``: a data-parallel learner group; this learner then holds one rank's share of each
        batch, and its update equals one learner's update on the whole batch.
        ``task_names``: a multi-task run's tasks (the model has one value head and one set of PopArt
        statistics per task; batches carry a ``task`` index per unroll)."""
        self.config = config
        self.task_names = tuple(task_names)
        self.total_frames = total_frames
        self.group = group
        self.device = device
        self.model = model.to(device)
        if hasattr(self.model.torso, "to_channels_last"):
            # NHWC convolutions: ~15% faster updates on CPU (oneDNN), and the layout cuDNN wants
            # for bf16. Weights published to actors are made contiguous again, so they are unaffected.
            self.model.torso.to_channels_last()
        self.precision = torso_precision(config.precision, device, self.model)
        if self.precision == "bf16":
            self.model.torso.compute_dtype = torch.bfloat16
        if group is not None:
            group.broadcast_module(self.model)
        self.optimizer = make_optimizer(self.model, config)
        self.updates = 0
        self.skipped_updates = 0  # steps dropped because their loss, gradient or targets were not finite
        # --popart: the statistics follow the targets (ART) and the value head keeps its outputs (POP);
        # without it they stay at identity, where the one loss is IMPALA's
        self.moves_popart = config.popart
        self._allreduce = group.allreduce_sum if group is not None else None  # sums over the group's ranks
        pg_clip = config.pg_clip or None
        self._target_settings = dict(
            clip_rho_threshold=1.0, clip_pg_rho_threshold=1.0, pg_clip=pg_clip, lambda_=config.vtrace_lambda
        )
        self._loss_settings = dict(
            baseline_cost=config.baseline_cost,
            entropy_cost=config.entropy_cost,
            reduction=config.loss_reduction,
            pg_clip=pg_clip,
            # a learner group standardizes by the whole batch's moments, as one learner would
            standardize=functools.partial(normalized, allreduce=self._allreduce)
            if config.advantage_norm
            else None,
        )
        self.staging = BatchStaging(self.model, device, group)
        self.health = UpdateHealth(self.model, self.optimizer, self.task_names, config.pg_clip)
        self._shuffle = torch.Generator().manual_seed(seed)

    def learning_rate(self, frames_done: int) -> float:
        if not self.config.lr_decay:
            return self.config.learning_rate
        return self.config.learning_rate * max(0.0, 1.0 - frames_done / self.total_frames)

    def stage(
        self, unrolls: list[Mapping[str, np.ndarray]], schema: TrajectorySchema, slot: int = 0
    ) -> dict[str, torch.Tensor]:
        """B unrolls stacked time-major into ``slot``'s staging buffers and prepared on the device
        (:class:`learner.update.staging.BatchStaging` says when a slot may be reused)."""
        return self.staging.prepare(self.staging.stage_host(unrolls, schema, slot), slot)

    def stage_host(
        self, unrolls: list[Mapping[str, np.ndarray]], schema: TrajectorySchema, slot: int = 0
    ) -> dict[str, torch.Tensor]:
        return self.staging.stage_host(unrolls, schema, slot)

    def prepare(self, staged: Mapping[str, torch.Tensor], slot: int | None = None) -> dict[str, torch.Tensor]:
        return self.staging.prepare(staged, slot)

    def train(self, batch: Mapping[str, torch.Tensor], *, frames_done: int) -> dict[str, float]:
        """All the updates one batch gets: ``epochs`` passes, each over ``minibatches`` disjoint
        sets of whole unrolls in a fresh random order (PPO's loop; 1 x 1 is IMPALA's single step).
        With ``--targets per_step`` every step recomputes V-trace against the current policy; with
        ``per_batch`` the targets come once, from the network as the batch arrives. Returns the last
        step's metrics."""
        cfg = self.config
        B = batch["actions"].shape[1]
        metrics: dict[str, float] = {}
        if cfg.targets == "per_batch" and cfg.epochs * cfg.minibatches > 1:
            batch = {**batch, **self._batch_targets(batch)}
        for _ in range(cfg.epochs):
            if cfg.minibatches == 1:
                metrics = self.step(batch, frames_done=frames_done)
                continue
            for idx in torch.randperm(B, generator=self._shuffle).chunk(cfg.minibatches):
                idx = idx.to(batch["actions"].device)
                metrics = self.step(
                    {k: select_unrolls(v, idx) for k, v in batch.items()}, frames_done=frames_done
                )
        return metrics

    def step(self, batch: Mapping[str, torch.Tensor], *, frames_done: int) -> dict[str, float]:
        """One update. ``batch`` holds the impala_unroll_schema arrays stacked as [T(+1), B, ...], and
        ``target_vs`` / ``target_pg_adv`` when the targets are fixed for the batch."""
        measure = self.health.due(self.updates)
        T = batch["actions"].shape[0]
        tasks = task_ids(batch)  # [T+1, B], or None for one task
        step_tasks = 0 if tasks is None else tasks[:T]
        fixed = "target_vs" in batch
        # Fixed targets need no bootstrap value: the forward pass (and so the backward) skips step T,
        # 1/(T+1) of the update's network work. The outputs of steps 0..T-1 do not depend on step T.
        logits, values = self._forward(batch, T if fixed else T + 1, tasks, measure)
        if fixed:
            targets = BatchTargets(batch["target_vs"], batch["target_pg_adv"])
        else:
            targets = self._targets(batch, logits, values, tasks)
        loss = impala_loss(
            batch["behaviour_logits"],
            logits[:T],
            batch["actions"],
            values[:T],
            targets,
            self.model.baseline.state,
            step_tasks,
            **self._loss_settings,
        )
        self.health.before_backward(self.updates, loss.total, logits, values, tasks)
        lr = self.learning_rate(frames_done)
        grad_norm, finite = self._optimize(loss, lr)
        if finite and self.moves_popart:
            self.model.baseline.update(loss.vtrace.vs, step_tasks, allreduce=self._allreduce)
        self.skipped_updates += not finite
        self.updates += 1
        metrics = self._metrics(loss, grad_norm, lr)
        metrics.update(self.health.after_step(measure, loss, logits, values, tasks))
        return metrics

    def _forward(
        self, batch: Mapping[str, torch.Tensor], steps: int, tasks: torch.Tensor | None, measure: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The network's logits and (normalized) values over the first ``steps`` steps, in float32; the
        torso tracks its activity if ``measure``."""
        torso = self.model.torso
        torso.track_activity = measure
        out, _ = self.model(
            batch["obs"][:steps],
            batch["first"][:steps],
            core_state(batch),
            None if tasks is None else tasks[:steps],
        )
        torso.track_activity = False
        return out.policy_logits.float(), out.values.float()

    def _targets(
        self,
        batch: Mapping[str, torch.Tensor],
        logits: torch.Tensor,
        values: torch.Tensor,
        tasks: torch.Tensor | None,
    ) -> BatchTargets:
        """V-trace's targets and advantages in return units, from logits and normalized values over steps
        0..T (step T's value is the bootstrap), mapped back through the PopArt statistics."""
        returns = unnormalize(self.model.baseline.state, values.detach(), 0 if tasks is None else tasks)
        rewards = batch["rewards"]
        if self.config.reward_clip > 0:
            rewards = rewards.clamp(-self.config.reward_clip, self.config.reward_clip)
        discounts = (~batch["dones"]).float() * self.config.discount
        return vtrace_targets(
            batch["behaviour_logits"],
            logits[:-1],
            batch["actions"],
            discounts,
            rewards,
            returns[:-1],
            returns[-1],
            **self._target_settings,
        )

    @torch.no_grad()
    def _batch_targets(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``--targets per_batch``: V-trace's targets and advantages from the network as the batch
        arrives, in return units, for every step of every pass (``target_vs``, ``target_pg_adv``)."""
        tasks = task_ids(batch)
        out, _ = self.model(batch["obs"], batch["first"], core_state(batch), tasks)
        targets = self._targets(batch, out.policy_logits.float(), out.values.float(), tasks)
        return {"target_vs": targets.vs, "target_pg_adv": targets.pg_advantages}

    def _optimize(self, loss: ImpalaLoss, lr: float) -> tuple[torch.Tensor, bool]:
        """Backward, gradients summed over the group and clipped, then the optimizer's step; returns the
        gradient norm before clipping and whether the step was taken."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss.total.backward()
        if self.group is not None:
            self.group.sync_gradients(self.model.parameters(), self.config.loss_reduction)
        clip = self.config.grad_norm_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), clip if clip > 0 else float("inf")
        )
        finite = (
            bool(torch.isfinite(loss.total))
            and bool(torch.isfinite(grad_norm))
            and bool(torch.isfinite(loss.vtrace.vs).all())  # PopArt's statistics follow the targets
        )
        if self.group is not None:  # one rank's bad batch skips the step on every rank
            finite = self.group.all_true(finite, self.device)
        if finite:
            self.optimizer.step()
        else:
            # A batch whose loss or gradient is NaN/inf (finite but huge inputs overflow the forward
            # pass) must not reach the weights, the actors or a checkpoint: drop this step, go on.
            self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, finite

    def _metrics(self, loss: ImpalaLoss, grad_norm: torch.Tensor, lr: float) -> dict[str, float]:
        """The update's losses, gradient norm, learning rate and PopArt statistics, by their log names."""
        metrics = {
            "losses/total": float(loss.total.detach()),
            # the names launch_ppo logs too (learner.ppo_learner.METRIC_KEYS): one scheme across launchers
            "losses/policy_loss": float(loss.pg_loss.detach()),
            "losses/value_loss": float(loss.baseline_loss.detach()),
            "losses/entropy": float(loss.mean_entropy),
            "losses/grad_norm": float(grad_norm),  # before clipping
            "learner/skipped_updates": float(self.skipped_updates),
            "charts/learning_rate": lr,
        }
        if self.moves_popart:  # without PopArt no popart/ columns: they would be an untouched mu 0, sigma 1
            state = self.model.baseline.state
            for i, name in enumerate(self.task_names or ("",)):  # one value scale per task
                suffix = f"/{name}" if name else ""
                metrics[f"popart/mu{suffix}"] = float(state.mu[i])
                metrics[f"popart/sigma{suffix}"] = float(state.sigma[i])
        return metrics

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "updates": self.updates,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.updates = int(state["updates"])


class ImpalaTrainer:
    """The runtime's Trainer for IMPALA: collects B unrolls, stacks them time-major, runs one V-trace
    update."""

    def __init__(
        self,
        config: ImpalaConfig,
        run: RunConfig,
        env: EnvInfo,
        group: LearnerGroup | None = None,
        tasks: Sequence[EnvInfo] = (),
    ) -> None:
        """``group``: this process is one rank of a data-parallel learner group (``learner.group``);
        rank 0 scatters each batch, the other ranks run :meth:`follow`. ``tasks``: a multi-task
        run's envs in task order (``env`` is the first; ``impala.envs.probe.probe_tasks`` checked
        that one network fits them all)."""
        env.require_discrete("launch_impala")
        self.num_tasks = max(1, len(tasks))
        task_names = tuple(t.spec.id for t in tasks) if len(tasks) > 1 else ()
        self.group = group
        self.config = config
        self.max_abs_value = run.max_abs_value
        self.frames_per_step = env.frames_per_step
        total_frames = run.total_frames or int((run.total_steps or 0) * env.frames_per_step)
        if not total_frames:
            raise ConfigError(
                "IMPALA needs a run length (--total-frames or --total-steps) for its learning-rate schedule"
            )
        torch.manual_seed(run.seed)  # the network's initialization is part of the run's seed
        try:
            model = build_model(
                config.model,
                env.obs_shape,
                env.num_actions,
                use_lstm=config.use_lstm,
                init=config.init,
                beta=config.popart_beta,
                num_tasks=self.num_tasks,
                obs_norm=config.obs_norm,
            )
        except ValueError as e:  # the model kind does not fit this env's observations
            raise ConfigError(f"--model {config.model}: {e}") from None
        device = resolve_device(run.device)
        if group is not None and device.type == "cuda":
            device = torch.device("cuda", group.local_rank)  # one GPU per rank of this host
        self.learner = VTraceLearner(
            model,
            config,
            device,
            total_frames=total_frames,
            seed=run.seed,
            group=group,
            task_names=task_names,
        )
        core = model.core.hidden_size if config.use_lstm else 0
        # Atari's stacked frames: each frame travels once (the actors check their env stacks that way)
        stacked = (
            env.spec.atari and env.obs_dtype == "uint8" and len(env.obs_shape) == 3 and env.obs_shape[0] > 1
        )
        frame_stack = env.obs_shape[0] if stacked and config.frame_dedup else 0
        self.schema = impala_unroll_schema(
            run.unroll_length,
            env.obs_shape,
            env.obs_dtype,
            env.num_actions,
            core,
            frame_stack,
            self.num_tasks,
        )
        self.agent = ImpalaAgentSpec(
            config.model,
            config.use_lstm,
            config.popart_beta,
            frame_stack,
            self.num_tasks,
            config.obs_norm,
            sync_rounds(config, run),
        )
        self._pending: list[Mapping[str, np.ndarray]] = []
        self._sources: list[int] = []  # actor id of each pending unroll, to name them if a batch is bad
        self._slot = 0  # the staging buffer set the next batch goes to (two alternate)
        self._closed = False  # rank 0 released the followers

    @property
    def device(self) -> torch.device:
        return self.learner.device

    @property
    def queue_size(self) -> int:
        """One batch waits while the learner updates; every unroll buffered beyond that only adds policy
        lag."""
        return self.config.batch_size

    def ingest(self, msg: wire.Message, version: int) -> None:
        self._pending.append(msg.arrays)
        self._sources.append(msg.actor)

    def ready(self) -> bool:
        return len(self._pending) >= self.config.batch_size

    @property
    def overlaps_updates(self) -> bool:
        """Whether the runtime may stage the next batch (:meth:`stage_update`) while this one trains on
        another thread; a learner group stages and steps in lockstep with its ranks instead."""
        return self.group is None

    def stage_update(self, frames_done: int) -> Callable[[], dict[str, float]]:
        """Take the next B unrolls, stage them here, and return the update that trains on them.

        The runtime runs that update on its own thread while the next batch arrives and is staged on
        this one (stacking, frame-stack rebuild and layout: about 7% of a CPU learner's work, then
        off its critical path). Batches alternate between two staging buffer sets, so staging batch
        n+1 never writes what update n reads; the runtime waits for update n before staging n+2.
        The update is the same one :meth:`update` runs, on the same batch."""
        B = self.config.batch_size
        batch = self.learner.stage(self._pending[:B], self.schema, slot=self._slot)
        self._slot ^= 1
        sources = sorted(set(self._sources[:B]))
        del self._pending[:B], self._sources[:B]
        return lambda: self._train(batch, sources, frames_done)

    @contextlib.contextmanager
    def _group_errors(self, when: str = "") -> Iterator[None]:
        """A collective that fails because a learner rank is gone stops the run with one LearnerGroupError
        (its checkpoint stays; --resume continues); any other error passes through."""
        try:
            yield
        except RuntimeError as e:
            if self.group is None or not lost_peer(e):
                raise
            self._closed = True  # the group is broken: there is no one to release
            raise LearnerGroupError(f"a learner rank stopped{when} ({peer_error(e)})") from None

    def update(self, frames_done: int) -> dict[str, float]:
        B = self.config.batch_size
        if self.group is None:
            return self.stage_update(frames_done)()
        with self._group_errors():
            self.group.command(UPDATE, frames_done)
            staged = self.learner.stage_host(self._pending[:B], self.schema)
            batch = self.learner.prepare(self.group.scatter(staged, self.schema, B), slot=0)
        sources = sorted(set(self._sources[:B]))
        del self._pending[:B], self._sources[:B]
        return self._train(batch, sources, frames_done)

    def _train(
        self, batch: Mapping[str, torch.Tensor], sources: list[int], frames_done: int
    ) -> dict[str, float]:
        skipped_before = self.learner.skipped_updates
        with self._group_errors(" during an update"):
            metrics = self.learner.train(batch, frames_done=frames_done)
        if self.learner.skipped_updates > skipped_before:
            log.warning(
                "skipped %d update step(s) with a non-finite loss or gradient; the batch came from actors %s",
                self.learner.skipped_updates - skipped_before,
                sources,
            )
        return metrics

    def params(self) -> dict[str, np.ndarray]:
        return state_dict_arrays(self.learner.model)

    def follow(self) -> int:
        """A follower rank: take each update's share from rank 0 and step with the group, until told to
        stop."""
        updates = 0
        while True:
            cmd, frames_done = self.group.command()
            if cmd == STOP:
                return updates
            if cmd == SYNC:  # rank 0 resumed: its trainer state, which this host may not have on disk
                self.learner.load_state_dict(self.group.broadcast_state())
                continue
            batch = self.learner.prepare(
                self.group.scatter(None, self.schema, self.config.batch_size), slot=0
            )
            self.learner.train(batch, frames_done=frames_done)
            updates += 1

    def close(self) -> None:
        """Rank 0 at the end of the run: release the followers (once)."""
        if self.group is not None and self.group.rank == 0 and not self._closed:
            self._closed = True
            self.group.command(STOP)

    def validate(self, arrays: Mapping[str, np.ndarray]) -> str | None:
        """Values the schema cannot express: actions must index the policy's logits, float arrays
        stay within --max-abs-value (uint8 frames are bounded by their dtype), and the behaviour
        policy must give each taken action a log-probability the update survives."""
        actions = arrays["actions"]
        n = arrays["behaviour_logits"].shape[-1]
        if actions.size and (actions.min() < 0 or actions.max() >= n):
            return f"actions outside [0, {n})"
        if "task" in arrays and not 0 <= int(arrays["task"][0]) < self.num_tasks:
            return f"task {int(arrays['task'][0])} outside [0, {self.num_tasks})"
        floats = tuple(n for n in ("obs", "behaviour_logits", "rewards") if n in arrays)
        problem = wire.check_bounded(arrays, self.max_abs_value, floats)
        return problem or untrainable_behaviour(arrays["behaviour_logits"], actions)

    def state_dict(self) -> dict[str, Any]:
        return self.learner.state_dict()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.learner.load_state_dict(state)
        if self.group is not None and self.group.rank == 0:  # the followers resume from the same state
            with self._group_errors():
                self.group.command(SYNC)
                self.group.broadcast_state(self.learner.state_dict())
