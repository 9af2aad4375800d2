"""A data-parallel learner group on torch.distributed: G learner ranks, one update.

Each rank holds B/G of the batch; gradients are summed across ranks (and divided by G for
mean-reduced losses, so the step equals one learner's step on the whole batch), PopArt's
statistics and the advantage normalization use the whole batch's moments, and a step is skipped
on every rank when any rank's loss or gradient is not finite. The ranks therefore stay identical
without ever exchanging weights after the first broadcast. gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class LearnerGroup:
    """The collective operations a ``VTraceLearner`` needs; the process group must be initialized."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized (init_process_group first)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    def allreduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.detach().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    def all_true(self, flag: bool, device: torch.device | str = "cpu") -> bool:
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def sync_gradients(self, parameters, reduction: str) -> None:
        """Sum every gradient over the ranks in one flat all-reduce; divide by G for mean-reduced losses."""
        grads = [p.grad for p in parameters if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        if reduction == "mean":
            flat /= self.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def broadcast_module(self, module: torch.nn.Module, src: int = 0) -> None:
        """Every rank starts from rank ``src``'s weights and buffers (PopArt statistics included)."""
        for tensor in module.state_dict().values():
            dist.broadcast(tensor, src)
