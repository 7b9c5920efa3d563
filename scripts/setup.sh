#!/usr/bin/env bash
# Sets up .venv for gfpo on a fresh Linux machine: torch (the CPU build 2.13.0 unless .venv already has a torch,
# e.g. your CUDA build), then this package with its extras, built without isolation so the C++/CUDA extension
# compiles against that torch instead of pulling a second one.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -c "import torch" 2>/dev/null || pip install torch==2.13.0
pip install "setuptools>=64" wheel
pip install --no-build-isolation -e ".[trainer,bench,test]"
