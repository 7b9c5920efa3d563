#!/usr/bin/env bash
# CI step: the trainer tests against the OLDEST supported TRL (the main venv, .venv, carries the newest).
# Builds .venv-trl-oldest (git-ignored) like scripts/setup.sh builds .venv -- CPU torch, this package built
# without isolation and without deps so its extension compiles against that torch, then the dependencies with
# trl pinned to the oldest supported release -- and runs the tests that exercise the TRL hooks.
# Every install is safe under PIP_NO_CACHE_DIR (nothing relies on pip's cache). Usage: scripts/test_oldest_trl.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OLDEST_TRL="${GFPO_OLDEST_TRL:-1.14.2}"
VENV=.venv-trl-oldest
[ -d "$VENV" ] || python3 -m venv "$VENV"
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade "pip>=23.1"
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q torch==2.13.0
"$PY" -m pip install -q "setuptools>=64" wheel
"$PY" -m pip show gfpo >/dev/null 2>&1 || "$PY" -m pip install -q --no-build-isolation --no-deps -e .
"$PY" scripts/requirements.py trainer,test >"$VENV/gfpo-requirements.txt"
"$PY" -m pip install -q -r "$VENV/gfpo-requirements.txt" "trl==$OLDEST_TRL"
"$PY" -c "import trl, transformers, accelerate, torch; print('oldest-TRL venv: trl', trl.__version__,
'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'torch', torch.__version__)"
"$PY" -m pytest -q -x tests/test_trainer.py tests/test_trainer_multiprocess.py tests/test_early_stop.py \
  tests/test_grpo_loss_math.py tests/test_compat.py
