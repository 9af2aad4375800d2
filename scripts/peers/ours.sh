#!/usr/bin/env bash
# Ours on Pong for a window, measured the same way as the peers (scripts/peers/monitor.py), every default:
#
#   scripts/peers/ours.sh 1800
#
# = launch_impala --workers 2 --env PongDeterministic-v4 --max-seconds 1800 (learn_pong.sh's seed 1; the
# run folder and --no-progress, the console display, change no setting). Writes runs/peers/ours/curve.csv
# (our metrics.csv in the peers' columns, its clock moved to the launch), summary.json and log.txt;
# the run itself is runs/peers/ours/run/.
source "$(dirname "$0")/lib.sh"

WINDOW=${1:-1800}
OUT=${OUT:-$PEERS_DIR/ours}
run_monitored "$OUT" "$WINDOW" \
    "$ROOT/.venv/bin/launch_impala" --workers 2 --env PongDeterministic-v4 --max-seconds "$WINDOW" \
    --seed 1 --logdir "$OUT/run" --force --no-progress
"$PY" "$HERE/plot.py" --from-metrics "$OUT/run/metrics.csv" --summary "$OUT/summary.json" --curve "$OUT/curve.csv"
brief "$OUT"
