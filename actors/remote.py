"""``impala-actors``: run actors on another machine against a running learner.

    impala-actors --learner tcp://HOST:PORT --workers N

The learner must bind an address this machine can reach (``launch_impala
--bind 0.0.0.0 --port PORT``). Actors learn what to run (env spec, network,
unroll length) from the learner's weights messages, so the two cannot disagree
on the schema; each still sends its measured env fingerprint in its hello and
is refused by the learner if it differs.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
import time
from dataclasses import dataclass
from typing import Optional

import zmq

from actors.loop import actor_configs
from actors.pool import ActorPool
from impala.envs import EnvPackageError
from impala.options import (
    ConfigError,
    FlagParser,
    add_flags,
    check_fields,
    fail,
    flag_name,
    from_flags,
    need,
    option,
)
from impala.run.config import LOOPBACK, RunConfig
from impala.run.cpus import available_cpus
from impala.run.metrics import LOG_FORMAT, log_this_one
from impala.transport import wire
from impala.transport.curve import client_keys, make_client_keys, make_client_socket
from impala.transport.messages import RunInfo

log = logging.getLogger("impala-actors")


def fetch_run_info(params_endpoint: str, timeout_s: float, keys=None) -> RunInfo:
    """Wait for one weights message and return the run description it carries (validated)."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    if keys is not None:
        make_client_socket(sub, keys)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.CONFLATE, 1)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(params_endpoint)
    try:
        deadline = time.monotonic() + timeout_s
        bad = 0
        while time.monotonic() < deadline:
            if sub.poll(500, zmq.POLLIN):
                frame = sub.recv(copy=False)
                try:
                    # No schema yet: only the header's form and sizes are checked here; the
                    # actor checks every later weights message against its own model.
                    msg = wire.decode_packed(frame, expect_kind="params")
                    return RunInfo.from_dict(msg.info.get("run"))
                except EnvPackageError:
                    # The run's env needs a package this machine cannot import (a name, checked to be a module
                    # name only, that does not import here): the next message names the same one. Say so now
                    # instead of timing out with "no weights".
                    raise
                except (wire.WireError, ValueError) as e:
                    bad += 1
                    if log_this_one(bad):
                        log.error("bad weights message from %s (#%d): %s", params_endpoint, bad, str(e)[:300])
        raise TimeoutError(
            f"no weights from {params_endpoint} within {timeout_s:.0f}s: is the learner running and bound to "
            "a reachable address (--bind)?"
        )
    finally:
        sub.close()


def parse_endpoint(text: str) -> tuple[str, str]:
    """``tcp://HOST:PORT`` -> (trajectory endpoint, weights endpoint at PORT+1); ValueError says what is
    wrong."""
    m = re.fullmatch(r"tcp://([^:/]+):(\d+)", text)
    if not m or not 1 <= int(m.group(2)) <= 65534:
        raise ValueError(f"--learner must look like tcp://HOST:PORT, got {text!r}")
    host, port = m.group(1), int(m.group(2))
    return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"


@dataclass(frozen=True)
class RemoteOptions:
    """impala-actors' own settings (the shared ones are RunConfig's: --workers, --seed, --curve, ...)."""

    learner: Optional[str] = option(
        None, "The learner's trajectory endpoint, tcp://HOST:PORT (its --port). Required unless --make-keys."
    )
    first_id: int = option(1000, "Actor id of the first actor here; give each machine its own range.")
    timeout: float = option(60.0, "Seconds to wait for the learner's first weights.")
    learner_timeout: float = option(
        60.0, "An actor exits when no weights (sent every second) arrive for this long."
    )
    make_keys: bool = option(False, "With --curve: create this machine's client keypair and exit.")
    insecure: bool = option(
        False,
        "Allow a non-loopback learner without --curve. The learner's weights messages choose what these "
        "actors run "
        "(env id and kwargs, a Unity build path), so only do this on a network you trust.",
    )

    def __post_init__(self) -> None:
        check_fields(self)
        need(self.first_id >= 0, f"--first-id must be >= 0, got {self.first_id}")
        for name in ("timeout", "learner_timeout"):
            need(
                getattr(self, name) > 0,
                f"{flag_name(name)} must be a number of seconds > 0, got {getattr(self, name)}",
            )


SHARED = ("workers", "seed", "start_method", "max_seconds", "curve", "log_level")


