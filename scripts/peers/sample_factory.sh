#!/usr/bin/env bash
# Sample Factory 2.1.1's APPO on Pong (its sf_examples.atari.train_atari, env atari_pong), in its own
# venv, for a window.
#
#   scripts/peers/sample_factory.sh published 1800   # its published Atari settings (the example's defaults)
#   scripts/peers/sample_factory.sh cpu 1800         # as its docs advise for throughput, sized to 2 cores
#   scripts/peers/sample_factory.sh cpu-vtrace 1800  # the same, with V-trace (return normalization off)
#   scripts/peers/sample_factory.sh setup            # only make the venv
#
# Writes runs/peers/sample_factory-<mode>/curve.csv (frames,time,mean_return_100), summary.json (CPU),
# log.txt, and Sample Factory's own experiment folder (train_dir/) beside them.
#
# Pins: sample-factory 2.1.1 (its last release), gymnasium 0.29.1 (it needs < 1.0), numpy 1.26.4 (it
# needs < 2), ale-py 0.9.1: the first ale-py that ships the ROMs in its wheel and the last that registers
# PongNoFrameskip-v4 for gymnasium 0.29. Its `[atari]` extra (gymnasium[atari,accept-rom-license]) is not
# used: that brings ale-py 0.8 and AutoROM, which downloads the ROMs at install time from outside the
# package registry; this box reaches only PyPI. torch is the same CPU build as ours.
source "$(dirname "$0")/lib.sh"

MODE=${1:-published}
WINDOW=${2:-1800}
PINS=("$PEER_TORCH" sample-factory==2.1.1 gymnasium==0.29.1 ale-py==0.9.1 numpy==1.26.4)

make_venv sample_factory "${PINS[@]}"
[ "$MODE" = setup ] && exit 0

OUT=${OUT:-$PEERS_DIR/sample_factory-$MODE}
# The published settings: `python -m sf_examples.atari.train_atari --algo=APPO --env=atari_pong` with
# the example's atari defaults (8 workers x 1 env, sync PPO-style APPO without V-trace, rollout 128,
# batch 256 x 4 minibatches, 4 epochs, clip 0.1, lr 2.5e-4 decaying over 10M frames, input and return
# normalization; its atari defaults also count frames with the frameskip: summaries_use_frameskip).
# What this box forces: --device=cpu (its default is gpu; there is none). Also given, changing no
# setting: the experiment's folder and name, --restart_behavior=overwrite (a rerun starts afresh
# instead of resuming the last one), --seed=1 (ours and cleanrl's seed; its default is a random seed),
# --train_for_seconds (the window, as a backstop: monitor.py ends every run at the window from launch).
ARGS=(--algo=APPO --env=atari_pong --device=cpu --seed=1
      --train_dir="$OUT/train_dir" --experiment="pong-$MODE" --restart_behavior=overwrite
      --train_for_seconds="$WINDOW")
case "$MODE" in
    published) ;;
    cpu | cpu-vtrace)
        # Its docs' "better parameters (more envs, double buffering, async learning)" for Atari
        # (docs/09-environment-integrations/atari.md: --num_workers=16 --num_envs_per_worker=8
        # --worker_num_splits=2 --rollout=32 --async_rl=True --batch_size=1024, return and input
        # normalization on), with the workers sized to this box: --num_workers defaults to the logical
        # cores in Sample Factory's cfg.py ("use this in async mode"), here 2; 8 envs per worker is that
        # page's figure (even, for double-buffered sampling: 2 splits of 4). summaries_use_frameskip stays
        # True (that page sets it False for its own plots), so frames are counted as in every other run.
        ARGS+=(--num_workers=2 --num_envs_per_worker=8 --worker_num_splits=2 --rollout=32
               --async_rl=True --batch_size=1024)
        if [ "$MODE" = cpu-vtrace ]; then
            # The same with V-trace, Sample Factory's off-policy correction (--with_vtrace), for the
            # policy lag of asynchronous collection (its docs' "Policy Lag" page). Sample Factory refuses V-trace with normalized returns ("Normalized returns are
            # not supported with vtrace!"), which its atari defaults and that page both turn on, so this
            # variant turns them off: not what its docs advise, hence not the default cpu mode. Its
            # V-trace also asserts recurrence == rollout (its --recurrence help: "If you train with V-trace
            # recurrence should be equal to rollout length"; the atari defaults set 1): --recurrence=32.
            ARGS+=(--with_vtrace=True --normalize_returns=False --recurrence=32)
        fi
        ;;
    *) echo "usage: $0 published|cpu|cpu-vtrace|setup [SECONDS]" >&2; exit 2 ;;
esac

run_monitored "$OUT" "$WINDOW" \
    "$PEERS_DIR/sample_factory/venv/bin/python" "$HERE/sf_run.py" --curve "$OUT/curve.csv" -- "${ARGS[@]}"
brief "$OUT"
