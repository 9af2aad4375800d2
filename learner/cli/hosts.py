"""``launch_impala --learners N --node-rank R --rdzv-endpoint HOST:PORT``: one learner rank per host.

The flags are torchrun's own (``--nnodes`` is ``--learners``: one rank per host), and so is what runs
them: this process becomes torchrun's agent for its host (its static rendezvous: node rank 0's agent
holds the store at the endpoint), which starts this host's rank as ``python -m learner.cli.launch_impala``
with the same flags and torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT). The rank
then joins the group (``learner.group.membership``); rank 0 is the learner the actors connect to.

Running torchrun here rather than asking the user to type it buys the project's rules for its
outcomes: bad group flags are one line and exit 2 before anything starts (torchrun itself, given a
node rank >= --nnodes, waits without a word), and the rank's own last line is the host's last line (torchrun
would add its failure report, a traceback, after a rank that stopped). Starting each rank under
``torchrun`` by hand works the same way (the rank reads the same environment).
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

from impala.options import ConfigError
from learner.group import Membership, group_interface, membership

HELP = {
    "node_rank": "This host's rank in a learner group across hosts: 0 for the learner the actors connect to "
    "(it receives the unrolls, publishes weights, writes checkpoints), 1..N-1 for the others (they "
    "train on their share of each batch). Needs --rdzv-endpoint and --learners N, one rank per host; "
    "each host's collectives use its --bind address. Unset: every rank of --learners runs on this host.",
    "rdzv_endpoint": "HOST:PORT of node rank 0's rendezvous (torchrun's static rendezvous: rank 0's host "
    "listens on PORT, on every interface, for the other ranks). The same on every host.",
}


def add_flags(parser: argparse.ArgumentParser) -> None:
    """The flags that place this process in a learner group across hosts."""
    group = parser.add_argument_group("learner group across hosts")
    group.add_argument("--node-rank", type=int, default=None, metavar="R", help=HELP["node_rank"])
    group.add_argument("--rdzv-endpoint", default=None, metavar="HOST:PORT", help=HELP["rdzv_endpoint"])


def endpoint(text: str) -> tuple[str, int]:
    """``HOST:PORT`` (IPv6: ``[ADDR]:PORT``) -> (host, port); a :class:`ConfigError` says what is wrong."""
    host, sep, port = text.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ConfigError(
            f"--rdzv-endpoint {text!r}: give HOST:PORT, the address of node rank 0's host and a free port "
            "there, e.g. learner0.cluster:29400"
        )
    return host, int(port)


def requested_rank(args: argparse.Namespace) -> Membership | None:
    """The rank ``--node-rank`` / ``--rdzv-endpoint`` ask for, the flags checked against each other (None
    when neither is given, or when torchrun started this process: its environment then decides, and
    :func:`learner.group.membership` reads it)."""
    if args.node_rank is None and args.rdzv_endpoint is None or membership() is not None:
        return None
    if args.rdzv_endpoint is None:
        raise ConfigError(
            "--node-rank needs --rdzv-endpoint HOST:PORT (node rank 0's host: the same on every host)"
        )
    host, port = endpoint(args.rdzv_endpoint)
    if args.node_rank is None:
        raise ConfigError("--rdzv-endpoint needs --node-rank R (0 on the host the actors connect to)")
    if args.learners < 2:
        raise ConfigError(
            f"--node-rank places this host in a learner group across hosts: give --learners N (the number "
            f"of hosts, N >= 2), got {args.learners}"
        )
    if not 0 <= args.node_rank < args.learners:
        raise ConfigError(
            f"--node-rank {args.node_rank}: a group of --learners {args.learners} hosts has node ranks "
            f"0..{args.learners - 1}"
        )
    return Membership(args.node_rank, args.learners, 0, host, port)


def agent_membership(args: argparse.Namespace) -> Membership | None:
    """:func:`requested_rank`, and this host's ``--bind`` checked: one the other hosts cannot reach, or
    no address of this host, is refused here rather than in the rank, after the rendezvous."""
    member = requested_rank(args)
    if member is not None:
        group_interface(args.bind, member)
    return member


def run_rank(member: Membership, argv: list[str]) -> int:
    """Be torchrun's agent for this host: start its rank (``launch_impala`` with ``argv``) once the
    rendezvous has every host, wait for it, and return its exit status. The rank prints the host's
    last line; a rank killed by a signal gets one here."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # torchrun's own log lines (a failed rank's report) repeat what the rank said; its start-up notes stay
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
    torchrun_args = get_args_parser().parse_args(
        [
            f"--nnodes={member.world_size}",
            "--nproc-per-node=1",
            f"--node-rank={member.rank}",
            "--rdzv-backend=static",
            f"--rdzv-endpoint={member.master_addr}:{member.master_port}",
            "--max-restarts=0",  # a lost rank ends the run (with its checkpoint); --resume starts it again
            "--module",
            "learner.cli.launch_impala",
            *argv,
        ]
    )
    try:
        run(torchrun_args)
    except ChildFailedError as e:
        _, failure = e.get_first_failure()
        if failure.exitcode >= 0:
            return failure.exitcode  # the rank said why in its own last line
        name = signal.Signals(-failure.exitcode).name if -failure.exitcode in signal.valid_signals() else ""
        print(
            f"launch_impala: error: learner rank {member.rank} of {member.world_size} was killed "
            f"({name or f'signal {-failure.exitcode}'}); rank 0 writes the run's checkpoint: start every "
            "host's rank again (rank 0 with --resume) to continue",
            file=sys.stderr,
            flush=True,
        )
        return 1
    except SignalException as e:  # this agent was told to stop: its rank was told too, and has stopped
        return 128 + int(e.sigval)
    return 0
