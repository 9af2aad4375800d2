#!/usr/bin/env bash
# One-time (idempotent) set-up: a virtualenv in .venv with this project and its extras.
# torch is installed first at the local CPU build (2.13.0) when the venv has none, because
# an open range would make pip download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    .venv/bin/pip install -q "torch==2.13.0"
fi
.venv/bin/pip install -q -e ".[unity,mujoco,track,dev]"
