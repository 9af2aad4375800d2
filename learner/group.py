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

Across hosts the group comes from torchrun (one rank per host; :class:`Membership` reads what torchrun
sets): every rank joins over TCP (``env://``), rank 0 sends the followers its resolved settings and, on
``--resume``, its trainer state, as JSON and raw tensor bytes (nothing unpickled), and the batches go
over the same connections. Each rank's collectives use the interface of its own ``--bind`` address.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import ipaddress
import json
import logging
import os
import re
import socket
import struct
from typing import Any, Mapping

import numpy as np
import torch
import torch.distributed as dist

from impala.options import ConfigError
from impala.transport.trajectory import TrajectorySchema

log = logging.getLogger(__name__)

# What rank 0 tells the followers next: stop, update on a batch, or take rank 0's trainer state (a resume)
STOP, UPDATE, SYNC = 0, 1, 2
# Followers wait in a collective while rank 0 collects a batch (or waits for actors to start):
# the timeout only has to catch a group that can never continue. An orphaned follower exits by itself.
GROUP_TIMEOUT = datetime.timedelta(hours=6)
JOIN_TIMEOUT = datetime.timedelta(minutes=5)


class LearnerGroupError(RuntimeError):
    """A rank of the learner group is gone: the run stops (with its checkpoint; --resume continues)."""


def lost_peer(error: BaseException) -> bool:
    """A collective failed because another rank is gone (gloo raises a plain RuntimeError for it)."""
    text = str(error)
    return isinstance(error, dist.DistError) or any(
        s in text for s in ("closed by peer", "Connection reset", "gloo", "NCCL")
    )


def peer_error(error: BaseException) -> str:
    """A collective's failure in a few words: gloo's ``[file:line] Read error [10.0.0.2]:15499: Connection
    reset by peer. This is typically caused by...`` as ``Connection reset by peer (10.0.0.2)``."""
    text = str(error) or type(error).__name__
    found = re.search(r"\[([0-9A-Fa-f.:]+)\]:\d+: ([^.\n]+)", text)
    if found:
        return f"{found.group(2).strip()} ({found.group(1)})"
    found = re.search(r"(Connection [a-z ]+by peer)\W*\[([0-9A-Fa-f.:]+)\]", text)
    if found:
        return f"{found.group(1)} ({found.group(2)})"
    return re.sub(r"^\[[^\]]*\] ?", "", text.splitlines()[0])[:200]


def init_group(rank: int, world_size: int, store: str, backend: str) -> "LearnerGroup":
    """Join the learner group as ``rank`` of ``world_size`` (rendezvous through the file ``store``)."""
    dist.init_process_group(
        backend, init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=GROUP_TIMEOUT
    )
    return LearnerGroup()


# What torchrun (and any env:// launcher: Kubeflow's PyTorchJob, a hand-written srun line) sets for each rank.
GROUP_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class Membership:
    """This process's place in a learner group that torchrun started across hosts."""

    rank: int
    world_size: int
    local_rank: int  # the rank among this host's ranks: its GPU with --device cuda
    master_addr: str  # the rendezvous store's host: rank 0's
    master_port: int
    local_world_size: int = 1  # the ranks on this host, which share its CPUs

    @property
    def across_hosts(self) -> bool:
        """The store is on another host, or may be: its address is not this host's loopback."""
        return not _loopback(self.master_addr)

    def describe(self) -> str:
        return f"rank {self.rank} of {self.world_size} (rendezvous {self.master_addr}:{self.master_port})"


def membership(environ: Mapping[str, str] = os.environ) -> Membership | None:
    """The group torchrun put this process in, or None when it runs alone (no ``WORLD_SIZE``, or 1: a
    stray ``RANK`` alone does not make a group). Values torchrun would never set are a
    :class:`ConfigError` naming them."""
    if environ.get("WORLD_SIZE", "").strip() in ("", "1"):
        return None
    missing = [name for name in GROUP_ENV if not environ.get(name)]
    if missing:
        raise ConfigError(
            f"a learner group across hosts needs {', '.join(GROUP_ENV)} in the environment (torchrun sets "
            f"them); {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set: start each rank "
            "with torchrun --nnodes N --node-rank R --rdzv-endpoint HOST:PORT"
        )
    values = {}
    for name in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        text = environ.get(name, {"LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.get(name, ""))
        try:
            values[name] = int(text)
        except ValueError:
            raise ConfigError(f"{name}={text[:40]!r} is not a whole number (torchrun sets it)") from None
    rank, world, port = values["RANK"], values["WORLD_SIZE"], values["MASTER_PORT"]
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(
            f"rank {rank} of a group of {world}: a node rank must be 0..nnodes-1 (torchrun --node-rank R "
            "with R < --nnodes)"
        )
    if not 1 <= port <= 65535:
        raise ConfigError(f"MASTER_PORT {port} is no TCP port (the rendezvous endpoint's HOST:PORT)")
    if world == 1:
        return None
    return Membership(
        rank, world, values["LOCAL_RANK"], environ["MASTER_ADDR"], port, max(1, values["LOCAL_WORLD_SIZE"])
    )


def _loopback(host: str) -> bool:
    if host in ("localhost", "::1"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def interface_of(address: str) -> str | None:
    """The name of this host's network interface that holds ``address`` (IPv4), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def group_interface(bind: str, member: Membership) -> str | None:
    """The interface this rank's collectives use: that of its ``--bind`` address (the project's rule: a
    process listens where the user said). None for a wildcard bind (gloo then takes the address this
    host's name resolves to). A :class:`ConfigError` when the other hosts could not reach it."""
    if bind in ("0.0.0.0", "*", "::"):
        return None
    if member.across_hosts and _loopback(bind):
        raise ConfigError(
            f"{member.describe()}: --bind {bind} is this host's loopback, which no other host reaches; give "
            "--bind this host's address on the network the ranks share"
        )
    try:
        address = socket.gethostbyname(bind)
    except OSError:
        raise ConfigError(f"--bind {bind}: no such host") from None
    name = interface_of(address)
    if name is None:
        raise ConfigError(
            f"--bind {bind}: no network interface of this host has that address (a learner rank binds its "
            "own host's address)"
        )
    return name


# Whether this process joined a learner group across hosts (its console script then ends without the
# interpreter's teardown of torch.distributed: see learner.cli.launch_impala.main)
joined_across_hosts = False


def join_group(member: Membership, backend: str, bind: str) -> "LearnerGroup":
    """Join the group torchrun's rendezvous formed (``env://``: its store at MASTER_ADDR:MASTER_PORT), the
    collectives on ``bind``'s interface unless ``GLOO_SOCKET_IFNAME`` names one already."""
    interface = group_interface(bind, member)
    if interface and not os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["GLOO_SOCKET_IFNAME"] = interface
    # A rank that never comes (it stopped on its own bad input) ends the join within JOIN_TIMEOUT; once
    # joined, followers wait in collectives as long as on one host.
    dist.init_process_group(
        backend, init_method="env://", rank=member.rank, world_size=member.world_size, timeout=JOIN_TIMEOUT
    )
    dist.distributed_c10d._set_pg_timeout(GROUP_TIMEOUT)
    global joined_across_hosts
    joined_across_hosts = True
    group = LearnerGroup()
    group.local_rank = member.local_rank
    return group


class LearnerGroup:
    """The collective operations a ``VTraceLearner`` needs; the process group must be initialized."""

    def __init__(self) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized (init_process_group first)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.local_rank = self.rank  # one host: the rank is the GPU; across hosts join_group says which
        # batches travel between host buffers: a gloo group for them when the default is NCCL
        self.host_group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None

    def leave(self) -> None:
        """Take this process out of the group at the end of its run: a process group left for the
        interpreter's exit to tear down aborts it ("terminate called without an active exception")."""
        try:
            dist.destroy_process_group()
        except (RuntimeError, ValueError) as e:  # a group broken by a lost rank: nothing to tear down well
            log.debug("leaving the learner group: %s", e)

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

    # ---------------------------------------------------------------- rank 0 -> followers, no pickle

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (None on followers): a length, then the bytes."""
        size = torch.tensor([len(data) if self.rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(size, 0, group=self.host_group)
        buf = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if self.rank == 0 and len(data)
            else torch.empty(int(size), dtype=torch.uint8)
        )
        if len(buf):
            dist.broadcast(buf, 0, group=self.host_group)
        return bytes(buf.numpy()) if self.rank else data

    def broadcast_json(self, value: Any = None) -> Any:
        """Rank 0's JSON-able ``value`` on every rank."""
        text = json.dumps(value).encode() if self.rank == 0 else None
        return json.loads(self.broadcast_bytes(text).decode())

    def broadcast_state(self, state: Any = None) -> Any:
        """Rank 0's ``state`` (nested dicts, lists, tuples, numbers, strings, tensors: a ``state_dict``)
        on every rank: its layout as JSON, its tensors as raw bytes; followers' tensors are on the CPU."""
        tensors: list[torch.Tensor] = []
        layout = _layout(state, tensors) if self.rank == 0 else None
        layout = self.broadcast_json(layout)
        payload = b"".join(_raw_bytes(t) for t in tensors) if self.rank == 0 else None
        payload = self.broadcast_bytes(payload)
        if self.rank == 0:
            return state
        return _rebuild(layout, payload, [0])


def _raw_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


_DTYPES = {
    str(d): d
    for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8,
              torch.int16, torch.int32, torch.int64, torch.bool)
}  # fmt: skip


def _layout(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """``obj``'s structure as JSON; tensors appended to ``tensors`` and named by dtype and shape."""
    if isinstance(obj, torch.Tensor):
        if str(obj.dtype) not in _DTYPES:
            raise TypeError(f"cannot send a {obj.dtype} tensor to the learner group")
        tensors.append(obj)
        return {"tensor": [str(obj.dtype), list(obj.shape)]}
    if isinstance(obj, Mapping):
        return {"dict": [[k, _layout(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, (list, tuple)):
        return {type(obj).__name__: [_layout(v, tensors) for v in obj]}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return {"value": obj}
    raise TypeError(f"cannot send a {type(obj).__name__} to the learner group")


def _rebuild(layout: Any, payload: bytes, at: list[int]) -> Any:
    """The object :func:`_layout` described, its tensors read from ``payload`` from ``at[0]`` on."""
    ((kind, body),) = layout.items()
    if kind == "tensor":
        dtype, shape = _DTYPES[body[0]], [int(n) for n in body[1]]
        nbytes = int(np.prod(shape, dtype=np.int64)) * torch.empty(0, dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if at[0] + nbytes > len(payload):
            raise ValueError("the learner group's state is shorter than its layout says")
        raw = torch.frombuffer(bytearray(payload[at[0] : at[0] + nbytes]), dtype=torch.uint8)
        at[0] += nbytes
        return raw.view(dtype).reshape(shape).clone()
    if kind == "dict":
        return {k if isinstance(k, (int, str)) else str(k): _rebuild(v, payload, at) for k, v in body}
    if kind in ("list", "tuple"):
        items = [_rebuild(v, payload, at) for v in body]
        return items if kind == "list" else tuple(items)
    return body
