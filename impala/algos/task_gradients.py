"""Each task's part of a multi-task update's gradient on the weights the tasks share, and how the parts
agree: the numbers that say whether one game is crowded out of the torso (a small share of the gradient)
or pulls against the others (a negative cosine with their sum).

The loss is a sum over steps and each step belongs to one task (every step of an unroll is its task's), so
the gradient of the loss on the shared weights is the sum over tasks of the backward pass of that task's
steps' output gradients alone. :func:`task_gradients` computes those parts from the loss's gradient with
respect to the network's per-step outputs, without a second formula for the loss."""

from __future__ import annotations

from typing import Sequence

import torch


def task_gradients(
    loss: torch.Tensor,
    outputs: Sequence[torch.Tensor],
    task_ids: torch.Tensor,
    num_tasks: int,
    params: Sequence[torch.Tensor],
) -> torch.Tensor:
    """``[num_tasks, P]``: row k is the gradient on ``params`` (flattened, concatenated) of task k's steps'
    part of ``loss``. ``outputs``: the network's outputs the loss reads, each ``[T, B, ...]`` with one task
    per ``[t, b]`` (``task_ids``, ``[T, B]``). The rows sum to the gradient of ``loss`` (up to rounding);
    a task with no step here has a row of zeros. Leaves the graph and every ``.grad`` as they were."""
    outputs = list(outputs)
    output_grads = torch.autograd.grad(loss, outputs, retain_graph=True, allow_unused=True)
    rows = []
    for k in range(num_tasks):
        mine = task_ids == k
        if not bool(mine.any()):
            rows.append(torch.zeros(sum(p.numel() for p in params), device=task_ids.device))
            continue
        masked = [
            torch.zeros_like(o) if g is None else g * mine.reshape(*mine.shape, *([1] * (g.dim() - 2)))
            for o, g in zip(outputs, output_grads)
        ]
        grads = torch.autograd.grad(outputs, params, masked, retain_graph=True, allow_unused=True)
        rows.append(
            torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for p, g in zip(params, grads)])
        )
    return torch.stack(rows)


def task_gradient_stats(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per task: its share of the summed gradient norms (``|g_k| / sum_j |g_j|``) and the cosine between its
    gradient and the sum of the others' (NaN where either is zero: the task had no step, or it is alone)."""
    norms = rows.norm(dim=1)
    total = norms.sum()
    share = norms / total if total > 0 else torch.full_like(norms, float("nan"))
    others = rows.sum(dim=0, keepdim=True) - rows
    denom = norms * others.norm(dim=1)
    cosine = torch.where(
        denom > 0, (rows * others).sum(dim=1) / denom.clamp(min=1e-30), torch.full_like(norms, float("nan"))
    )
    return share, cosine
