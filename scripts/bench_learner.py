#!/usr/bin/env python
"""Learner-update throughput: agent steps/s of one learner update on a [T+1, B] batch, per recipe.

- ``defaults``: the whole update ``launch_impala`` runs on one batch with its shipped defaults, through the
  learner's own code (``VTraceLearner.prepare`` and ``train``): V-trace's targets once per batch, then 4
  passes of 8 minibatches, Adam, PPO's clipped surrogate against the behaviour policy, advantage
  normalization, grad-norm 0.5.
- ``paper``: the IMPALA paper's single pass (TorchBeast's Atari settings): forward, V-trace, PopArt-IMPALA
  loss summed over T x B, backward, clip 40, RMSprop, PopArt ART+POP.

Throughput is T*B / (seconds per update). Batches are synthetic and already on the device unless
``--h2d`` is given (then each update first copies the uint8 batch from pinned host
memory, as the learner does).

Examples:
  python scripts/bench_learner.py --quick
  python scripts/bench_learner.py --device cuda --bf16 --channels-last
"""

from __future__ import annotations

import argparse
import datetime
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from impala.algos import impala_losses, popart  # noqa: E402
from impala.nets import impala_net  # noqa: E402

OBS_SHAPE = (4, 84, 84)
NUM_ACTIONS = 6  # Pong


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto = cuda if available"
    )
    p.add_argument("--nets", default="shallow,deep", help="comma-separated subset of shallow,deep")
    p.add_argument("--recipes", default="defaults,paper", help="comma-separated subset of defaults,paper")
    p.add_argument("--unroll-length", "-T", type=int, default=32)
    p.add_argument("--batch-size", "-B", type=int, default=32)
    p.add_argument("--warmup", type=int, default=None, help="untimed updates (default 3 on CPU, 10 on CUDA)")
    p.add_argument("--iters", type=int, default=None, help="timed updates (default 5 on CPU, 50 on CUDA)")
    p.add_argument("--quick", action="store_true", help="1 warm-up and 2 timed updates")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="the paper recipe: bf16 autocast for the forward pass (the defaults recipe follows the "
        "learner's default --precision)",
    )
    p.add_argument(
        "--channels-last", action="store_true", help="NHWC convolutions (meant for CUDA; runs on CPU too)"
    )
    p.add_argument("--lstm", action="store_true", help="add the LSTM-256 core")
    p.add_argument("--compile", action="store_true", help="torch.compile the network (forward and backward)")
    p.add_argument("--h2d", action="store_true", help="copy each batch from pinned host memory (CUDA)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads (CPU runs)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch.cuda.is_available() is False; use --device cpu")
    if args.device == "cpu" and args.h2d:
        p.error("--h2d measures host-to-GPU copies; drop it for --device cpu")
    cuda = args.device == "cuda"
    if args.quick:
        args.warmup, args.iters = 1, 2
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 3)
    args.iters = args.iters if args.iters is not None else (50 if cuda else 5)
    return args


