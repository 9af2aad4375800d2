"""What the learner reports about each update beyond its losses: the health metrics (how much of the
learning rate the optimizer used, whether the policy still depends on the state, how off-policy the batch
was, how much of the targets the critic explains, which conv filters still fire) and, in a multi-task run,
each task's share of the policy gradient and of the shared weights' gradient. Measured around the update
step, never inside it."""

from __future__ import annotations

import collections
from typing import Sequence

import torch

from impala.algos.impala_losses import ImpalaLoss, entropy_per_step
from impala.algos.task_gradients import task_gradient_stats, task_gradients


@torch.no_grad()
def step_fraction(optimizer: torch.optim.Optimizer) -> float:
    """How much of the learning rate the optimizer's last step used, averaged over all weights.

    RMSprop steps ``lr * g / (sqrt(v) + eps)``: per weight, ``sqrt(v) / (sqrt(v) + eps)`` of
    a sign step of size lr. Near 1, eps is negligible; near 0, eps dominates and the network
    barely moves (measured on Pong, docs/PONG.md: 0.009 with the paper's eps on mean-reduced losses).
    Adam: the same with the bias-corrected ``v``.
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


class UpdateHealth:
    """The health metrics of one learner's updates (:meth:`after_step` returns them for every update)."""

    # Health metrics cost ~10% of a small CPU update, and the console and CSV show one row every few
    # seconds: measure them on every EVERY-th update and repeat the last values.
    EVERY = 10
    # A multi-task run's per-task gradients take one backward pass per task: on every 200th update (about
    # 3% more backward work; every few seconds on a CPU learner, so each 30-second row averages several);
    # 0: never
    TASK_GRADIENTS_EVERY = 200
    TASK_GRADIENTS_WINDOW = 16  # measurements averaged in each report (about a minute on a CPU learner)

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        task_names: Sequence[str],
        pg_clip: float,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.task_names = tuple(task_names)
        self.pg_clip = pg_clip
        self._last: dict[str, float] = {}
        self._task_sums: torch.Tensor | None = None  # multi-task: per-task sums since the last report
        # multi-task: per task, its gradient share and cosine at the last TASK_GRADIENTS_WINDOW measurements
        self._task_grads: collections.deque[torch.Tensor] = collections.deque(
            maxlen=self.TASK_GRADIENTS_WINDOW
        )
        # the weights every task's steps reach (all but the per-task value heads)
        self._shared_params = [p for n, p in model.named_parameters() if not n.startswith("baseline.")]

    def due(self, updates: int) -> bool:
        """Whether the update numbered ``updates`` measures (its torso then tracks its activity)."""
        return updates % self.EVERY == 0

    def before_backward(
        self,
        updates: int,
        total: torch.Tensor,
        logits: torch.Tensor,
        values: torch.Tensor,
        task_ids: torch.Tensor | None,
    ) -> None:
        """Multi-task runs, every TASK_GRADIENTS_EVERY updates: each task's gradient share and cosine on the
        shared weights, from the graph the update's backward pass then uses (changes no weight and no
        ``.grad``)."""
        every = self.TASK_GRADIENTS_EVERY
        if not (self.task_names and every and updates % every == 0):
            return
        rows = task_gradients(
            total, (logits, values), task_ids[: logits.shape[0]], len(self.task_names), self._shared_params
        )
        share, cosine = task_gradient_stats(rows.float())
        self._task_grads.append(torch.stack([share, cosine], dim=1).double().cpu())  # [K, 2]

    def after_step(
        self,
        measure: bool,
        loss: ImpalaLoss,
        logits: torch.Tensor,
        values: torch.Tensor,
        task_ids: torch.Tensor | None,
    ) -> dict[str, float]:
        """The health metrics after the optimizer's step: measured now if ``measure``, else the last ones."""
        T = loss.value_targets.shape[0]
        if self.task_names:
            self._add_task_health(loss, logits[:T], values[:T], task_ids[:T])
        if measure:
            self._last = self.measure(loss, logits, values)
            self._last.update(self._task_health())
        return self._last

    @torch.no_grad()
    def measure(self, loss: ImpalaLoss, logits: torch.Tensor, values: torch.Tensor) -> dict[str, float]:
        health = {
            "health/step_fraction": step_fraction(self.optimizer),
            "health/logit_spread": logit_spread(logits.detach()),
        }
        rho = loss.vtrace.log_rhos.exp()
        # Off-policyness of the batch: how often V-trace truncates (rho > 1) and, with
        # --pg-clip, how often the surrogate's ratio sits outside [1 - eps, 1 + eps].
        health["health/rho_truncated"] = float((rho > 1.0).float().mean())
        if self.pg_clip:
            health["losses/clip_fraction"] = float(((rho - 1.0).abs() > self.pg_clip).float().mean())
        # How much of the targets' variance the critic explains (PPO's explained_variance):
        # near 0, the critic cannot see what predicts the return and advantages are noise.
        target_var = loss.value_targets.var()
        err_var = (loss.value_targets - values[: loss.value_targets.shape[0]].detach()).var()
        health["health/explained_variance"] = (
            float(1.0 - err_var / target_var) if target_var > 0 else float("nan")
        )
        for layer, alive in getattr(self.model.torso, "activity", {}).items():
            health[f"health/alive_{layer}"] = alive
        return health

    @torch.no_grad()
    def _add_task_health(
        self, loss: ImpalaLoss, logits: torch.Tensor, values: torch.Tensor, task_ids: torch.Tensor
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
