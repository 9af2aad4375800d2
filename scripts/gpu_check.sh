#!/usr/bin/env bash
# One prepared run for a GPU box (16 cores + 1 GPU), fitting in about 9 minutes; nothing to build.
#
#   scripts/gpu_check.sh                     # writes everything under ${OUT:-gpu_out}/
#   PY=python OUT=$OUT scripts/gpu_check.sh  # a box whose own python has torch+cuda and `pip install -e .`
#
# 1. the learner update on the GPU (shallow net, fp32 and bf16+channels_last), ~40 s;
# 2. the mission's command, launch_impala --workers 16 on Pong with the defaults, for
#    PONG_SECONDS (default 330 s), stopping early at a mean return of 20; its metrics.csv,
#    console log and the curve (pong_w16.png) are kept. Issue 8's GPU targets: >= 18 within
#    5 minutes, >= 20 within 10.
# 3. end-to-end throughput against the env limit with 16 workers (60 s each side).
# Each step's figures go to OUT/summary.txt; a failing step does not stop the later ones.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_out}
PY=${PY:-.venv/bin/python}
BIN=$(dirname "$PY")
PONG_SECONDS=${PONG_SECONDS:-330}
mkdir -p "$OUT"
{
    echo "# $(date -u +%FT%TZ) $(hostname) cores=$(nproc)"
    nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} > "$OUT/summary.txt" 2>&1

echo "## learner update" >> "$OUT/summary.txt"
timeout 120 "$PY" scripts/bench_learner.py --device cuda --nets shallow --warmup 5 --iters 20 >> "$OUT/summary.txt" 2>&1
timeout 120 "$PY" scripts/bench_learner.py --device cuda --nets shallow --warmup 5 --iters 20 --bf16 --channels-last >> "$OUT/summary.txt" 2>&1

echo "## pong, --workers 16, ${PONG_SECONDS}s cap" >> "$OUT/summary.txt"
timeout $((PONG_SECONDS + 60)) "$BIN/launch_impala" --env PongDeterministic-v4 --workers 16 --seed 1 \
    --max-seconds "$PONG_SECONDS" --stop-at-return 20 --logdir "$OUT/pong_w16" --no-progress --log-interval 10 \
    > "$OUT/pong_w16.log" 2>&1
tail -3 "$OUT/pong_w16.log" >> "$OUT/summary.txt"
"$PY" scripts/plot_curves.py "$OUT/pong_w16" --labels "launch_impala --workers 16, seed 1" --hline 18 \
    --title "PongDeterministic-v4 on a GPU box, defaults" --out "$OUT/pong_w16.png" >> "$OUT/summary.txt" 2>&1

echo "## throughput, 16 workers" >> "$OUT/summary.txt"
timeout 200 "$PY" scripts/bench_throughput.py --workers 16 --seconds 60 >> "$OUT/summary.txt" 2>&1
cat "$OUT/summary.txt"
