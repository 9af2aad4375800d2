#!/usr/bin/env bash
# One agent on several Atari games from their raw scores (multi-task PopArt-IMPALA, docs/MULTITASK.md):
# one arm per call, resumable, then the figure.
#
#   scripts/learn_multitask.sh                        # arm popart, seed 1, five games, 20M frames
#   ARM=clipped SEED=2 scripts/learn_multitask.sh     # the IMPALA baseline: no PopArt, rewards clipped
#   ARM=raw scripts/learn_multitask.sh                # no PopArt, raw rewards
#   FRAMES=400000 SECONDS_PER_RUN=600 scripts/learn_multitask.sh   # the 10-minute smoke form
#   SKIP_TRAIN=1 scripts/learn_multitask.sh           # only redraw the figure from the runs there are
#
# Arms (every other setting the launcher's defaults):
#   popart   PopArt per game, raw rewards (the multi-task default; Hessel et al. 2018)
#   clipped  no PopArt, rewards clipped to [-1, 1] (the IMPALA paper's agent)
#   raw      no PopArt, raw rewards
# All games run with a 4-frame skip (SpaceInvaders' classic id skips 3; one network needs one skip, as in
# the paper). Games whose minimal action sets differ play on the ALE's full 18 actions. With 2 actors the
# launcher gives each 5 envs, one per game, so every game gets the same frames.
# Run one at a time: two runs on a 2-core box share its cores and each gets half.
set -euo pipefail
cd "$(dirname "$0")/.."
GAMES=${GAMES:-PongDeterministic-v4,BreakoutDeterministic-v4,SpaceInvadersDeterministic-v4,BeamRiderDeterministic-v4,MsPacmanDeterministic-v4}
ARM=${ARM:-popart}
SEED=${SEED:-1}
WORKERS=${WORKERS:-2}
FRAMES=${FRAMES:-20000000}            # for the whole run (the learning rate decays to 0 over it)
SECONDS_PER_RUN=${SECONDS_PER_RUN:-0} # 0: no time limit
ROOT=${ROOT:-runs/multitask}
PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")

case "$ARM" in
    popart) ARM_FLAGS=(--popart --reward-clip 0) ;;
    clipped) ARM_FLAGS=(--no-popart --reward-clip 1) ;;
    raw) ARM_FLAGS=(--no-popart --reward-clip 0) ;;
    *) echo "learn_multitask.sh: ARM must be popart, clipped or raw, got '$ARM'" >&2; exit 2 ;;
esac

RUN="$ROOT/$ARM-s$SEED"
if [ "${SKIP_TRAIN:-0}" != "1" ]; then
    mkdir -p "$ROOT"
    RESUME=()
    if [ -f "$RUN/finished.json" ]; then
        echo "learn_multitask.sh: $RUN already finished; drawing the figure"
    else
        [ -f "$RUN/checkpoint.pt" ] && RESUME=(--resume)
        "$BIN/launch_impala" --env "$GAMES" --env-kwargs '{"frameskip": 4}' --workers "$WORKERS" \
            --seed "$SEED" --total-frames "$FRAMES" --max-seconds "$SECONDS_PER_RUN" "${ARM_FLAGS[@]}" \
            --logdir "$RUN" --no-progress --log-interval 30 "${RESUME[@]}" "$@" >> "$RUN.log" 2>&1
    fi
fi
RUNS=()
LABELS=()
for arm in popart clipped raw; do
    for dir in "$ROOT/$arm"-s*; do
        [ -f "$dir/metrics.csv" ] && RUNS+=("$dir") && LABELS+=("$arm ${dir##*-}")
    done
done
OUT=${OUT:-$ROOT/multitask.png}
"$PY" scripts/plot_multitask.py "${RUNS[@]}" --labels "${LABELS[@]}" --out "$OUT"
echo "learn_multitask.sh: curve $RUN/metrics.csv, log $RUN.log, figure $OUT"
