#!/usr/bin/env bash
# CI step: the trainer tests against the OLDEST supported TRL. The main venv (.venv, made by scripts/setup.sh)
# carries the newest; TRL is pure Python and the oldest release accepts the same transformers, accelerate and
# torch, so only TRL itself is installed apart, into a folder (.venv-trl-oldest, git-ignored) that is put ahead of
# .venv's site-packages: no second torch, no second build of the extension. Safe under PIP_NO_CACHE_DIR.
# Usage: scripts/test_oldest_trl.sh [--setup-only | pytest args]
#   (--setup-only: install that TRL when missing, and stop; GFPO_OLDEST_TRL overrides the version)
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST_TRL="${GFPO_OLDEST_TRL:-1.14.2}"
TARGET=.venv-trl-oldest
PY=.venv/bin/python
if ! PYTHONPATH="$TARGET" "$PY" -c "import trl, sys; sys.exit(trl.__version__ != '$OLDEST_TRL')" 2>/dev/null; then
  rm -rf "$TARGET"
  "$PY" -m pip install -q --no-deps --target "$TARGET" "trl==$OLDEST_TRL"
fi
if [ "${1:-}" = --setup-only ]; then
  exit 0
fi
export PYTHONPATH="$PWD/$TARGET${PYTHONPATH:+:$PYTHONPATH}"
# the dependencies TRL declares must hold with what .venv has (pip check of the shadowing release)
"$PY" - "$OLDEST_TRL" <<'PY'
import sys
from importlib.metadata import requires, version

from packaging.requirements import Requirement

import trl

assert trl.__version__ == sys.argv[1], f"expected trl {sys.argv[1]}, imported {trl.__version__} from {trl.__file__}"
missing = [str(r) for r in map(Requirement, requires("trl") or []) if r.marker is None
           and not r.specifier.contains(version(r.name), prereleases=True)]
assert not missing, f"trl {trl.__version__} needs {missing}"
import accelerate, torch, transformers  # noqa: E401
print("oldest-TRL check: trl", trl.__version__, "transformers", transformers.__version__, "accelerate",
      accelerate.__version__, "torch", torch.__version__)
PY
# Of the multi-process tests (about 100 s; the suite runs them all on the newest TRL) the one whose groups straddle
# the processes: GFPO's exchange of rows through TRL's batch on two processes, with and without the fused loss
"$PY" -m pytest -q -x -p no:cacheprovider tests/test_trainer.py \
  "tests/test_trainer_multiprocess.py::test_two_processes_straddling_groups" \
  tests/test_early_stop.py tests/test_grpo_loss_math.py tests/test_compat.py tests/test_trainer_semantics.py \
  tests/test_rows.py tests/test_fused_head.py "$@"
