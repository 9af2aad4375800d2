#!/usr/bin/env bash
# The multi-task Atari run of docs/MULTITASK.md: one agent on Pong and Space Invaders, with and
# without PopArt, the two runs side by side (so both see the same box), then the figure.
#
#   scripts/learn_multitask.sh                        # this box: 2 workers per run, 2 h each
#   SECONDS_PER_RUN=3600 FRAMES=4000000 scripts/learn_multitask.sh
#   SKIP_TRAIN=1 scripts/learn_multitask.sh           # only redraw docs/multitask.png
#
# Pong and Space Invaders share the same six minimal actions (NOOP FIRE RIGHT LEFT RIGHTFIRE
# LEFTFIRE), so no full action set is needed; Space Invaders' classic id skips 3 frames, so both
# run with a 4-frame skip (--env-kwargs; the DeepMind max-pool over the last two frames keeps the
# blinking lasers visible). Rewards are unclipped in both runs (the multi-task default): Pong
# scores +-1 per point, Space Invaders 5-30 per alien and 200 for the mothership.
set -euo pipefail
cd "$(dirname "$0")/.."
TASKS=${TASKS:-PongDeterministic-v4,SpaceInvadersDeterministic-v4}
SEED=${SEED:-1}
WORKERS=${WORKERS:-2}
FRAMES=${FRAMES:-10000000}            # the learning rate decays to 0 over it
SECONDS_PER_RUN=${SECONDS_PER_RUN:-7200}
ROOT=${ROOT:-runs/multitask}
PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")

if [ "${SKIP_TRAIN:-0}" != "1" ]; then
    for variant in popart no-popart; do
        "$BIN/launch_impala" --env "$TASKS" --env-kwargs '{"frameskip": 4}' --workers "$WORKERS" --seed "$SEED" \
            --total-frames "$FRAMES" --max-seconds "$SECONDS_PER_RUN" --"$variant" \
            --logdir "$ROOT/$variant-s$SEED" --no-progress --log-interval 30 "$@" > "$ROOT-$variant-s$SEED.log" 2>&1 &
    done
    wait
fi
"$PY" scripts/plot_multitask.py "$ROOT/popart-s$SEED" "$ROOT/no-popart-s$SEED" --labels "PopArt" "no PopArt" \
    --title "One agent, $TASKS (seed $SEED, $WORKERS workers each, both runs on one 2-core box)" --out docs/multitask.png
