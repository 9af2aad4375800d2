#!/usr/bin/env bash
# Reproduce a Pong learning curve of README/BENCHMARKS.md and draw it (LOGDIR/pong.png; OUT= elsewhere).
#
#   scripts/learn_pong.sh                       # this box's run: 2 workers, seed 1, until the mean return is 18
#   WORKERS=16 scripts/learn_pong.sh            # the mission's command on a 16-core GPU box
#   SEED=2 LOGDIR=runs/pong-seed2 scripts/learn_pong.sh
#   STOP= scripts/learn_pong.sh                 # the whole 20M-frame budget (the lr decays to 0 over it)
#   scripts/learn_pong.sh --config pong_per_step_cpu                # the earlier defaults (a preset)
#                                               # (flags after the script's own win)
#
# It runs launch_impala with its defaults (the settings in BENCHMARKS.md, "Pong") until the mean return of
# the last 100 episodes reaches STOP (18), then draws it against frames and against wall-clock time, with
# the target of 18: this run next to SB3 PPO's curve on the same env (docs/data/sb3_pong_ref.csv, from
# scripts/sb3_pong_reference.py), or every run directory given in PLOT.
set -euo pipefail
cd "$(dirname "$0")/.."
WORKERS=${WORKERS:-2}
SEED=${SEED:-1}
FRAMES=${FRAMES:-20000000}   # the default --total-frames; the lr decays to 0 over it
STOP=${STOP-18}              # --stop-at-return; empty: run all FRAMES
LOGDIR=${LOGDIR:-runs/pong-w${WORKERS}-s${SEED}}
OUT=${OUT:-$LOGDIR/pong.png}  # docs/pong.png holds several seeds: docs/PONG.md section 14 redraws it
PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")

if [ "${SKIP_TRAIN:-0}" != "1" ]; then
    "$BIN/launch_impala" --env PongDeterministic-v4 --workers "$WORKERS" --seed "$SEED" \
        --total-frames "$FRAMES" --logdir "$LOGDIR" --no-progress --log-interval 10 \
        ${STOP:+--stop-at-return "$STOP"} "$@"
fi
TITLE="PongDeterministic-v4, launch_impala defaults, --workers $WORKERS"
if [ -n "${PLOT:-}" ]; then
    # shellcheck disable=SC2086
    "$PY" scripts/plot_curves.py $PLOT --hline 18 --title "$TITLE" --out "$OUT"
else
    "$PY" scripts/plot_curves.py "$LOGDIR" docs/data/sb3_pong_ref.csv \
        --labels "launch_impala, seed $SEED" "SB3 PPO reference (stopped at 2.3M frames)" \
        --hline 18 --title "$TITLE" --out "$OUT"
fi
