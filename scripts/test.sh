#!/usr/bin/env bash
# Runs the whole test suite. pytest's exit 5 ("no tests collected") is a failure here.
set -uo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: treating as failure" >&2
    exit 1
fi
exit "$rc"
