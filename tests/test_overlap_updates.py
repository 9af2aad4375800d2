"""Staging the next batch while the current one trains (``--overlap-updates``) leaves
every update as it was: the same batches, in the same order, bit for bit the same weights."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from impala.envs import EnvSpec
from impala.envs.probe import EnvInfo, probe_env
from impala.run.checkpoint import load_checkpoint
from impala.run.config import ImpalaConfig, RunConfig
from learner.run.runtime import RunPlan, run
from learner.vtrace_learner import ImpalaTrainer

T, B = 6, 4


def _trainer(frame_stack: bool) -> ImpalaTrainer:
    # the shipped defaults' loop (4 passes x 2 minibatches here), at a small batch
    config = ImpalaConfig(batch_size=B, minibatches=2, epochs=4)
    if frame_stack:  # Atari's layout: each frame travels once and the learner rebuilds the stacks
        env = EnvInfo(EnvSpec("PongDeterministic-v4"), (4, 84, 84), "uint8", "Box", "Discrete", num_actions=6)
    else:
        env = EnvInfo(EnvSpec("CartPole-v1"), (4,), "float32", "Box", "Discrete", num_actions=2)
    run_config = RunConfig(env=env.spec.id, unroll_length=T, total_frames=100_000, device="cpu", seed=3)
    return ImpalaTrainer(config, run_config, env)


def _unrolls(trainer: ImpalaTrainer, n: int, seed: int) -> list[dict[str, np.ndarray]]:
    """n unrolls of the trainer's own schema with random contents (valid actions, some episode ends)."""
    rng = np.random.default_rng(seed)
    actions = trainer.schema.names
    out = []
    for _ in range(n):
        u = trainer.schema.allocate()
        for name, v in u.items():
            if v.dtype == bool:
                v[...] = rng.random(v.shape) < 0.1
            elif v.dtype == np.uint8:
                v[...] = rng.integers(0, 256, v.shape)
            elif name == "actions":
                v[...] = rng.integers(0, u["behaviour_logits"].shape[-1], v.shape)
            else:
                v[...] = rng.normal(size=v.shape)
        out.append(u)
    assert "actions" in actions
    return out


def _weights(trainer: ImpalaTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.learner.model.state_dict().items()}


def _sequential(trainer: ImpalaTrainer, unrolls) -> list[dict[str, float]]:
    metrics = []
    for i, u in enumerate(unrolls):
        trainer.ingest(_Msg(u), 0)
        if trainer.ready():
            metrics.append(trainer.update(frames_done=(i + 1) * T))
    return metrics


def _overlapped(trainer: ImpalaTrainer, unrolls, *, threaded: bool) -> list[dict[str, float]]:
    """The runtime's order: batch n+1 is staged before update n has read anything (the worst case for
    shared buffers), or while it runs on another thread."""
    metrics, in_flight = [], None
    for i, u in enumerate(unrolls):
        trainer.ingest(_Msg(u), 0)
        if not trainer.ready():
            continue
        update = trainer.stage_update(frames_done=(i + 1) * T)
        if in_flight is not None:
            if threaded:
                in_flight.join()
                metrics.append(in_flight.result)
            else:
                metrics.append(in_flight())
        if threaded:
            in_flight = _Thread(update)
            in_flight.start()
        else:
            in_flight = update
    if threaded:
        in_flight.join()
        metrics.append(in_flight.result)
    else:
        metrics.append(in_flight())
    return metrics


class _Msg:
    def __init__(self, arrays) -> None:
        self.arrays, self.actor = arrays, 0


class _Thread(threading.Thread):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn, self.result = fn, None

    def run(self) -> None:
        self.result = self.fn()


@pytest.mark.parametrize("frame_stack", [False, True], ids=["vector", "atari-frames-once"])
@pytest.mark.parametrize("threaded", [False, True], ids=["staged-first", "on-a-thread"])
def test_overlapped_updates_equal_sequential_ones_bit_for_bit(frame_stack, threaded):
    unrolls = _unrolls(_trainer(frame_stack), 5 * B, seed=1)
    sequential, overlapped = _trainer(frame_stack), _trainer(frame_stack)
    start = _weights(sequential)
    assert all(torch.equal(start[k], v) for k, v in _weights(overlapped).items())  # same seed, same init
    m_seq = _sequential(sequential, unrolls)
    m_ovl = _overlapped(overlapped, unrolls, threaded=threaded)
    assert len(m_seq) == len(m_ovl) == 5
    after = _weights(sequential)
    assert any(not torch.equal(start[k], after[k]) for k in start)  # the updates did train
    for k, v in _weights(overlapped).items():
        assert torch.equal(after[k], v), k
    assert m_seq == m_ovl
    assert overlapped.learner.updates == sequential.learner.updates


def test_the_next_batch_takes_the_other_staging_buffers():
    trainer = _trainer(frame_stack=False)
    for u in _unrolls(trainer, 2 * B, seed=2):
        trainer.ingest(_Msg(u), 0)
    trainer.stage_update(0)
    trainer.stage_update(0)
    first, second = trainer.learner.staging.buffers[0], trainer.learner.staging.buffers[1]
    assert all(first[k].data_ptr() != second[k].data_ptr() for k in first)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_a_run_counts_every_update_once_and_checkpoints_the_weights_it_published(tmp_path, overlap):
    run_config = RunConfig(
        env="CartPole-v1",
        workers=1,
        envs_per_worker=2,
        unroll_length=T,
        total_frames=T * B * 12,
        logdir=str(tmp_path),
        progress=False,
        in_process=True,
        device="cpu",
        overlap_updates=overlap,
    )
    env = probe_env(EnvSpec(run_config.env))
    trainer = ImpalaTrainer(ImpalaConfig(batch_size=B, minibatches=2), run_config, env)
    result = run(trainer, run_config, RunPlan(env, "test"))
    assert result.env_frames == T * B * 12  # the last batch of the budget trained and was counted
    assert result.updates == trainer.learner.updates // (4 * 2) == 12  # 4 passes x 2 minibatches each
    saved = load_checkpoint(str(tmp_path / "checkpoint.pt"))
    assert saved["version"] == 12
    mine = trainer.learner.model.state_dict()
    for k, v in saved["trainer"]["model"].items():
        assert torch.equal(v, mine[k]), k
