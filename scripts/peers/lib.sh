# Shared by the peers' commands (sourced, not run). Every peer lives under runs/peers/ (git-ignored):
#   runs/peers/<peer>/venv          its own virtualenv, pinned, apart from the project's .venv
#   runs/peers/<peer>/freeze.txt    pip freeze of that venv, for the record
#   runs/peers/<peer>-<mode>/       one run: curve.csv, summary.json, log.txt
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PEERS_DIR=${PEERS_DIR:-$ROOT/runs/peers}
HERE=$ROOT/scripts/peers
# The interpreter the peers' venvs are made from: Python 3.11 (the project's), found as python3.11 or
# through pyenv; PEER_PYTHON overrides.
PEER_PYTHON=${PEER_PYTHON:-$(command -v python3.11 || echo "$HOME/.pyenv/versions/3.11.7/bin/python")}
# torch for every peer: the same CPU build as ours (pip finds 2.13.0+cpu on this box's local wheel path;
# elsewhere add --index-url https://download.pytorch.org/whl/cpu through PIP_INDEX_URL / PIP_EXTRA_INDEX_URL).
PEER_TORCH=${PEER_TORCH:-torch==2.13.0}
# The interpreter for monitor.py and plot.py: the project's venv (plot.py needs matplotlib).
PY=${PY:-$ROOT/.venv/bin/python}

# make_venv NAME PIP_ARGS...: create runs/peers/NAME/venv once and pip-install the pinned packages.
# A venv whose stamp matches the pins is reused; anything else is made again from scratch.
make_venv() {
    local name=$1
    shift
    local dir=$PEERS_DIR/$name
    local stamp="$*"
    if [ -x "$dir/venv/bin/python" ] && [ "$(cat "$dir/venv/.pins" 2>/dev/null)" = "$stamp" ]; then
        return 0
    fi
    echo "peers: making $dir/venv ($stamp)" >&2
    rm -rf "$dir/venv"
    mkdir -p "$dir"
    "$PEER_PYTHON" -m venv "$dir/venv"
    "$dir/venv/bin/pip" install -q "$@" >&2
    "$dir/venv/bin/pip" freeze > "$dir/freeze.txt"
    echo "$stamp" > "$dir/venv/.pins"
}

# run_monitored OUT SECONDS CMD...: run CMD alone for the window under monitor.py (the CPU figures,
# PEER_T0 for the curve's clock), its output to OUT/log.txt as well as the console.
run_monitored() {
    local out=$1 seconds=$2
    shift 2
    mkdir -p "$out"
    rm -f "$out/curve.csv" "$out/summary.json"
    "$PY" "$HERE/monitor.py" --seconds "$seconds" --summary "$out/summary.json" -- "$@" 2>&1 | tee "$out/log.txt"
}

# brief OUT: one line: rows, frames, frames/s, the last mean return, CPU busy and own.
brief() {
    "$PY" "$HERE/plot.py" --brief "$1" | tee -a "$1/log.txt"
}
