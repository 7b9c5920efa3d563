#!/usr/bin/env bash
# The tests in one command, on a fresh clone too: sets up .venv first when it is missing or stale
# (scripts/setup.sh --if-stale), then runs the whole suite, or pytest with the arguments given instead.
#   bash scripts/test.sh                      # tests/ and bench/ (benchmarks as tests, not timed)
#   bash scripts/test.sh tests/test_cli.py -x # only these
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --if-stale
if [ $# -eq 0 ]; then
  # pytest exits 5 when it ran no test: a failure for CI, like any other non-zero code
  exec .venv/bin/python -m pytest -q tests bench --benchmark-disable
fi
exec .venv/bin/python -m pytest -q --benchmark-disable "$@"
