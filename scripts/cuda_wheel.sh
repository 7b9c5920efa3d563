#!/usr/bin/env bash
# Builds gfpo's wheel with its CUDA kernels from HEAD (commit first), and checks it (docs/install.md):
#   - gfpo-<version>-cp310-abi3-linux_x86_64.whl: one file for every Python >= 3.10 and every torch >= 2.10, built
#     against the torch of $PYTHON (default .venv/bin/python; a CPU torch will do) with the nvcc of CUDA_HOME (or
#     /usr/local/cuda, or PATH) for TORCH_CUDA_ARCH_LIST (default "8.0;9.0+PTX": A100, H100, PTX for later GPUs);
#   - its _C.abi3.so holds SASS for each architecture and PTX for the +PTX ones (cuobjdump);
#   - registers, stack and spills of every kernel (ptxas -v, from the build log): any spill fails the script;
#   - the wheel, installed apart, needs only the LibTorch stable ABI (tests/test_extension_abi.py), loads beside
#     $PYTHON's torch with `python -m gfpo_kernels` saying its CUDA kernels are there ("loaded, built with CUDA";
#     beside a CPU torch "loaded, CUDA kernels compiled, unusable: this torch is a CPU build"), and
#     its ops match the reference there (tests/test_extension.py, tests/test_group_ops.py).
# usage: bash scripts/cuda_wheel.sh [OUTDIR]      (default OUTDIR: dist/; the summary goes to stdout)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-$REPO/.venv/bin/python}
OUT=${1:-dist}
CUDA=${CUDA_HOME:-/usr/local/cuda}
export GFPO_CUDA=1 TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;9.0+PTX}
export NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }-Xptxas=-v"  # ptxas reports into the build log
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$OUT"

# from a clone of HEAD: the committed sources, a clean compile (ptxas reports only what it compiles), an exact commit
git clone -q "$REPO" "$work/src"
t0=$SECONDS
if ! (cd "$work/src" && "$PY" -m pip wheel -v --no-build-isolation --no-deps -w "$work/wheel" .) >"$work/build.log" 2>&1; then
  tail -40 "$work/build.log"
  exit 1
fi
wheel=$(ls "$work"/wheel/gfpo-*.whl)
cp "$wheel" "$OUT/"
echo "wheel: $OUT/$(basename "$wheel"), $(du -h "$wheel" | cut -f1), built in $((SECONDS - t0)) s with torch" \
  "$("$PY" -c 'import torch; print(torch.__version__)'), nvcc $("$CUDA/bin/nvcc" --version | grep -o 'release [0-9.]*')," \
  "TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
"$PY" -m pip install -q --no-deps --target "$work/site" "$wheel"
so=$(ls "$work"/site/gfpo_kernels/_C*.so)

# cuobjdump: the toolkit's, else one on PATH, else the copy Triton ships (a minimal toolkit may lack it)
cuobjdump=$(ls "$CUDA/bin/cuobjdump" 2>/dev/null || command -v cuobjdump ||
  "$PY" -c 'import pathlib, triton; print(pathlib.Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump")')
echo "== code objects in $(basename "$so") ($cuobjdump)"
"$cuobjdump" --list-elf "$so" | grep -o 'sm_[0-9a-z]*' | sort | uniq -c | sed 's/^ */SASS /'
"$cuobjdump" --list-ptx "$so" | grep -o 'sm_[0-9a-z]*' | sort | uniq -c | sed 's/^ */PTX  /'

echo "== registers and spills per kernel (ptxas -v)"
"$PY" - "$work/build.log" <<'EOF'
import re, subprocess, sys
log = open(sys.argv[1]).read()
rows, spills = [], 0
# ptxas: "Compiling entry function 'NAME' for 'sm_XX'", then "N bytes stack frame, N bytes spill stores, N bytes
# spill loads" and "Used N registers"
for name, arch, body in re.findall(r"Compiling entry function '(\w+)' for '(\w+)'(.*?)(?=Compiling entry|\Z)", log, re.S):
    stack, stores, loads = map(int, re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", body).groups())
    registers = int(re.search(r"Used (\d+) registers", body).group(1))
    demangled = subprocess.run(["c++filt", name], capture_output=True, text=True).stdout.strip()
    short = re.sub(r"\(.*", "", demangled.replace("gfpo::(anonymous namespace)::", ""))
    rows.append((short, arch, registers, stack, stores, loads))
    spills += stores + loads
assert rows, "no ptxas -v output in the build log"
print(f"{'kernel':52s} {'arch':6s} {'regs':>4s} {'stack':>5s} {'spill st/ld':>11s}")
for short, arch, registers, stack, stores, loads in sorted(rows):
    print(f"{short:52s} {arch:6s} {registers:4d} {stack:5d} {stores:5d}/{loads:<5d}")
if spills:
    sys.exit(f"spills: {spills} bytes")
EOF

echo "== the installed wheel beside torch $("$PY" -c 'import torch; print(torch.__version__)')"
cd "$work/site"  # the wheel's gfpo_kernels, not this checkout's
report=$("$PY" -m gfpo_kernels)
grep -E "^(gfpo|gfpo commit|torch|extension[^:]*):" <<<"$report"
# its CUDA kernels are registered: "built with CUDA" beside a CUDA torch, "compiled, unusable" beside a CPU one
grep -Eq "^extension gfpo_kernels._C: loaded, (built with CUDA|CUDA kernels compiled, unusable: .*)$" <<<"$report"
"$PY" -m pytest -q -p no:cacheprovider "$REPO/tests/test_extension_abi.py" "$REPO/tests/test_extension.py" \
  "$REPO/tests/test_group_ops.py" 2>&1 | tail -1
