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
# The unity extra brings a current protobuf (>=6.31; its compiled upb runtime) with mlagents-envs
# 0.28, whose metadata accepts it (protobuf>=3.6) but whose generated _pb2 modules only load on
# protobuf<3.21: impala/envs/mlagents_proto.py rebuilds those modules from the descriptors they
# ship. An older .venv with protobuf 3.20 is upgraded here.
.venv/bin/pip install -q -e ".[unity,mujoco,render,track,export,analysis,dev]"
# ML-Agents 0.28's own trainer code, for the parity tests only (tests/test_mlagents_parity.py).
# --no-deps: its metadata pins torch<1.9 and numpy<2 (tests/mlagents_shims.py makes it import on
# this stack), so `pip check` lists those two and h5py (stubbed there; only used to save buffers),
# and nothing else: mlagents and mlagents-envs both declare protobuf>=3.6, which the new one meets.
# attrs and cattrs are the pure-Python packages it imports at module level; cattrs<1.7 is its pin.
.venv/bin/pip install -q --no-deps "mlagents==0.28.0" "attrs==26.1.0" "cattrs==1.5.0"
