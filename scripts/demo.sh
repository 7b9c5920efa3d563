#!/usr/bin/env bash
# The demo in one command, on a fresh clone too: sets up .venv first when it is missing or stale
# (scripts/setup.sh --if-stale), then runs  python -m gfpo_study demo  with the arguments given
# (--quick: the smaller preset; --output-dir, --no-kernels, --verbose: docs/demo.md).
#   bash scripts/demo.sh --quick
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --if-stale
exec .venv/bin/python -m gfpo_study demo "$@"
