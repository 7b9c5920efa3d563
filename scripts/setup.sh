#!/usr/bin/env bash
# Sets up .venv for gfpo on a fresh Linux machine:
#   1. torch 2.13.0, unless .venv already has a torch (install your own CUDA build there first to keep it). From
#      PyPI on Linux that is the CUDA build, with gigabytes of nvidia-* packages; GFPO_TORCH_INDEX_URL, when set, is
#      this one install's --index-url (https://download.pytorch.org/whl/cpu: the CPU build). Unset, pip's own
#      configuration decides, as CI needs (it reaches only its configured index);
#   2. this package alone, built WITHOUT build isolation, so the C++/CUDA extension compiles against that torch
#      (an isolated build cannot see it and stops with one line); its CUDA kernels too when nvcc is found, whatever
#      the torch (GFPO_CUDA=0 leaves them out);
#   3. its dependencies and extras (GFPO_EXTRAS, comma-separated: trainer,bench,test when unset; trainer,vllm for
#      vLLM on a GPU machine, docs/vllm.md), installed normally: wheels, or sdists built in their own isolated
#      environments with their own build tools (--no-build-isolation must never reach them: an sdist may need
#      build tools, such as Cython, that only its isolated build brings).
# Re-running it on an installed tree rebuilds the extension only when csrc/, setup.py or torch changed.
#
# `bash scripts/setup.sh --if-stale` (what scripts/demo.sh and scripts/test.sh run first) does nothing when .venv was
# set up by this script from the same sources and settings and still holds every requirement; else the whole setup.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS="${GFPO_EXTRAS:-trainer,bench,test}"
SETUP_STAMP=.venv/.gfpo-setup-stamp

setup_stamp() {  # what a finished setup depends on: this script, the package's build files, the settings, torch
  { cat scripts/setup.sh scripts/requirements.py setup.py pyproject.toml csrc/*
    echo "$EXTRAS ${GFPO_NO_EXTENSION:-0} ${GFPO_CUDA:-} ${TORCH_CUDA_ARCH_LIST:-}"
    .venv/bin/python -c "import importlib.metadata as m; print(m.version('torch'))" 2>/dev/null || true
  } | sha256sum | cut -d' ' -f1
}

if [ "${1:-}" = --if-stale ]; then
  if [ -x .venv/bin/python ] && [ "$(cat "$SETUP_STAMP" 2>/dev/null)" = "$(setup_stamp)" ] &&
     missing=$(.venv/bin/python scripts/requirements.py "$EXTRAS" --check); then
    echo "gfpo: .venv is up to date (set up from these sources, every requirement installed): setup skipped"
    exit 0
  fi
  if [ ! -x .venv/bin/python ]; then
    echo "gfpo: no .venv yet: setting it up (scripts/setup.sh, 1 to 3 minutes on an idle machine)"
  else
    echo "gfpo: .venv is stale (${missing:-sources or settings changed since its setup}): running scripts/setup.sh"
  fi
elif [ $# -gt 0 ]; then
  echo "usage: bash scripts/setup.sh [--if-stale]" >&2
  exit 2
fi
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade "pip>=23.1"
python -c "import torch" 2>/dev/null ||
  python -m pip install ${GFPO_TORCH_INDEX_URL:+--index-url "$GFPO_TORCH_INDEX_URL"} torch==2.13.0
# numpy (a dependency anyway) before the build, which imports torch: torch warns "Failed to initialize NumPy" without it
python -m pip install -q "setuptools>=77" numpy

# 2. the package (and its extension) alone; skipped when nothing it is built from changed
stamp_file=.venv/.gfpo-build-stamp
stamp=$( { python -c "import torch; print(torch.__version__)"; echo "${GFPO_NO_EXTENSION:-0} ${GFPO_CUDA:-} ${TORCH_CUDA_ARCH_LIST:-}";
           cat setup.py pyproject.toml csrc/*; } | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ] && python -m pip show gfpo >/dev/null 2>&1; then
  echo "gfpo: extension up to date (csrc/, setup.py and torch unchanged), not rebuilt"
else
  python -m pip install --no-build-isolation --no-deps -e .
  echo "$stamp" >"$stamp_file"
fi

# 3. the dependencies of the package and of the extras, read from the metadata just installed
python scripts/requirements.py "$EXTRAS" >.venv/gfpo-requirements.txt
python -m pip install -r .venv/gfpo-requirements.txt
setup_stamp >"$SETUP_STAMP"
