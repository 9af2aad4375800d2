"""Starting a data-parallel learner group (``--learners G``): rank 0 spawns its followers on this machine, or
joins the ranks torchrun started across hosts and sends them this run's resolved settings. The group itself
(collectives, scatter, state broadcast) is :mod:`learner.group`."""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
from typing import Any, Sequence

import torch

from impala.envs.probe import EnvInfo
from impala.run.config import ImpalaConfig, RunConfig, resolve_device
from impala.run.orphans import exit_when_orphaned
from learner.group import LearnerGroup, LearnerGroupError, Membership, init_group, join_group, peer_error
from learner.update.precision import learner_threads
from learner.vtrace_learner import ImpalaTrainer

log = logging.getLogger(__name__)


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
