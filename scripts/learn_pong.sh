#!/usr/bin/env bash
# Reproduce the Pong learning curve of README/BENCHMARKS.md and redraw docs/pong.png.
#
#   scripts/learn_pong.sh                       # this box's run: 2 workers, the default 20M frames, seed 1
#   WORKERS=16 scripts/learn_pong.sh            # the mission's command on a 16-core GPU box
#   SEED=2 LOGDIR=runs/pong-seed2 scripts/learn_pong.sh
#   scripts/learn_pong.sh --config configs/pong_fast_cpu.yaml --stop-at-return 18   # the fast preset
#                                               # (docs/PONG.md section 7; flags after the script's own win)
#
# It runs launch_impala with its defaults (the settings in BENCHMARKS.md, "Pong"), then draws
# mean return (last 100 episodes) against frames and against wall-clock time, with the
# target of 18: this run next to SB3 PPO's curve on the same env (docs/sb3_pong_ref.csv, from
# scripts/sb3_pong_reference.py), or every run directory given in PLOT.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=${WORKERS:-2}
SEED=${SEED:-1}
FRAMES=${FRAMES:-20000000}   # the default --total-frames; the lr decays to 0 over it
LOGDIR=${LOGDIR:-runs/pong-w${WORKERS}-s${SEED}}
OUT=${OUT:-docs/pong.png}
PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")

if [ "${SKIP_TRAIN:-0}" != "1" ]; then
    "$BIN/launch_impala" --env PongDeterministic-v4 --workers "$WORKERS" --seed "$SEED" \
        --total-frames "$FRAMES" --logdir "$LOGDIR" --no-progress --log-interval 10 "$@"
fi
TITLE="PongDeterministic-v4, launch_impala defaults, --workers $WORKERS"
if [ -n "${PLOT:-}" ]; then
    # shellcheck disable=SC2086
    "$PY" scripts/plot_curves.py $PLOT --hline 18 --title "$TITLE" --out "$OUT"
else
    "$PY" scripts/plot_curves.py "$LOGDIR" docs/sb3_pong_ref.csv \
        --labels "launch_impala, seed $SEED" "SB3 PPO reference (stopped at 2.3M frames)" \
        --hline 18 --title "$TITLE" --out "$OUT"
fi
