"""A batch's way from B received unrolls to the learner's device: stacked time-major into reused (on CUDA
page-locked) buffers, moved, Atari frame stacks rebuilt, the pixel statistics fed (``--obs-norm``) and the
frames laid out for the torso; and the index helpers the update reads a batch with."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from impala.transport.trajectory import TrajectorySchema, rebuild_frame_stacks, stack_time_major
from learner.group import LearnerGroup


def select_unrolls(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x.index_select(1, idx)`` (unrolls ``idx`` of a time-major [T, B, ...] array) in ``x``'s own memory
    layout: ``index_select`` returns a contiguous tensor, which would undo the frames' channels-last layout
    (``prepare``) at every minibatch."""
    if x.is_contiguous():
        return x.index_select(1, idx)
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))  # x.permute(order) is contiguous
    inverse = [order.index(d) for d in range(x.dim())]
    return x.permute(order).index_select(order.index(1), idx).permute(inverse)


def core_state(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The LSTM state each unroll started from, as the network takes it; None without a core."""
    if "core_state" not in batch:
        return None
    cs = batch["core_state"]  # [2, B, H] after time-major stacking of [2, H]
    return cs[0].unsqueeze(0).contiguous(), cs[1].unsqueeze(0).contiguous()


def task_ids(batch: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
    """A multi-task batch's task of every step, [T+1, B]; None for one task."""
    if "task" not in batch:  # [1, B]: one task per unroll, for every step of it and its bootstrap
        return None
    return batch["task"].expand(batch["first"].shape[0], -1)


class BatchStaging:
    """Staging buffers per slot, and the frames each slot laid out last (see :meth:`stage_host`)."""

    def __init__(self, model: torch.nn.Module, device: torch.device, group: LearnerGroup | None) -> None:
        self.model = model
        self.device = device
        self.group = group
        self.buffers: dict[int, dict[str, torch.Tensor]] = {}  # buffer set (slot) -> arrays
        self._batch_size = 0
        self._laid_out: dict[int, torch.Tensor] = {}  # slot -> the frames prepare laid out last

    def stage_host(
        self, unrolls: list[Mapping[str, np.ndarray]], schema: TrajectorySchema, slot: int = 0
    ) -> dict[str, torch.Tensor]:
        """Stack B unrolls time-major into the host staging buffers of ``slot``.

        The buffers are allocated once per ``slot`` (page-locked on CUDA, so the host-to-device copy
        is an asynchronous DMA, not a second staging copy); on CPU the batch is those buffers. Reusing
        a slot is safe once the update that read it has returned (the update reads its losses back to
        the host, which waits for the copy): a batch staged while another trains takes the other slot.
        """
        B = len(unrolls)
        if self._batch_size != B:
            self.buffers, self._batch_size = {}, B
        if slot not in self.buffers:
            pin = self.device.type == "cuda"
            self.buffers[slot] = {
                a.name: torch.empty(
                    (a.shape[0], B, *a.shape[1:]),
                    dtype=torch.from_numpy(np.empty(0, dtype=a.dtype)).dtype,
                    pin_memory=pin,
                )
                for a in schema.arrays
            }
        buffers = self.buffers[slot]
        stack_time_major(unrolls, schema, out={k: v.numpy() for k, v in buffers.items()})
        return dict(buffers)

    def prepare(self, staged: Mapping[str, torch.Tensor], slot: int | None = None) -> dict[str, torch.Tensor]:
        """Host arrays -> the device, and each frame-once unroll's stacks rebuilt there, laid out for the
        torso. With a ``slot``, the frames are laid out over the previous batch of that slot (the same
        reuse rule as :meth:`stage_host`'s buffers); without one, into fresh memory."""
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
