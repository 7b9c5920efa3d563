#!/usr/bin/env bash
# Downloads into .whl/ (git-ignored) every wheel the lent GPU machine lacks for tests/ and bench/:
# cp312, manylinux x86_64, --no-deps, one version each. That machine (the device tool's H100/H200 image) has torch 2.11,
# transformers 5.17, accelerate 1.15, huggingface_hub 1.33, pandas, pyarrow, xxhash, fsspec, pytest-benchmark,
# hypothesis, py-cpuinfo, sortedcontainers; it lacks trl, datasets (+dill, multiprocess), liger-kernel, peft and
# fastdigest, all published as wheels (an sdist-only package would travel as its sdist, which bench/gpu_run.sh builds
# there with the image's setuptools).
#   bash scripts/gpu_wheels.sh          # ends with the size of what a device call sends (at most 64 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=.whl
mkdir -p "$DEST"
PY=${PYTHON:-python3}

# trl 1.16.0 requires transformers>=4.56.2, accelerate>=1.10.1, datasets>=4.7.0: all met there.
PINNED_BINARY=(
  trl==1.16.0
  datasets==4.8.4
  dill==0.4.0
  multiprocess==0.70.18
  liger-kernel==0.8.5
  peft==0.21.2
  fastdigest==0.12.0
)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)
for req in "${PINNED_BINARY[@]}"; do
  name=${req%%==*}
  if ls "$DEST"/"${name//-/_}"-* "$DEST"/"$name"-* >/dev/null 2>&1; then continue; fi
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${PLATFORMS[@]}" -d "$DEST" "$req"
done

# What each carried wheel requires (no extras); every name must be on that machine or in .whl/.
for w in "$DEST"/*.whl; do
  echo "== $(basename "$w")"
  unzip -p "$w" '*.dist-info/METADATA' | grep '^Requires-Dist' | grep -v 'extra ==' || true
done
du -sh "$DEST"

# What a device call sends (docs/performance.md, "Running on a GPU"): this checkout's tracked and untracked-not-ignored
# files, and the carried .whl/; the device tool refuses more than 64 MiB.
tree=$( (git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null || true) | awk '{s += $1} END {print s + 0}')
wheels=$(cat "$DEST"/* | wc -c)
echo "travels: tree $tree + $DEST $wheels = $((tree + wheels)) bytes (limit $((64 << 20)))"
[ $((tree + wheels)) -le $((64 << 20)) ] || { echo "over the device tool's 64 MiB: carry less" >&2; exit 1; }
