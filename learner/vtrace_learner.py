"""The IMPALA learner: its compute (``VTraceLearner``: ``step(batch) -> metrics``; no I/O, no
sockets, no threads) and its adapter to the runtime (``ImpalaTrainer``).

One update: forward the network over ``[T+1, B]`` observations, V-trace from
the behaviour and target logits, the (PopArt-)IMPALA loss, RMSProp with a
global gradient-norm clip and a linearly decaying learning rate, then the
PopArt statistics update (which rescales the value head so its unnormalized
outputs are preserved).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import os
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from impala.algos.impala_losses import (
    BatchTargets,
    entropy_per_step,
    impala_loss,
    popart_impala_loss,
    vtrace_targets,
)
from impala.algos.popart import unnormalize
from impala.algos.task_gradients import task_gradient_stats, task_gradients
from impala.envs.probe import EnvInfo
from impala.nets.impala_net import ImpalaNet, build_model
from impala.options import ConfigError
from impala.run.config import ImpalaConfig, RunConfig, resolve_device
from impala.run.orphans import exit_when_orphaned
from impala.transport import wire
from impala.transport.messages import ImpalaAgentSpec
from impala.transport.params import state_dict_arrays
from impala.transport.trajectory import (
    TrajectorySchema,
    impala_unroll_schema,
    rebuild_frame_stacks,
    stack_time_major,
)
from learner.group import (
    STOP,
    SYNC,
    UPDATE,
    LearnerGroup,
    LearnerGroupError,
    Membership,
    init_group,
    join_group,
    lost_peer,
    peer_error,
)

log = logging.getLogger(__name__)

IMPALA_UNROLL = 32  # T when --unroll-length is 0 (the learner picks)


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


@torch.no_grad()
def step_fraction(optimizer: torch.optim.Optimizer) -> float:
    """How much of the learning rate the optimizer's last step used, averaged over all weights.

    RMSprop steps ``lr * g / (sqrt(v) + eps)``: per weight, ``sqrt(v) / (sqrt(v) + eps)`` of
    a sign step of size lr. Near 1, eps is negligible; near 0, eps dominates and the network
    barely moves (measured on Pong, docs/PONG.md: 0.009 with the paper's eps on mean-reduced losses). Adam:
    the
    same with the bias-corrected ``v``.
    """
    total, count = 0.0, 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p)
            if not state:
                continue
            if "square_avg" in state:
                root, eps = state["square_avg"].sqrt(), group["eps"]
            elif "exp_avg_sq" in state:
                beta2 = group["betas"][1]
                correction = 1.0 - beta2 ** float(state["step"])
                root, eps = (state["exp_avg_sq"] / correction).sqrt(), group["eps"]
            else:
                continue
            total += float((root / (root + eps)).sum())
            count += root.numel()
    return total / count if count else float("nan")


def logit_spread(logits: torch.Tensor) -> float:
    """Std across the batch's states of the log-policy, averaged over actions.

    Zero when the policy ignores the state (the same distribution everywhere): the Pong
    failed Pong run (docs/PONG.md) showed 0.0007 after 4M frames. Log-softmax first, so a shift of all
    logits (which does not change the policy) does not count.
    """
    log_p = torch.log_softmax(logits.float().reshape(-1, logits.shape[-1]), dim=-1)
    return float(log_p.std(dim=0).mean()) if log_p.shape[0] > 1 else 0.0


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


# The learner's torch threads where --torch-threads is not given: the cores its local actors leave, and for
# image observations with actors at the learner's own priority (--actor-nice 0) at least this many
# (RunConfig.cpu_threads says why; launch_impala makes idle threads sleep, not spin).
LEARNER_THREADS = 2


def learner_threads(run: RunConfig, env: EnvInfo, ranks_here: int | None = None) -> int:
    """Torch threads for one learner rank. Image observations (a conv net, whose update parallelizes) get
    at least LEARNER_THREADS unless the actors were niced below the learner by ``--actor-nice`` alone: with
    ``--cpu-affinity learner-first`` (opt-in) the second thread takes the actors' core
    whenever the update can use it (Pong, 2 actors on 2 cores: 0.75-0.89 of the cost model's ceiling,
    four runs of five at 0.83 or above, against 0.75-0.80 for one pinned thread, BENCHMARKS.md).
    Vector observations (an MLP of small layers) keep the cores the actors leave, at least 1: there a
    second thread only adds synchronization (CartPole, 2 actors on 2 cores: 18% fewer frames/s).
    ``ranks_here``: the group's ranks that share this machine's CPUs (all --learners on one machine; a
    group across hosts has one per host)."""
    at_least = LEARNER_THREADS if len(env.obs_shape) == 3 else 1
    return max(1, run.cpu_threads(at_least=at_least) // (ranks_here or run.learners))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX), where oneDNN's bf16
    convolutions beat float32 (2-core AMD EPYC: 14-16 vs 20-22 ms per minibatch step); elsewhere they
    are emulated (on the 2-core Intel Xeon of the earlier benchmarks bf16 autocast was slower, 416 vs
    336 ms per update)."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")  # torch.cpu's own CPUID checks
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def bf16_torso_cost(model: ImpalaNet, frames: int = 32, repeats: int = 3) -> tuple[float, float]:
    """(fp32 ms, bf16 ms): the best of ``repeats`` forward and backward passes of ``model``'s image torso over
    ``frames`` observations on this CPU, in float32 and under bf16 autocast. A second or less at start, and
    the real figure: whether torso bf16 pays depends on the kernels torch has for this CPU (oneDNN's native
    bf16 with AVX512-BF16 or AMX; emulated bf16 elsewhere with AVX-512; ATen's slow convolution path on an
    AVX2-only CPU, measured 7.8x slower than fp32 per minibatch step), more than on its flags."""
    import copy
    import time

    torso = copy.deepcopy(model.torso).cpu()
    obs = torch.randint(0, 256, (frames, *model.torso.obs_shape), dtype=torch.uint8)
    times = {}
    for dtype in (None, torch.bfloat16):
        torso.compute_dtype = dtype
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass of each also warms up
            torso.zero_grad(set_to_none=True)
            start = time.perf_counter()
            torso(obs).sum().backward()
            best = min(best, time.perf_counter() - start)
        times[dtype] = best * 1e3
    return times[None], times[torch.bfloat16]


def torso_precision(choice: str, device: torch.device, model: ImpalaNet) -> str:
    """``--precision`` checked for this learner: bf16 covers an image torso only; asking for it with any
    other torso is a :class:`ConfigError`. On a CPU, bf16 is timed against fp32 at start and a warning says
    what it costs where it is slower (the user asked for it: it stays)."""
    if choice == "bf16" and not hasattr(model.torso, "compute_dtype"):
        raise ConfigError(
            f"--precision bf16 runs an image torso's convolutions in bf16; this run's network has a "
            f"{type(model.torso).__name__} torso (vector observations): use --precision fp32"
        )
    if choice == "bf16" and device.type == "cpu":
        fp32_ms, bf16_ms = bf16_torso_cost(model)
        native = cpu_has_native_bf16()
        if bf16_ms > fp32_ms:
            log.warning(
                "--precision bf16 is slower than fp32 on this CPU: the torso's forward and backward pass "
                "took %.1f ms in bf16 against %.1f ms in fp32 (%.1fx)%s; --precision fp32 trains faster here",
                bf16_ms,
                fp32_ms,
                bf16_ms / fp32_ms,
                "" if native else " (no native bf16, AVX512-BF16 or AMX)",
            )
        else:
            log.info(
                "learner precision: bf16 in the image torso (%.1f ms against %.1f ms in fp32 per forward and "
                "backward pass on this CPU)",
                bf16_ms,
                fp32_ms,
            )
    elif choice == "bf16":
        log.info("learner precision: bf16 in the image torso")
    return choice


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


def select_unrolls(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x.index_select(1, idx)`` (unrolls ``idx`` of a time-major [T, B, ...] array) in ``x``'s own memory
    layout: ``index_select`` returns a contiguous tensor, which would undo the frames' channels-last layout
    (``prepare``) at every minibatch."""
    if x.is_contiguous():
        return x.index_select(1, idx)
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # x.permute(order) is contiguous
    inverse = [order.index(d) for d in range(x.dim())]
    return x.permute(order).index_select(order.index(1), idx).permute(inverse)


class VTraceLearner:
    """Owns the model and optimizer; ``step`` runs one update on a time-major batch."""

    HEALTH_EVERY = 10
    # A multi-task run's per-task gradients take one backward pass per task: on every 200th update (about
    # 3% more backward work; every few seconds on a CPU learner, so each 30-second row averages several);
    # 0: never
    TASK_GRADIENTS_EVERY = 200
    TASK_GRADIENTS_WINDOW = 16  # measurements averaged in each report (about a minute on a CPU learner)

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
        self.skipped_updates = 0  # steps dropped because their loss or gradient was not finite
        self._health: dict[str, float] = {}
        self._task_sums: torch.Tensor | None = None  # multi-task: per-task sums since the last report
        # multi-task: per task, its gradient share and cosine at the last TASK_GRADIENTS_WINDOW measurements
        self._task_grads: collections.deque[torch.Tensor] = collections.deque(
            maxlen=self.TASK_GRADIENTS_WINDOW
        )
        # the weights every task's steps reach (all but the per-task value heads)
        self._shared_params = [p for n, p in self.model.named_parameters() if not n.startswith("baseline.")]
        self._shuffle = torch.Generator().manual_seed(seed)
        self._staging: dict[int, dict[str, torch.Tensor]] = {}  # buffer set (slot) -> arrays
        self._staging_b = 0
        self._laid_out: dict[int, torch.Tensor] = {}  # slot -> the frames prepare laid out last

    def learning_rate(self, frames_done: int) -> float:
        if not self.config.lr_decay:
            return self.config.learning_rate
        return self.config.learning_rate * max(0.0, 1.0 - frames_done / self.total_frames)

    def stage(
        self, unrolls: list[Mapping[str, np.ndarray]], schema: TrajectorySchema, slot: int = 0
    ) -> dict[str, torch.Tensor]:
        """Stack B unrolls time-major straight into staging buffers and move them to the device.

        The buffers are allocated once per ``slot`` (page-locked on CUDA, so the host-to-device copy
        is an asynchronous DMA, not a second staging copy); on CPU the batch is those buffers. Reusing
        a slot is safe once the update that read it has returned (``step`` reads its losses back to
        the host, which waits for the copy): a batch staged while another trains takes the other slot.
        """
        return self.prepare(self.stage_host(unrolls, schema, slot), slot)

    def stage_host(
        self, unrolls: list[Mapping[str, np.ndarray]], schema: TrajectorySchema, slot: int = 0
    ) -> dict[str, torch.Tensor]:
        """Stack B unrolls time-major into the (reused, on CUDA page-locked) host staging buffers of
        ``slot``."""
        B = len(unrolls)
        if self._staging_b != B:
            self._staging, self._staging_b = {}, B
        if slot not in self._staging:
            pin = self.device.type == "cuda"
            self._staging[slot] = {
                a.name: torch.empty(
                    (a.shape[0], B, *a.shape[1:]),
                    dtype=torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype,
                    pin_memory=pin,
                )
                for a in schema.arrays
            }
        buffers = self._staging[slot]
        stack_time_major(unrolls, schema, out={k: v.numpy() for k, v in buffers.items()})
        return dict(buffers)

    def prepare(self, staged: Mapping[str, torch.Tensor], slot: int | None = None) -> dict[str, torch.Tensor]:
        """Host arrays -> the device, and each frame-once unroll's stacks rebuilt there, laid out for the
        torso. With a ``slot``, the frames are laid out over the previous batch of that slot (the same
        reuse rule as :meth:`stage`'s buffers); without one, into fresh memory."""
        if self.device.type == "cpu":
            batch = dict(staged)
        else:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in staged.items()}
        if (
            "frames" in batch
        ):  # each frame travelled once: rebuild the stacks here (on the device, when there is one)
            batch["obs"] = rebuild_frame_stacks(batch.pop("obs_head"), batch.pop("frames"), batch["first"])
        pixel_norm = getattr(self.model.torso, "pixel_norm", None)
        if pixel_norm is not None:  # --obs-norm: this batch's frames join the statistics it is normalized by
            self._observe_pixels(pixel_norm, batch["obs"])
        lay_out = getattr(self.model.torso, "lay_out", None)  # image torsos
        if lay_out is not None:
            batch["obs"] = lay_out(batch["obs"], out=self._laid_out.get(slot) if slot is not None else None)
            if slot is not None:
                self._laid_out[slot] = batch["obs"]
        return batch

    def _observe_pixels(self, pixel_norm: Any, frames: torch.Tensor) -> None:
        """Update the pixel statistics from the batch's frames; in a learner group each rank holds some of the
        unrolls and the moments are summed over the ranks, so every rank merges the whole batch's, as one
        learner would (and all normalize and publish alike)."""
        pixel_norm.observe(frames, allreduce=self.group.allreduce_sum if self.group is not None else None)

    def train(self, batch: Mapping[str, torch.Tensor], *, frames_done: int) -> dict[str, float]:
        """All the updates one batch gets: ``epochs`` passes, each over ``minibatches`` disjoint
        sets of whole unrolls in a fresh random order (PPO's loop; 1 x 1 is IMPALA's single step).
        Every pass recomputes V-trace against the current policy. Returns the last step's metrics."""
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

    def _rewards_discounts(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.config
        rewards = batch["rewards"]
        if cfg.reward_clip > 0:
            rewards = rewards.clamp(-cfg.reward_clip, cfg.reward_clip)
        return rewards, (~batch["dones"]).float() * cfg.discount

    @staticmethod
    def _core_state(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
        if "core_state" not in batch:
            return None
        cs = batch["core_state"]  # [2, B, H] after time-major stacking of [2, H]
        return cs[0].unsqueeze(0).contiguous(), cs[1].unsqueeze(0).contiguous()

    @staticmethod
    def _task_ids(batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        if "task" not in batch:  # [1, B]: one task per unroll, for every step of it and its bootstrap
            return None
        return batch["task"].expand(batch["first"].shape[0], -1)

    @torch.no_grad()
    def _batch_targets(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``--targets per_batch``: V-trace's targets and advantages from the network as the batch
        arrives, in return units, for every step of every pass (``target_vs``, ``target_pg_adv``)."""
        cfg = self.config
        task_ids = self._task_ids(batch)
        out, _ = self.model(batch["obs"], batch["first"], self._core_state(batch), task_ids)
        values = out.values.float()
        if cfg.popart:
            values = unnormalize(self.model.baseline.state, values, 0 if task_ids is None else task_ids)
        rewards, discounts = self._rewards_discounts(batch)
        targets = vtrace_targets(
            batch["behaviour_logits"],
            out.policy_logits.float()[:-1],
            batch["actions"],
            discounts,
            rewards,
            values[:-1],
            values[-1],
            pg_clip=cfg.pg_clip or None,
            lambda_=cfg.vtrace_lambda,
        )
        return {"target_vs": targets.vs, "target_pg_adv": targets.pg_advantages}

    def step(self, batch: Mapping[str, torch.Tensor], *, frames_done: int) -> dict[str, float]:
        """One update. ``batch`` holds the impala_unroll_schema arrays stacked as [T(+1), B, ...]."""
        # Health metrics cost ~10% of a small CPU update, and the console and CSV show one row
        # every few seconds: measure them on every HEALTH_EVERY-th update and repeat the last values.
        measure = self.updates % self.HEALTH_EVERY == 0
        T = batch["actions"].shape[0]
        task_ids = self._task_ids(batch)
        fixed = BatchTargets(batch["target_vs"], batch["target_pg_adv"]) if "target_vs" in batch else None
        logits, values = self._forward(batch, T, fixed, task_ids, measure)
        loss = self._loss(batch, logits, values, T, fixed, task_ids)
        every = self.TASK_GRADIENTS_EVERY  # 0: never
        if self.task_names and every and self.updates % every == 0:
            self._add_task_gradients(loss.total, logits, values, task_ids)
        lr = self.learning_rate(frames_done)
        grad_norm = self._apply(loss, lr, task_ids, T)
        self.updates += 1
        metrics = self._metrics(loss, grad_norm, lr)
        if self.task_names:
            self._add_task_health(loss, logits[:T], values[:T], task_ids[:T])
        if measure:
            self._health = self._measure_health(loss, logits, values, self.model.torso)
            self._health.update(self._task_health())
        metrics.update(self._health)
        return metrics

    def _forward(
        self,
        batch: Mapping[str, torch.Tensor],
        T: int,
        fixed: BatchTargets | None,
        task_ids: torch.Tensor | None,
        measure: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The network's logits and values over the unroll; the torso tracks its activity if ``measure``."""
        core_state = self._core_state(batch)
        torso = self.model.torso
        torso.track_activity = measure
        # Fixed targets need no bootstrap value: the forward pass (and so the backward) skips step T,
        # 1/(T+1) of the update's network work. The outputs of steps 0..T-1 do not depend on step T.
        steps = T if fixed is not None else T + 1
        if task_ids is not None:
            task_ids = task_ids[:steps]
        out, _ = self.model(batch["obs"][:steps], batch["first"][:steps], core_state, task_ids)
        torso.track_activity = False
        return out.policy_logits.float(), out.values.float()

    def _loss(
        self,
        batch: Mapping[str, torch.Tensor],
        logits: torch.Tensor,
        values: torch.Tensor,
        T: int,
        fixed: BatchTargets | None,
        task_ids: torch.Tensor | None,
    ) -> Any:
        """The IMPALA loss (with PopArt's normalized values when ``--popart``) of this batch."""
        cfg = self.config
        # with fixed targets the bootstrap value is not read (impala_loss, popart_impala_loss)
        bootstrap = values[T] if fixed is None else torch.zeros_like(values[0])
        rewards, discounts = self._rewards_discounts(batch)
        common = dict(
            baseline_cost=cfg.baseline_cost,
            entropy_cost=cfg.entropy_cost,
            reduction=cfg.loss_reduction,
            pg_clip=cfg.pg_clip or None,
            normalize_advantages=cfg.advantage_norm,
            lambda_=cfg.vtrace_lambda,
            allreduce=self.group.allreduce_sum if self.group else None,
            targets=fixed,
        )
        if cfg.popart:
            return popart_impala_loss(
                batch["behaviour_logits"],
                logits[:T],
                batch["actions"],
                discounts,
                rewards,
                values[:T],
                bootstrap,
                self.model.baseline.state,
                0 if task_ids is None else task_ids[:T],
                **common,
            )
        return impala_loss(
            batch["behaviour_logits"],
            logits[:T],
            batch["actions"],
            discounts,
            rewards,
            values[:T],
            bootstrap,
            **common,
        )

    def _apply(self, loss: Any, lr: float, task_ids: torch.Tensor | None, T: int) -> torch.Tensor:
        """Backward, gradients summed over the group and clipped, then the optimizer (and PopArt) step;
        returns the gradient norm before clipping."""
        cfg = self.config
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.zero_grad(set_to_none=True)
        loss.total.backward()
        if self.group is not None:
            self.group.sync_gradients(self.model.parameters(), cfg.loss_reduction)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), cfg.grad_norm_clip if cfg.grad_norm_clip > 0 else float("inf")
        )
        finite = bool(torch.isfinite(loss.total)) and bool(torch.isfinite(grad_norm))
        if finite and cfg.popart:
            finite = bool(torch.isfinite(loss.vtrace.vs).all())
        if self.group is not None:  # one rank's bad batch skips the step on every rank
            finite = self.group.all_true(finite, self.device)
        if finite:
            self.optimizer.step()
            if cfg.popart:
                self.model.baseline.update(
                    loss.vtrace.vs,
                    0 if task_ids is None else task_ids[:T],
                    allreduce=self.group.allreduce_sum if self.group else None,
                )
        else:
            # A batch whose loss or gradient is NaN/inf (finite but huge inputs overflow the forward
            # pass) must not reach the weights, the actors or a checkpoint: drop this step, go on.
            self.optimizer.zero_grad(set_to_none=True)
            self.skipped_updates += 1
        return grad_norm

    def _metrics(self, loss: Any, grad_norm: torch.Tensor, lr: float) -> dict[str, float]:
        """The update's losses, gradient norm, learning rate and PopArt statistics, by their log names."""
        state = self.model.baseline.state
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
        if not self.config.popart:
            pass  # no PopArt, no popart/ columns: its statistics would be an untouched mu 0, sigma 1
        elif self.task_names:  # one value scale per task
            for i, name in enumerate(self.task_names):
                metrics[f"popart/mu/{name}"] = float(state.mu[i])
                metrics[f"popart/sigma/{name}"] = float(state.sigma[i])
        else:
            metrics["popart/mu"] = float(state.mu[0])
            metrics["popart/sigma"] = float(state.sigma[0])
        return metrics

    @torch.no_grad()
    def _measure_health(
        self, loss: Any, logits: torch.Tensor, values: torch.Tensor, torso: torch.nn.Module
    ) -> dict[str, float]:
        cfg = self.config
        health = {
            "health/step_fraction": step_fraction(self.optimizer),
            "health/logit_spread": logit_spread(logits.detach()),
        }
        rho = loss.vtrace.log_rhos.exp()
        # Off-policyness of the batch: how often V-trace truncates (rho > 1) and, with
        # --pg-clip, how often the surrogate's ratio sits outside [1 - eps, 1 + eps].
        health["health/rho_truncated"] = float((rho > 1.0).float().mean())
        if cfg.pg_clip:
            health["losses/clip_fraction"] = float(((rho - 1.0).abs() > cfg.pg_clip).float().mean())
        # How much of the targets' variance the critic explains (PPO's explained_variance):
        # near 0, the critic cannot see what predicts the return and advantages are noise.
        target_var = loss.value_targets.var()
        err_var = (loss.value_targets - values[: loss.value_targets.shape[0]].detach()).var()
        health["health/explained_variance"] = (
            float(1.0 - err_var / target_var) if target_var > 0 else float("nan")
        )
        for layer, alive in getattr(torso, "activity", {}).items():
            health[f"health/alive_{layer}"] = alive
        return health

    @torch.no_grad()
    def _add_task_health(
        self, loss: Any, logits: torch.Tensor, values: torch.Tensor, task_ids: torch.Tensor
    ) -> None:
        """Add this minibatch's per-task sums to the ones :meth:`_task_health` reports (multi-task runs)."""
        per_step = torch.stack(
            [
                entropy_per_step(logits.detach()),
                loss.pg_advantages.abs(),
                (loss.value_targets - values.detach()).abs(),
                torch.ones_like(values),
            ],
            dim=-1,
        ).reshape(-1, 4)
        if self._task_sums is None:
            self._task_sums = torch.zeros(
                len(self.task_names), 4, dtype=torch.float64, device=per_step.device
            )
        self._task_sums.index_add_(0, task_ids.reshape(-1), per_step.double())

    def _add_task_gradients(
        self, total: torch.Tensor, logits: torch.Tensor, values: torch.Tensor, task_ids: torch.Tensor
    ) -> None:
        """Keep this minibatch's per-task gradient share and cosine (on the shared weights) for
        :meth:`_task_health`. Reads the graph the update's backward pass then uses; changes no
        weight and no ``.grad``."""
        rows = task_gradients(
            total, (logits, values), task_ids[: logits.shape[0]], len(self.task_names), self._shared_params
        )
        share, cosine = task_gradient_stats(rows.float())
        self._task_grads.append(torch.stack([share, cosine], dim=1).double().cpu())  # [K, 2]

    def _task_health(self) -> dict[str, float]:
        """Per task, over the minibatches since the last report: the policy's entropy; the mean |advantage|
        that multiplies its log-probabilities in the policy term (after PopArt's scaling and the minibatch
        standardization) and the task's share of their sum (its weight in the policy gradient); its share
        of the steps trained; and the value error in the regression's units. A task the others crowd out
        shows a weight share far below its step share. And, averaged over the last TASK_GRADIENTS_WINDOW
        measurements (one every TASK_GRADIENTS_EVERY updates): the task's share of the summed per-task
        gradient norms on the shared weights, and the cosine of its gradient with the other tasks' summed
        gradient (below 0: it pulls the shared weights against them)."""
        out = {}
        if self._task_grads:
            window = torch.stack(list(self._task_grads))  # [N, K, 2], NaN where a task had no step
            mean = window.nansum(0) / torch.isfinite(window).sum(0).clamp(min=1)
            seen = torch.isfinite(window).any(0)
            for i, name in enumerate(self.task_names):
                if seen[i, 0]:
                    out[f"tasks/{name}/grad_share"] = float(mean[i, 0])
                if seen[i, 1]:
                    out[f"tasks/{name}/grad_cosine"] = float(mean[i, 1])
        sums, self._task_sums = self._task_sums, None
        if sums is None:
            return out
        sums = sums.cpu()
        total_adv, total_steps = float(sums[:, 1].sum()), float(sums[:, 3].sum())
        for i, name in enumerate(self.task_names):
            entropy, adv, err, n = (float(x) for x in sums[i])
            if not n:
                continue
            out[f"tasks/{name}/entropy"] = entropy / n
            out[f"tasks/{name}/adv_abs"] = adv / n
            out[f"tasks/{name}/pg_weight_share"] = adv / total_adv if total_adv > 0 else float("nan")
            out[f"tasks/{name}/step_share"] = n / total_steps
            out[f"tasks/{name}/value_error"] = err / n
        return out

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

    def update(self, frames_done: int) -> dict[str, float]:
        B = self.config.batch_size
        if self.group is None:
            return self.stage_update(frames_done)()
        try:
            self.group.command(UPDATE, frames_done)
            staged = self.learner.stage_host(self._pending[:B], self.schema)
            batch = self.learner.prepare(self.group.scatter(staged, self.schema, B), slot=0)
        except RuntimeError as e:
            if not lost_peer(e):
                raise
            self._closed = True  # the group is broken: there is no one to release
            raise LearnerGroupError(f"a learner rank stopped ({peer_error(e)})") from None
        sources = sorted(set(self._sources[:B]))
        del self._pending[:B], self._sources[:B]
        return self._train(batch, sources, frames_done)

    def _train(
        self, batch: Mapping[str, torch.Tensor], sources: list[int], frames_done: int
    ) -> dict[str, float]:
        skipped_before = self.learner.skipped_updates
        try:
            metrics = self.learner.train(batch, frames_done=frames_done)
        except RuntimeError as e:
            if self.group is None or not lost_peer(e):
                raise
            self._closed = True  # the group is broken: there is no one to release
            raise LearnerGroupError(f"a learner rank stopped during an update ({peer_error(e)})") from None
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
            try:
                self.group.command(SYNC)
                self.group.broadcast_state(self.learner.state_dict())
            except RuntimeError as e:
                if not lost_peer(e):
                    raise
                self._closed = True  # the group is broken: there is no one to release
                raise LearnerGroupError(f"a learner rank stopped ({peer_error(e)})") from None


def start_group(
    impala: ImpalaConfig,
    run: RunConfig,
    env: EnvInfo,
    tasks: Sequence[EnvInfo] = (),
    member: Membership | None = None,
) -> LearnerGroup | None:
    """--learners G > 1: start G-1 follower processes here, each given this run's resolved settings, and join
    the group as rank 0. ``member``: torchrun started the ranks (across hosts); join them and send them
    this run's resolved settings (:func:`follower_settings` reads them)."""
    if member is not None:
        backend = "nccl" if resolve_device(run.device).type == "cuda" else "gloo"
        try:
            group = join_group(member, backend, run.bind)
            group.broadcast_json({"run": dataclasses.asdict(run), "impala": dataclasses.asdict(impala)})
        except RuntimeError as e:  # a rank that never joined (it stopped on bad input), or went at once
            raise LearnerGroupError(f"the learner group did not form ({peer_error(e)})") from None
        log.info(
            "learner group: %d ranks across hosts (torchrun, rendezvous %s:%d), %s backend on %s; this is "
            "rank 0",
            member.world_size,
            member.master_addr,
            member.master_port,
            backend,
            os.environ.get("GLOO_SOCKET_IFNAME") or "the interface of this host's name",
        )
        return group
    if run.learners == 1:
        return None
    store = os.path.join(os.path.abspath(run.logdir), ".learner_group")
    if os.path.exists(store):
        os.remove(store)  # a rendezvous file left by an earlier run would hang this one
    ctx = multiprocessing.get_context("spawn")
    backend = "nccl" if resolve_device(run.device).type == "cuda" else "gloo"
    pids = []
    for rank in range(1, run.learners):
        proc = ctx.Process(
            target=follower_main,
            args=(rank, store, backend, impala, run, env, tuple(tasks), os.getpid()),
            name=f"learner-{rank}",
            daemon=True,
        )
        proc.start()
        pids.append(proc.pid)
    log.info(
        "learner group: %d ranks, %s backend, rank 0 pid %d, followers %s",
        run.learners,
        backend,
        os.getpid(),
        ", ".join(f"rank {r} pid {p}" for r, p in enumerate(pids, start=1)),
    )
    return init_group(0, run.learners, store, backend)


def follower_main(
    rank: int,
    store: str,
    backend: str,
    impala: ImpalaConfig,
    run: RunConfig,
    env: EnvInfo,
    tasks: tuple[EnvInfo, ...],
    parent_pid: int,
) -> None:
    """Learner rank > 0: the same trainer as rank 0 (same resolved settings), fed its share of each batch
    by rank 0."""
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s learner-{rank} %(levelname)s %(message)s")
    exit_when_orphaned(parent_pid)
    torch.set_num_threads(learner_threads(run, env))
    trainer = ImpalaTrainer(
        impala, run, env, group=init_group(rank, run.learners, store, backend), tasks=tasks
    )
    trainer.follow()  # a resumed run's state comes from rank 0 (SYNC), as across hosts


def follower_settings(group: LearnerGroup, **own: Any) -> tuple[ImpalaConfig, RunConfig]:
    """A follower across hosts: rank 0's resolved settings (sent by :func:`start_group`), with ``own``
    (this host's --bind, --device, ...) in place of rank 0's."""
    sent = group.broadcast_json()
    return ImpalaConfig(**sent["impala"]), RunConfig(**{**sent["run"], **own})
