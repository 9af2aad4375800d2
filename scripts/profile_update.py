#!/usr/bin/env python
"""Which torch operations a learner update spends its time in: ``torch.profiler`` over the learner's own
minibatch step (``VTraceLearner.step``), on a Pong-shaped batch, one torch thread.

``scripts/cost_model.py`` splits an update into the stages the learner calls (forward, backward, optimizer,
...); this goes one level down, to the kernels, grouped by their input shapes. It found the ReLU backward
that ran on a strided path because the gradient came back in NCHW order into channels-last layers, and
the two frame conversions per forward pass that ``--precision bf16`` now makes once per batch.

    python scripts/profile_update.py                      # the defaults (fp32)
    python scripts/profile_update.py --precision bf16 --rows 30
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_learner's batch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="the learner's --precision")
    p.add_argument("--model", choices=("shallow", "nature", "deep"), default="shallow", help="the network")
    p.add_argument("--steps", type=int, default=10, help="minibatch steps profiled (after 3 untimed)")
    p.add_argument("--rows", type=int, default=20, help="operations listed, by their own CPU time")
    p.add_argument(
        "--no-onednn",
        action="store_true",
        help="torch's oneDNN off: the convolutions run on ATen's own kernels, as bf16 ones do on a CPU "
        "without AVX-512 (torch has oneDNN bf16 convolutions only there)",
    )
    args = p.parse_args(argv)
    if args.steps < 1 or args.rows < 1:
        p.error("--steps and --rows must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    from bench_learner import NUM_ACTIONS, OBS_SHAPE, make_batch
    from torch.profiler import ProfilerActivity, profile

    from impala.nets.impala_net import build_model
    from impala.run.config import ImpalaConfig
    from learner.update.staging import select_unrolls
    from learner.vtrace_learner import VTraceLearner

    args = parse_args(argv)
    if args.no_onednn:
        torch.backends.mkldnn.enabled = False
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = ImpalaConfig(precision=args.precision)
    learner = VTraceLearner(
        build_model(args.model, OBS_SHAPE, NUM_ACTIONS), config, torch.device("cpu"), total_frames=10**8
    )
    T, B = 32, config.batch_size
    batch = make_batch(T, B, torch.device("cpu"), pin=False)  # bench_learner's synthetic Pong batch
    batch = learner.prepare(batch)
    batch = {**batch, **learner._batch_targets(batch)}  # the defaults' fixed targets, as train() adds them
    idx = torch.arange(B // config.minibatches)  # one minibatch of whole unrolls, as train() selects them
    minibatch = {k: select_unrolls(v, idx) for k, v in batch.items()}

    def step() -> None:
        learner.step(minibatch, frames_done=0)

    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(args.steps):
            step()
    unrolls = B // config.minibatches
    onednn = ", oneDNN off" if args.no_onednn else ""
    print(
        f"{args.model} CNN, --precision {args.precision}{onednn}, one minibatch step ({T} x {unrolls} "
        f"unrolls = {T * unrolls} frames), 1 torch thread, torch {torch.__version__}: "
        f"{ms:.1f} ms per step unprofiled; per-operation times below are over {args.steps} profiled steps "
        f"(the profiler adds its own overhead)"
    )
    print(
        prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total",
            row_limit=args.rows,
            max_name_column_width=34,
            max_shapes_column_width=70,
        )
    )


if __name__ == "__main__":
    main()