def make_batch(T: int, B: int, device: torch.device, pin: bool) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    batch = {
        "obs": torch.randint(0, 256, (T + 1, B, *OBS_SHAPE), generator=g, dtype=torch.uint8),
        "first": torch.rand(T + 1, B, generator=g) < 0.01,
        "actions": torch.randint(0, NUM_ACTIONS, (T, B), generator=g),
        "rewards": torch.randint(-1, 2, (T, B), generator=g).float(),
        "dones": torch.rand(T, B, generator=g) < 0.01,
        "behaviour_logits": torch.randn(T, B, NUM_ACTIONS, generator=g),
    }
    if pin:
        return {k: v.pin_memory() for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


def bench_defaults(kind: str, args: argparse.Namespace) -> dict:
    """The shipped defaults' whole update of one batch (every pass and minibatch), through the learner's
    own code."""
    from impala.run.config import ImpalaConfig
    from learner.vtrace_learner import VTraceLearner

    device = torch.device(args.device)
    torch.manual_seed(0)
    model = impala_net.build_model(kind, OBS_SHAPE, NUM_ACTIONS, use_lstm=args.lstm)
    learner = VTraceLearner(model, ImpalaConfig(batch_size=args.batch_size), device, total_frames=10**9)
    batch = make_batch(args.unroll_length, args.batch_size, device, pin=False)
    for _ in range(args.warmup):
        learner.train(learner.prepare(batch), frames_done=0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        learner.train(learner.prepare(batch), frames_done=0)
    if device.type == "cuda":
        torch.cuda.synchronize()
    sec = (time.perf_counter() - t0) / args.iters
    return {
        "net": kind,
        "recipe": f"defaults ({learner.precision})",  # the learner's --precision default
        "ms": sec * 1e3,
        "sps": args.unroll_length * args.batch_size / sec,
    }


def bench(kind: str, args: argparse.Namespace) -> dict:
    """The paper's single-pass update, written out here."""
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    T, B = args.unroll_length, args.batch_size
    torch.manual_seed(0)
    net = impala_net.build_model(kind, OBS_SHAPE, NUM_ACTIONS, use_lstm=args.lstm).to(device)
    if args.channels_last:
        net.torso.to_channels_last()
    model = torch.compile(net) if args.compile else net
    # TorchBeast's Atari settings.
    opt = torch.optim.RMSprop(net.parameters(), lr=6e-4, alpha=0.99, eps=0.01, momentum=0.0)
    host = make_batch(T, B, device, pin=args.h2d)

    def update() -> torch.Tensor:
        batch = {k: v.to(device, non_blocking=True) for k, v in host.items()} if args.h2d else host
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=args.bf16):
            out, _ = model(batch["obs"], batch["first"])
        returns = popart.unnormalize(net.baseline.state, out.values.detach().float())
        targets = impala_losses.vtrace_targets(
            batch["behaviour_logits"],
            out.policy_logits[:-1],
            batch["actions"],
            0.99 * (~batch["dones"]).float(),
            batch["rewards"],
            returns[:-1],
            returns[-1],
            clip_rho_threshold=1.0,
            clip_pg_rho_threshold=1.0,
            pg_clip=None,
            lambda_=1.0,
        )
        loss = impala_losses.impala_loss(
            batch["behaviour_logits"],
            out.policy_logits[:-1],
            batch["actions"],
            out.values[:-1],
            targets,
            net.baseline.state,
            0,
            baseline_cost=0.5,
            entropy_cost=0.01,
            reduction="sum",
            pg_clip=None,
            standardize=None,
        )
        opt.zero_grad(set_to_none=True)
        loss.total.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 40.0)
        opt.step()
        net.baseline.update(loss.vtrace.vs)
        return loss.total.detach()

    for _ in range(args.warmup):
        update()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.iters):
        update()
    if cuda:
        torch.cuda.synchronize()
    sec = (time.perf_counter() - t0) / args.iters
    return {
        "net": kind,
        "recipe": f"paper ({'bf16' if args.bf16 else 'fp32'})",
        "ms": sec * 1e3,
        "sps": T * B / sec,
    }


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    else:
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    where = (
        torch.cuda.get_device_name() if args.device == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    )
    print(
        f"# learner update: T={args.unroll_length} B={args.batch_size} obs={OBS_SHAPE} uint8 "
        f"A={NUM_ACTIONS} lstm={args.lstm} bf16={args.bf16} channels_last={args.channels_last} "
        f"compile={args.compile} h2d={args.h2d}"
    )
    print(
        f"# {where}; torch {torch.__version__}; python {platform.python_version()}; "
        f"{datetime.date.today().isoformat()}; warmup={args.warmup} iters={args.iters}"
    )
    runners = {"defaults": bench_defaults, "paper": bench}
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = [r for r in recipes if r not in runners]
    if unknown:
        sys.exit(f"bench_learner: error: unknown recipe {unknown[0]!r} (known: defaults, paper)")
    rows = [runners[r](kind.strip(), args) for kind in args.nets.split(",") if kind.strip() for r in recipes]
    print(
        f"| {'net':8} | {'recipe':15} | {'device':6} | {'ms/update':>10} | {'agent steps/s':>14} | "
        f"{'frames/s (x4)':>14} |"
    )
    print(f"|{'-' * 10}|{'-' * 17}|{'-' * 8}|{'-' * 12}|{'-' * 16}|{'-' * 16}|")
    for r in rows:
        print(
            f"| {r['net']:8} | {r['recipe']:15} | {args.device:6} | {r['ms']:10.1f} | {r['sps']:14,.0f} | "
            f"{4 * r['sps']:14,.0f} |"
        )


if __name__ == "__main__":
    main()
