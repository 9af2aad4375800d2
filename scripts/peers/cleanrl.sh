#!/usr/bin/env bash
# cleanrl's PPO on EnvPool (ppo_atari_envpool.py, cleanrl 1.2.0) on Pong, in its own venv, for a window.
#
#   scripts/peers/cleanrl.sh published 1800    # its published Atari settings (every default of the script)
#   scripts/peers/cleanrl.sh cpu 1800          # the same, threads set for this 2-core CPU box
#   scripts/peers/cleanrl.sh setup             # only make the venv and fetch the script
#
# Writes runs/peers/cleanrl-<mode>/curve.csv (frames,time,mean_return_100), summary.json (CPU) and log.txt.
#
# Pins: cleanrl 1.2.0's ppo_atari_envpool.py, taken from the cleanrl 1.2.0 wheel on PyPI at setup time
# (not kept in this repository). cleanrl 1.2.0 itself pins envpool 0.6, gym 0.23.1 and Python < 3.11;
# this box's Python is 3.11, for which envpool's first wheels are 0.8.x (gym 0.26 API), so the script
# runs under cleanrl_run.py's EnvPool API shim (see there). torch is the same CPU build as ours.
#
# What this box forces on the published settings: nothing is passed. The script's --cuda default asks
# for a GPU only when torch sees one (`torch.cuda.is_available() and args.cuda`), so it runs on the CPU
# here by itself; its 10M-step budget and linear lr decay stay as published (the window ends the run).
source "$(dirname "$0")/lib.sh"

MODE=${1:-published}
WINDOW=${2:-1800}
CLEANRL_VERSION=1.2.0
PINS=("$PEER_TORCH" envpool==0.8.4 gym==0.26.2 gymnasium==1.4.0 numpy==1.26.4 tensorboard==2.21.0)
SCRIPT=$PEERS_DIR/cleanrl/ppo_atari_envpool.py

make_venv cleanrl "${PINS[@]}"
if [ ! -f "$SCRIPT" ]; then
    tmp=$(mktemp -d)
    # cleanrl 1.2.0 declares Python < 3.11: only its one file is used, so its metadata is not installed
    "$PEERS_DIR/cleanrl/venv/bin/pip" download -q --no-deps --ignore-requires-python \
        "cleanrl==$CLEANRL_VERSION" -d "$tmp"
    "$PEERS_DIR/cleanrl/venv/bin/python" - "$tmp"/cleanrl-"$CLEANRL_VERSION"-*.whl "$SCRIPT" <<'PY'
import hashlib, sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
data = zipfile.ZipFile(wheel).read("cleanrl/ppo_atari_envpool.py")
open(out, "wb").write(data)
print(f"peers: {out} from {wheel.rsplit('/', 1)[-1]} sha256 {hashlib.sha256(data).hexdigest()}")
PY
    rm -rf "$tmp"
fi
[ "$MODE" = setup ] && exit 0
case "$MODE" in
    published | cpu) ;;
    *) echo "usage: $0 published|cpu|setup [SECONDS]" >&2; exit 2 ;;
esac

OUT=${OUT:-$PEERS_DIR/cleanrl-$MODE}
run_monitored "$OUT" "$WINDOW" \
    "$PEERS_DIR/cleanrl/venv/bin/python" "$HERE/cleanrl_run.py" --mode "$MODE" \
    --script "$SCRIPT" --curve "$OUT/curve.csv" -- --seed 1
brief "$OUT"
