#!/usr/bin/env bash
# Real DeepSpeed ZeRO-3 on CPU (DS_ACCELERATOR=cpu, gloo, 2 processes): tests/test_zero3_fused_head.py. DeepSpeed is
# not a dependency of gfpo; it ships only an sdist whose setup.py imports torch, so it is built against .venv's
# torch (no build isolation, no ops built: a plain torch optimizer is used) into a folder (.venv-deepspeed,
# git-ignored) put on PYTHONPATH, with the requirements .venv lacks. Nothing is installed into .venv.
# Safe under PIP_NO_CACHE_DIR. Usage: scripts/test_zero3_cpu.sh [--setup-only | pytest args]
#   (--setup-only: install DeepSpeed when missing, and stop; GFPO_DEEPSPEED overrides the version, PY the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."
DEEPSPEED="${GFPO_DEEPSPEED:-0.19.8}"
TARGET=.venv-deepspeed
PY="${PY:-.venv/bin/python}"
if ! PYTHONPATH="$TARGET" "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('deepspeed') != '$DEEPSPEED')" \
    2>/dev/null; then
  rm -rf "$TARGET"
  DS_BUILD_OPS=0 "$PY" -m pip install -q --no-deps --no-build-isolation --target "$TARGET" "deepspeed==$DEEPSPEED"
  # the unconditional requirements of deepspeed that .venv does not have (hjson, msgpack, ...), beside it
  missing=$(PYTHONPATH="$TARGET" "$PY" - <<'PY'
from importlib.metadata import PackageNotFoundError, requires, version

from packaging.requirements import Requirement

for requirement in map(Requirement, requires("deepspeed") or []):
    if requirement.marker is None:
        try:
            version(requirement.name)
        except PackageNotFoundError:
            print(requirement)
PY
)
  if [ -n "$missing" ]; then
    # shellcheck disable=SC2086  # one requirement a word
    "$PY" -m pip install -q --no-deps --target "$TARGET" $missing
  fi
fi
if [ "${1:-}" = --setup-only ]; then
  exit 0
fi
export PYTHONPATH="$PWD/$TARGET${PYTHONPATH:+:$PYTHONPATH}" DS_ACCELERATOR=cpu
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_zero3_fused_head.py "$@"
