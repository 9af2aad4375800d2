"""A data-parallel learner group on torch.distributed: G learner ranks, one update.

``launch_impala --learners G`` runs rank 0 as the usual learner (it receives every unroll, owns
the actors, publishes weights and writes checkpoints) and starts G-1 follower processes on this
machine. At each update rank 0 sends every follower its B/G share of the batch (a scatter: the
group shares rank 0's receiving endpoint) and all ranks step together. Each rank holds B/G of the
batch; gradients are summed across ranks (and divided by G for
mean-reduced losses, so the step equals one learner's step on the whole batch), PopArt's
statistics and the advantage normalization use the whole batch's moments, and a step is skipped
on every rank when any rank's loss or gradient is not finite. The ranks therefore stay identical
without ever exchanging weights after the first broadcast. gloo on CPU, NCCL on GPUs.
"""

from __future__ import annotations

import datetime
import logging
from typing import Mapping

import numpy as np
import torch
import torch.distributed as dist

from impala.transport.trajectory import TrajectorySchema

log = logging.getLogger(__name__)

STOP, UPDATE = 0, 1
# Followers wait in a collective while rank 0 collects a batch (or waits for actors to start):
# the timeout only has to catch a group that can never continue. An orphaned follower exits by itself.
GROUP_TIMEOUT = datetime.timedelta(hours=6)


class LearnerGroupError(RuntimeError):
    """A rank of the learner group is gone: the run stops (with its checkpoint; --resume continues)."""


def lost_peer(error: BaseException) -> bool:
    """A collective failed because another rank is gone (gloo raises a plain RuntimeError for it)."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        s in text for s in ("closed by peer", "Connection reset", "gloo", "NCCL")
    )


def init_group(rank: int, world_size: int, store: str, backend: str) -> "LearnerGroup":
    """Join the learner group as ``rank`` of ``world_size`` (rendezvous through the file ``store``)."""
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )
    return LearnerGroup()


class LearnerGroup:
    """The collective operations a ``VTraceLearner`` needs; the process group must be initialized."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized (init_process_group first)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # batches travel between host buffers: a gloo group for them when the default is NCCL
        self.host_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

    def command(self, cmd: int = STOP, frames_done: int = 0) -> tuple[int, int]:
        """Rank 0 says what comes next (an update at ``frames_done``, or stop); every rank returns it."""
        t = torch.tensor([cmd, frames_done], dtype=torch.int64)
        dist.broadcast(t, 0, group=self.host_group)
        return int(t[0]), int(t[1])

    def scatter(
        self, staged: Mapping[str, torch.Tensor] | None, schema: TrajectorySchema, batch_size: int
    ) -> dict[str, torch.Tensor]:
        """Rank 0's host batch ``[T(+1), B, ...]`` (``staged``; None on followers) split along B:
        every rank returns its ``[T(+1), B/G, ...]`` share, rank r the r-th."""
        share_b = batch_size // self.world_size
        out = {}
        for a in schema.arrays:
            share = torch.from_numpy(np.empty((a.shape[0], share_b, *a.shape[1:]), dtype=a.dtype))
            chunks = (
                [c.contiguous() for c in staged[a.name].chunk(self.world_size, dim=1)]
                if self.rank == 0
                else None
            )
            dist.scatter(share, chunks, src=0, group=self.host_group)
            out[a.name] = share
        return out

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
