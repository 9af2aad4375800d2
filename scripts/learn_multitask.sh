#!/usr/bin/env bash
# One agent on several Atari games from their raw scores (multi-task PopArt-IMPALA, docs/MULTITASK.md),
# and the single-task runs it is measured against: one arm per call, resumable, then the figure and table.
#
#   scripts/learn_multitask.sh                        # arm popart, seed 1, five games, 20M frames (4M each)
#   ARM=clipped SEED=2 scripts/learn_multitask.sh     # the IMPALA baseline: no PopArt, rewards clipped
#   ARM=raw scripts/learn_multitask.sh                # no PopArt, raw rewards
#   ARM=single scripts/learn_multitask.sh             # each game alone, FRAMES / games frames, the defaults
#   ARM=single-popart scripts/learn_multitask.sh      # each game alone with PopArt on raw rewards
#   FRAMES=400000 SECONDS_PER_RUN=600 scripts/learn_multitask.sh   # the 10-minute smoke form
#   SKIP_TRAIN=1 scripts/learn_multitask.sh           # only redraw the figure and table from the runs there
#   BASELINE_COST=0.25 scripts/learn_multitask.sh     # the value loss's weight (default: the launcher's);
#                                                     # the run folder says it: popart-bc0.25-s1
#   ENVS_PER_WORKER=5 scripts/learn_multitask.sh      # envs per actor (default: the launcher's, 20 for five
#                                                     # games on 2 actors); the folder says it: popart-k5-s1
#
# Multi-task arms (every other setting the launcher's defaults):
#   popart   PopArt per game, raw rewards (the multi-task default; Hessel et al. 2018)
#   clipped  no PopArt, rewards clipped to [-1, 1] (the IMPALA paper's agent)
#   raw      no PopArt, raw rewards
# Single-task arms, one run per game of FRAMES / (number of games) frames:
#   single         the single-task defaults (no PopArt, rewards clipped to [-1, 1])
#   single-popart  PopArt on raw rewards
# Every game runs with a 4-frame skip (SpaceInvaders' classic id skips 3; one network needs one skip, as in
# the paper), the single-task runs too, so per-game frames mean the same thing in every arm. Games whose
# minimal action sets differ play on the ALE's full 18 actions in a multi-task run. With 2 actors the
# launcher gives each 20 envs, 4 per game (8 per game in all, as a single-task run on 2 actors has), so
# every game gets the same frames; ENVS_PER_WORKER=5 is the setting of the runs before that default.
# Run one at a time: two runs on a 2-core box share its cores and each gets half. A run that stopped
# (Ctrl-C, a crash) continues where its checkpoint is when the same command is given again.
set -euo pipefail
cd "$(dirname "$0")/.."
GAMES=${GAMES:-PongDeterministic-v4,BreakoutDeterministic-v4,SpaceInvadersDeterministic-v4,BeamRiderDeterministic-v4,MsPacmanDeterministic-v4}
ARM=${ARM:-popart}
SEED=${SEED:-1}
WORKERS=${WORKERS:-2}
FRAMES=${FRAMES:-20000000}            # the whole multi-task run (the learning rate decays to 0 over it)
SECONDS_PER_RUN=${SECONDS_PER_RUN:-0} # 0: no time limit
BASELINE_COST=${BASELINE_COST:-}      # empty: the launcher's default
ENVS_PER_WORKER=${ENVS_PER_WORKER:-}  # empty: the launcher's default
ROOT=${ROOT:-runs/multitask}
PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")
IFS=, read -r -a GAME_LIST <<< "$GAMES"
PER_GAME=$((FRAMES / ${#GAME_LIST[@]}))

case "$ARM" in
    popart | single-popart) ARM_FLAGS=(--popart --reward-clip 0) ;;
    clipped) ARM_FLAGS=(--no-popart --reward-clip 1) ;;
    raw) ARM_FLAGS=(--no-popart --reward-clip 0) ;;
    single) ARM_FLAGS=() ;;
    *) echo "learn_multitask.sh: ARM must be popart, clipped, raw, single or single-popart, got '$ARM'" >&2; exit 2 ;;
esac
TAG=$ARM
if [ -n "$BASELINE_COST" ]; then
    # the launcher checks the value; the folder name, with the value as given (0.25 and 25 must not share
    # one), keeps runs with another weight apart from the arm's own
    ARM_FLAGS+=(--baseline-cost "$BASELINE_COST")
    TAG=$ARM-bc$BASELINE_COST
fi
if [ -n "$ENVS_PER_WORKER" ]; then
    ARM_FLAGS+=(--envs-per-worker "$ENVS_PER_WORKER")
    TAG=$TAG-k$ENVS_PER_WORKER
fi

train() {  # train ENV FRAMES FOLDER: one run, resumed where it stopped, skipped when finished
    local env=$1 frames=$2 run=$3
    if [ -f "$run/finished.json" ]; then
        echo "learn_multitask.sh: $run finished already"
        return
    fi
    local resume=()
    [ -f "$run/checkpoint.pt" ] && resume=(--resume)
    echo "learn_multitask.sh: training $run ($env, $frames frames), log $run.log"
    "$BIN/launch_impala" --env "$env" --env-kwargs '{"frameskip": 4}' --workers "$WORKERS" --seed "$SEED" \
        --total-frames "$frames" --max-seconds "$SECONDS_PER_RUN" "${ARM_FLAGS[@]}" --logdir "$run" \
        --no-progress --log-interval 30 "${resume[@]}" >> "$run.log" 2>&1 || {
        local rc=$?
        echo "learn_multitask.sh: $run stopped with exit $rc; its last line: $(tail -n 1 "$run.log")" >&2
        return "$rc"
    }
}

if [ "${SKIP_TRAIN:-0}" != "1" ]; then
    mkdir -p "$ROOT"
    case "$ARM" in
        single | single-popart)
            for game in "${GAME_LIST[@]}"; do
                train "$game" "$PER_GAME" "$ROOT/$TAG-${game%%Deterministic*}-s$SEED"
            done ;;
        *) train "$GAMES" "$FRAMES" "$ROOT/$TAG-s$SEED" ;;
    esac
fi
OUT=${OUT:-$ROOT/multitask.png}
"$PY" scripts/plot_multitask.py --root "$ROOT" --games "$GAMES" --out "$OUT"
echo "learn_multitask.sh: runs in $ROOT, figure $OUT, table ${OUT%.png}.md"
