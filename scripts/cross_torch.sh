#!/usr/bin/env bash
# Builds gfpo's wheel against one torch and runs it under others: the LibTorch stable ABI's promise that one binary
# serves every torch from the one it targets (2.10) on (docs/install.md has the results of this script).
#
#   bash scripts/cross_torch.sh BUILD RUN [RUN...]
#
# BUILD, RUN: a torch version from PyPI (e.g. 2.10.0) or "here" (the torch of .venv: 2.13.0+cpu after
# scripts/setup.sh). A PyPI version gets its own venv, .venv-torch-<version> (git-ignored), with pytest and
# hypothesis; PyPI's Linux torch is a CUDA build: 2.8-3.9 GB to download, ~6 GB on disk (GFPO_CROSS_KEEP=0 deletes
# the venvs this call made, at the end). The wheel is built from a clone of HEAD, without isolation, with the CUDA
# kernels when nvcc is found and its major version matches a CUDA torch's (setup.py).
# Under each RUN torch the wheel is installed apart (pip --target) and
#   torch >= 2.10: python -m gfpo_kernels must say the extension is loaded, and the stable-ABI symbol check (against
#     that torch's own shim headers), tests/test_extension.py, test_group_ops.py and test_validation.py must pass;
#   torch < 2.10: the extension must be reported as not loaded, needing torch >= 2.10 (or, for a wheel built with
#     that torch, left out at build time), and test_group_ops.py and test_validation.py must pass on the reference.
# One line per pair is appended to $GFPO_CROSS_LOG (default: docs/cross-torch.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
LOG=${GFPO_CROSS_LOG:-$REPO/docs/cross-torch.txt}
[ $# -ge 2 ] || { sed -n 2,17p "$0"; exit 2; }
BUILD=$1
shift
work=$(mktemp -d)
made=()
cleanup() {
  rm -rf "$work"
  if [ "${GFPO_CROSS_KEEP:-1}" = 0 ]; then for venv in "${made[@]}"; do rm -rf "$venv"; done; fi
}
trap cleanup EXIT

python_for() {  # torch spec -> PY, that venv's python (the venv made when missing)
  PY=$REPO/.venv/bin/python
  [ "$1" = here ] && return
  local venv=$REPO/.venv-torch-$1
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
    made+=("$venv")
    "$venv/bin/python" -m pip install -q "torch==$1" numpy pytest hypothesis "setuptools>=77"
  fi
  PY=$venv/bin/python
}

python_for "$BUILD"
BUILD_PY=$PY
build_torch=$("$BUILD_PY" -c 'import torch; print(torch.__version__)')
git clone -q "$REPO" "$work/src"
(cd "$work/src" && "$BUILD_PY" -m pip wheel -q --no-build-isolation --no-deps -w "$work/wheel" .) >"$work/build.log" 2>&1 ||
  { tail -30 "$work/build.log"; exit 1; }
wheel=$(ls "$work"/wheel/gfpo-*.whl)
echo "built $(basename "$wheel") against torch $build_torch at $(git rev-parse --short=12 HEAD)"

status=0
for run in "$@"; do
  python_for "$run"
  site=$work/site-$run
  "$PY" -m pip install -q --no-deps --target "$site" "$wheel"
  run_torch=$("$PY" -c 'import torch; print(torch.__version__)')
  old=$("$PY" -c 'import torch; print(tuple(map(int, torch.__version__.split(".")[:2])) < (2, 10))')
  cd "$site"  # the wheel's gfpo_kernels, not this checkout's
  report=$("$PY" -m gfpo_kernels 2>&1)
  extension=$(grep "^extension gfpo_kernels._C:" <<<"$report")
  against=$(grep "^extension built against:" <<<"$report")
  if [ "$old" = True ]; then
    tests=("$REPO/tests/test_group_ops.py" "$REPO/tests/test_validation.py")
    want="not loaded: it (needs torch >= 2\.10|is not built \(torch \S+ at build time)"  # built with this torch
  else
    tests=("$REPO/tests/test_extension_abi.py" "$REPO/tests/test_extension.py" "$REPO/tests/test_group_ops.py"
           "$REPO/tests/test_validation.py")
    want="loaded, "
  fi
  # TRITON_INTERPRET=0: the C++ op and the reference only (the Triton interpreter of an older torch's triton is
  # not what this checks, and triton 3.6's fails under numpy 2.4)
  outcome=$(TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tail -1) || true
  cd "$REPO"
  verdict=pass
  if ! grep -qE "^extension gfpo_kernels._C: $want" <<<"$report" || ! grep -q " passed" <<<"$outcome" ||
     grep -q "failed\|error" <<<"$outcome"; then
    verdict=FAIL
    status=1
  fi
  line="$(date -u +%F) $(git rev-parse --short=12 HEAD) built with torch $build_torch, run under torch $run_torch: $verdict | ${extension#extension } | ${against#extension } | tests: $outcome"
  echo "$line" | tee -a "$LOG"
done
exit $status
