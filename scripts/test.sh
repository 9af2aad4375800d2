#!/usr/bin/env bash
# Runs the linter and formatter check (ruff, configured in pyproject.toml), then the whole test suite in two
# parts: the tests marked `serial` (their assertions are rates or CPU placement, which a second test running
# beside them would skew) run alone, after the rest has run on TEST_WORKERS pytest-xdist workers (default 2).
# Arguments go to both parts (e.g. `-k flood`, `tests/test_netns.py`); TEST_WORKERS=0 runs everything in one
# process. pytest's exit 5 ("no tests collected") is a failure only when neither part collected a test.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! .venv/bin/ruff check . || ! .venv/bin/ruff format --check .; then
    echo "ruff: fix the findings above (ruff format . rewrites the formatting)" >&2
    exit 1
fi
# --durations: the slowest tests, so the suite's time stays visible
.venv/bin/python -m pytest -q -n "${TEST_WORKERS:-2}" -m "not serial" --durations=25 "$@"
parallel=$?
echo "--- the serial tests, alone:"
.venv/bin/python -m pytest -q -m serial --durations=5 "$@"
serial=$?
if [ "$parallel" -eq 5 ] && [ "$serial" -eq 5 ]; then
    echo "pytest collected no tests: treating as failure" >&2
    exit 1
fi
for rc in "$parallel" "$serial"; do
    if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
        exit "$rc"
    fi
done
exit 0
