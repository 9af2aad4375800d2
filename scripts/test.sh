#!/usr/bin/env bash
# Runs the linter and formatter check (ruff, configured in pyproject.toml), then the whole test suite.
# pytest's exit 5 ("no tests collected") is a failure here.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/ruff check . || ! .venv/bin/ruff format --check .; then
    echo "ruff: fix the findings above (ruff format . rewrites the formatting)" >&2
    exit 1
fi
.venv/bin/python -m pytest -q --durations=25 "$@"  # the slowest tests, so the suite's time stays visible
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: treating as failure" >&2
    exit 1
fi
exit "$rc"
