"""Sample Factory's own Atari entry point (sf_examples.atari.train_atari) with a curve writer attached.

Runs inside Sample Factory's virtualenv (scripts/peers/sample_factory.sh makes it):

    python scripts/peers/sf_run.py --curve OUT/curve.csv -- --algo=APPO --env=atari_pong ...

Everything after ``--`` is Sample Factory's own command line, parsed by its own parse_atari_args
(so its atari defaults apply exactly as with ``python -m sf_examples.atari.train_atari``). The only
addition is a handler of the learner's env-steps report (appended to the runner's own handlers,
after the one that updates the counter) plus an AlgoObserver (its documented hook) for the final
row; each reads the runner's own counters and appends a row to the curve:

- frames: ``runner.env_steps[0]``, the samples the learner consumed times ``env_frameskip`` (4) —
  Sample Factory's atari defaults set ``summaries_use_frameskip=True`` so it counts env frames;
- mean_return_100: the mean of ``runner.policy_avg_stats["reward"][0]``, the last ``stats_avg``
  (100) episodes' returns from gymnasium's RecordEpisodeStatistics, which sits under the reward
  clipping and the episodic-life wrapper: whole games, raw rewards.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from curve import CurveWriter, launch_time  # noqa: E402

T0 = launch_time()

# ale-py >= 0.9 (the first with the ROMs in its wheel) registers PongNoFrameskip-v4 with gymnasium when
# imported; ale-py 0.8, which sf_examples was written against, did it through gymnasium's plugin entry
# point. At module level, so the worker processes that import this file (spawn) register them too.
import ale_py  # noqa: E402,F401


def _vtrace_summaries_shim() -> None:
    """Sample Factory 2.1.1 crashes on the first training summary with --with_vtrace: the summary reads
    the GAE advantages (``mb.advantages``), which the V-trace path never computes (fixed upstream after
    2.1.1, its last release). Those figures are only logged, so they are given as NaN when absent; the
    GAE path (every mode but cpu-vtrace) is untouched. At module level: the learner process (spawned)
    imports this file too."""
    import math

    import torch
    from sample_factory.algo.learning.learner import Learner

    record = Learner._record_summaries

    def _record_summaries(self, train_loop_vars):
        if "advantages" not in train_loop_vars.mb:
            train_loop_vars.mb["advantages"] = torch.full((1,), math.nan)
            train_loop_vars.setdefault("adv_std", math.nan)
            train_loop_vars.setdefault("adv_mean", math.nan)
        return record(self, train_loop_vars)

    Learner._record_summaries = _record_summaries


_vtrace_summaries_shim()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--curve", required=True)
    ap.add_argument("sf_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    sf_args = args.sf_args[1:] if args.sf_args[:1] == ["--"] else args.sf_args

    import numpy as np
    from sample_factory.algo.runners.runner import AlgoObserver
    from sample_factory.algo.utils.misc import LEARNER_ENV_STEPS, ExperimentStatus
    from sample_factory.train import make_runner
    from sf_examples.atari.train_atari import parse_atari_args, register_atari_components

    curve = CurveWriter(args.curve, t0=T0, min_interval=2.0)

    def write(runner, force: bool) -> None:
        frames = runner.env_steps.get(0)
        if frames is None:
            return
        mean = None
        stats = runner.policy_avg_stats.get("reward")
        if stats is not None and len(stats[0]) > 0:
            mean = float(np.mean(stats[0]))
        curve.row(frames, mean, force=force)

    class CurveObserver(AlgoObserver):
        def on_stop(self, runner) -> None:
            write(runner, force=True)

    register_atari_components()
    cfg = parse_atari_args(sf_args)
    cfg, runner = make_runner(cfg)
    runner.register_observer(CurveObserver())
    # appended after the runner's own handler (which updates runner.env_steps); not through
    # register_policy_msg_handler, which in 2.1.1 puts the bare function in place of the list of handlers
    runner.policy_msg_handlers[LEARNER_ENV_STEPS].append(lambda r, _msg, _policy_id: write(r, force=False))
    status = runner.init()
    if status == ExperimentStatus.SUCCESS:
        status = runner.run()
    curve.close()
    return status


if __name__ == "__main__":
    sys.exit(main())
