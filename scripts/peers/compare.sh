#!/usr/bin/env bash
# Ours and each peer in both modes on Pong, one after another, each alone for the same window; then one
# figure (mean return against minutes and against frames) and one table.
#
#   scripts/peers/compare.sh 30                 # 30 minutes each: 5 runs, about 2.6 hours in all
#   RUNS="ours cleanrl-cpu" scripts/peers/compare.sh 10      # a subset, in this order
#   PLOT_ONLY=1 scripts/peers/compare.sh 30     # no runs: the figure and table of the runs already in
#                                               # runs/peers/ (e.g. after two subsets in two sittings)
#
# Runs (RUNS, default all but the last): ours, cleanrl-published, cleanrl-cpu, sample_factory-published,
# sample_factory-cpu, sample_factory-cpu-vtrace. The venvs are made first, so no install falls inside a window. Nothing else should
# run meanwhile: each run's table row shows the machine's CPU busy fraction beside its own, so a run that
# shared the box shows it. Writes runs/peers/<run>/ (curve.csv, summary.json, log.txt), and
# runs/peers/compare-<N>min.png and .md (the table with the date, machine and versions).
source "$(dirname "$0")/lib.sh"

MINUTES=${1:-30}
SECONDS_EACH=$(awk -v m="$MINUTES" 'BEGIN { printf "%d", m * 60 }')
RUNS=${RUNS:-ours cleanrl-published cleanrl-cpu sample_factory-published sample_factory-cpu}
SETTLE=${SETTLE:-15}   # seconds between runs: the last one's processes gone, its files written

label() {
    case $1 in
        ours) echo "ours: launch_impala defaults, 2 workers x 4 envs" ;;
        cleanrl-published) echo "cleanrl ppo_atari_envpool, published" ;;
        cleanrl-cpu) echo "cleanrl ppo_atari_envpool, cpu (2 threads, pinned)" ;;
        sample_factory-published) echo "Sample Factory APPO, published (8x1 envs, sync)" ;;
        sample_factory-cpu) echo "Sample Factory APPO, cpu (2x8 envs, async)" ;;
        sample_factory-cpu-vtrace) echo "Sample Factory APPO, cpu + V-trace (returns not normalized)" ;;
        *) echo "$1" ;;
    esac
}

[ -n "${PLOT_ONLY:-}" ] && RUN_NOW="" || RUN_NOW=$RUNS
for run in $RUN_NOW; do
    case $run in
        ours) ;;
        cleanrl-*) "$HERE/cleanrl.sh" setup ;;
        sample_factory-*) "$HERE/sample_factory.sh" setup ;;
        *) echo "compare.sh: unknown run $run" >&2; exit 2 ;;
    esac
done

for run in $RUN_NOW; do
    echo "compare.sh: $run for $MINUTES min; load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
    case $run in
        ours) "$HERE/ours.sh" "$SECONDS_EACH" ;;
        cleanrl-*) "$HERE/cleanrl.sh" "${run#cleanrl-}" "$SECONDS_EACH" ;;
        sample_factory-*) "$HERE/sample_factory.sh" "${run#sample_factory-}" "$SECONDS_EACH" ;;
    esac
    sleep "$SETTLE"
done

dirs=() labels=()
for run in $RUNS; do
    dirs+=("$PEERS_DIR/$run")
    labels+=("$(label "$run")")
done

report=$PEERS_DIR/compare-${MINUTES}min
{
    echo "Pong, each run alone for $MINUTES minutes, one after another, $(date -u +%Y-%m-%d)."
    echo "Machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'), no GPU."
    echo "Versions: ours at $(git -C "$ROOT" rev-parse --short HEAD), $("$PY" -c 'import torch; print("torch", torch.__version__)');"
    for peer in cleanrl sample_factory; do
        [ -f "$PEERS_DIR/$peer/freeze.txt" ] || continue
        echo "  $peer: $(grep -i -E '^(envpool|gym|gymnasium|sample-factory|ale-py|torch|numpy)==' "$PEERS_DIR/$peer/freeze.txt" | tr '\n' ' ')"
    done
    echo
    "$PY" "$HERE/plot.py" "${dirs[@]}" --labels "${labels[@]}" --out "$report.png" \
        --title "Pong, each alone for $MINUTES min on this $(nproc)-core box"
} | tee "$report.md"