def build_parser() -> argparse.ArgumentParser:
    """``impala-actors``' flags: the learner's address, how many actors, their ids, seed and CURVE keys."""
    p = FlagParser(
        prog="impala-actors",
        description="Run N actor processes on this machine, streaming to a learner elsewhere (trajectories "
        "to PORT, weights from PORT+1). "
        "What to run (env, agent, unroll length) comes from the learner.",
    )
    add_flags(p, RemoteOptions)
    add_flags(
        p,
        RunConfig,
        only=SHARED,
        defaults={"workers": available_cpus(), "seed": 12345},
        helps={
            "workers": "Actor processes to run here.",
            "seed": "Base seed; the actor with id A seeds its envs with seed + 1000 * A, so machines with "
            "their own --first-id never share seeds.",
            "max_seconds": "Stop after this many seconds (0: run until Ctrl-C or the learner stops).",
            "curve": "CURVE keys directory holding the learner's server.key and this machine's client "
            "keypair.",
        },
    )
    return p


def main(argv: list[str] | None = None) -> int:
    """``impala-actors``: run N actors against a learner elsewhere until it stops sending weights."""
    args = build_parser().parse_args(argv)
    try:
        options = from_flags(RemoteOptions, args)
        config = from_flags(RunConfig, args)
    except ConfigError as e:
        return fail("impala-actors", e)
    logging.basicConfig(level=config.log_level, format=LOG_FORMAT)
    if options.make_keys:
        return _make_keys(config)
    try:
        pool, tasks, trajectory_endpoint = _actor_pool(options, config)
    except (ValueError, TimeoutError, FileNotFoundError) as e:  # ConfigError and CurveError are ValueErrors
        return fail("impala-actors", e)
    log.info("running %d actors for %s on %s", config.workers, tasks, trajectory_endpoint)
    return _supervise(pool, config)


def _make_keys(config: RunConfig) -> int:
    """``--make-keys``: this machine's CURVE client keys in ``--curve``, and what to copy where."""
    if not config.curve:
        return fail("impala-actors", "--make-keys needs --curve DIR")
    try:
        public = make_client_keys(config.curve)
    except ConfigError as e:
        return fail("impala-actors", e)
    print(
        f"created {public}: copy it into the learner's CURVE directory under authorized/, and copy the "
        f"learner's server.key to {config.curve}/"
    )
    return 0


def _actor_pool(options: RemoteOptions, config: RunConfig) -> tuple[ActorPool, str, str]:
    """The actors' pool (not started), built from the run the learner sends, with the run's task ids and
    the trajectory endpoint; bad flags, an unsafe learner address or no answer raise."""
    keys = client_keys(config.curve) if config.curve else None
    if not options.learner:
        raise ConfigError("--learner tcp://HOST:PORT is required")
    if config.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {config.workers}")
    if options.first_id + config.workers - 1 > wire.MAX_ACTOR_ID:
        raise ConfigError(
            f"--first-id {options.first_id} + --workers {config.workers}: actor ids must stay <= "
            f"{wire.MAX_ACTOR_ID} (the wire's limit)"
        )
    trajectory_endpoint, params_endpoint = parse_endpoint(options.learner)
    host = trajectory_endpoint.split("//", 1)[1].rsplit(":", 1)[0]
    if keys is None and host not in LOOPBACK and not options.insecure:
        raise ConfigError(
            f"{options.learner} is not on this machine and no --curve keys were given: whoever answers "
            "at that address "
            "would choose what these actors run. Pass --curve DIR (see README, Security), or --insecure "
            "on a trusted network"
        )
    run = fetch_run_info(params_endpoint, options.timeout, keys)
    configs = actor_configs(
        run,
        range(options.first_id, options.first_id + config.workers),
        trajectory_endpoint=trajectory_endpoint,
        params_endpoint=params_endpoint,
        seed=config.seed,
        curve=keys,
        learner_timeout_s=options.learner_timeout,
    )
    pool = ActorPool(configs, start_method=config.start_method)
    return pool, ",".join(t.id for t in run.task_envs), trajectory_endpoint


def _supervise(pool: ActorPool, config: RunConfig) -> int:
    """Run the pool until the learner is gone (0), refuses the actors (2) or ``--max-seconds`` pass."""
    pool.start()
    start = time.monotonic()
    try:
        while not config.max_seconds or time.monotonic() - start < config.max_seconds:
            pool.supervise()
            if pool.all_finished():
                if pool.refused:
                    # each refused actor logged the learner's reason; say once what happened here
                    ids = sorted(pool.refused)
                    print(
                        f"impala-actors: the learner refused actor(s) {ids} (reason above); stopping",
                        file=sys.stderr,
                        flush=True,
                    )
                    return 2
                log.info("the learner is gone; stopping")
                break
            time.sleep(1.0)
    except KeyboardInterrupt:
        pass
    finally:
        pool.stop()
    print(f"impala-actors: stopped ({pool.restarts} restarts)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
