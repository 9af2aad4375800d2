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
import math
import multiprocessing
import re
import sys
import time

import zmq

from actors.loop import ActorConfig
from actors.pool import ActorPool
from impala import wire
from impala.envs import EnvSpec
from impala.metrics import log_this_one

log = logging.getLogger("impala-actors")


def fetch_run_info(params_endpoint: str, timeout_s: float, keys=None) -> dict:
    """Wait for one weights message and return the run description it carries."""
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    if keys is not None:
        from impala.curve import make_client_socket

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
                except wire.WireError as e:
                    bad += 1
                    if log_this_one(bad):
                        log.error("bad weights message from %s (#%d): %s", params_endpoint, bad, str(e)[:300])
                    continue
                run = msg.info.get("run")
                if isinstance(run, dict) and {"env", "agent", "unroll_length", "envs_per_worker"} <= set(run):
                    return run
        raise TimeoutError(f"no weights from {params_endpoint} within {timeout_s:.0f}s: is the learner running and bound to a reachable address (--bind)?")
    finally:
        sub.close()


def parse_endpoint(text: str) -> tuple[str, str]:
    m = re.fullmatch(r"tcp://([^:/]+):(\d+)", text)
    if not m or not 1 <= int(m.group(2)) <= 65534:
        raise ValueError(f"--learner must look like tcp://HOST:PORT, got {text!r}")
    host, port = m.group(1), int(m.group(2))
    return f"tcp://{host}:{port}", f"tcp://{host}:{port + 1}"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="impala-actors",
        description="Run N actor processes on this machine, streaming to a learner elsewhere (trajectories to PORT, weights from PORT+1).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--learner", help="The learner's trajectory endpoint, tcp://HOST:PORT (its --port). Required unless --make-keys.")
    p.add_argument("--workers", type=int, default=multiprocessing.cpu_count(), help="Actor processes to run here.")
    p.add_argument("--first-id", type=int, default=1000, help="Actor id of the first actor here; give each machine its own range.")
    p.add_argument("--seed", type=int, default=12345, help="Base seed for this machine's actors.")
    p.add_argument("--start-method", default="spawn", choices=["spawn", "fork", "forkserver"], help="Multiprocessing start method.")
    p.add_argument("--timeout", type=float, default=60.0, help="Seconds to wait for the learner's first weights.")
    p.add_argument("--learner-timeout", type=float, default=60.0, help="An actor exits when no weights (sent every second) arrive for this long.")
    p.add_argument("--max-seconds", type=float, default=0.0, help="Stop after this many seconds (0: run until Ctrl-C).")
    p.add_argument("--curve", default="", help="CURVE keys directory holding the learner's server.key and this machine's client keypair.")
    p.add_argument("--make-keys", action="store_true", help="With --curve: create this machine's client keypair and exit.")
    p.add_argument(
        "--insecure", action="store_true",
        help="Allow a non-loopback learner without --curve. The learner's weights messages choose what these actors run "
        "(env id and kwargs, a Unity build path), so only do this on a network you trust.",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.make_keys:
        if not args.curve:
            print("impala-actors: error: --make-keys needs --curve DIR", file=sys.stderr)
            return 2
        from impala.curve import make_client_keys

        public = make_client_keys(args.curve)
        print(f"created {public}: copy it into the learner's CURVE directory under authorized/, and copy the learner's server.key to {args.curve}/")
        return 0
    try:
        keys = None
        if args.curve:
            from impala.curve import client_keys

            keys = client_keys(args.curve)
        if not args.learner:
            raise ValueError("--learner tcp://HOST:PORT is required")
        if args.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {args.workers}")
        for flag in ("timeout", "learner_timeout"):
            value = getattr(args, flag)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--{flag.replace('_', '-')} must be a finite number of seconds > 0, got {value}")
        if not (math.isfinite(args.max_seconds) and args.max_seconds >= 0):
            raise ValueError(f"--max-seconds must be >= 0 (0: run until Ctrl-C), got {args.max_seconds}")
        if args.first_id < 0 or args.seed < 0:
            raise ValueError(f"--first-id and --seed must be >= 0, got {args.first_id} and {args.seed}")
        trajectory_endpoint, params_endpoint = parse_endpoint(args.learner)
        host = trajectory_endpoint.split("//", 1)[1].rsplit(":", 1)[0]
        if keys is None and host not in ("127.0.0.1", "localhost") and not args.insecure:
            raise ValueError(
                f"{args.learner} is not on this machine and no --curve keys were given: whoever answers at that address "
                "would choose what these actors run. Pass --curve DIR (see README, Security), or --insecure on a trusted network"
            )
        run = fetch_run_info(params_endpoint, args.timeout, keys)
        env = EnvSpec(run["env"]["id"], dict(run["env"]["kwargs"]), bool(run["env"]["preprocess"]))
        configs = [
            ActorConfig(
                actor_id=args.first_id + i,
                env=env,
                num_envs=int(run["envs_per_worker"]),
                unroll_length=int(run["unroll_length"]),
                trajectory_endpoint=trajectory_endpoint,
                params_endpoint=params_endpoint,
                agent=dict(run["agent"]),
                seed=args.seed + 1000 * i,
                curve=keys,
                learner_timeout_s=args.learner_timeout,
            )
            for i in range(args.workers)
        ]
        pool = ActorPool(configs, start_method=args.start_method)
    except (ValueError, TimeoutError, FileNotFoundError) as e:
        print(f"impala-actors: error: {e}", file=sys.stderr)
        return 2
    log.info("running %d actors for %s on %s", args.workers, env.id, trajectory_endpoint)
    pool.start()
    start = time.monotonic()
    try:
        while not args.max_seconds or time.monotonic() - start < args.max_seconds:
            pool.supervise()
            if pool.all_finished():
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
