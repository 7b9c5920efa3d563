#!/usr/bin/env bash
# The whole GPU run (issue 12), in steps that each fit one device call (10 min). Wheels the GPU image lacks:
# scripts/gpu_wheels.sh (carried as .whl/). On an H100 (2026-11-23): setup 55 s (CUDA build included), tests
# 3.5 min, bench-group 13 s and bench-loss 63 s with --fast, bench-train 3 min, profile 10 s, tune 22 s.
#
#   bash bench/gpu_run.sh OUTDIR [--fast] [STEP...]
#
# STEPs (default: all, in this order): setup tests bench-group bench-loss bench-train bench-e2e bench-e2e-more profile
# tune
#   setup        install .whl/ into /tmp/site, build the extension with CUDA, print the environment (env.txt)
#   tests        pytest tests/ on CUDA (gpu-marked tests included)          -> tests.log
#   bench-group  pytest bench/test_bench_group_ops.py                         -> STEM-group.{json,md,png}
#                and bench/group_kernel_time.py (device time, CUDA graphs)     -> group-kernel-time.txt
#   bench-loss   pytest bench/test_bench_linear_grpo.py                       -> STEM-loss.{json,md,png}
#                and bench/predicted_vs_measured.py (the cost model beside it)  -> STEM-model.md
#   bench-train  pytest bench/test_bench_train_step.py test_bench_early_stop test_bench_skip_zero_rows
#                                                                             -> STEM-train.{json,md,png}
#   bench-e2e    bench/e2e_inputs.py: the EOS offset calibrated on the device   -> e2e-calibration.txt
#                then pytest bench/test_bench_e2e.py, arms grpo-G8, gfpo-G16-k8 and
#                gfpo-G16-k8/without-micro-batch-crop (the crop's saving)    -> STEM-e2e-1.json
#   bench-e2e-more  the same, arms gfpo-G16-k8-no-savings, -token-efficiency  -> STEM-e2e-2.json
#                (two steps: whole Qwen2-0.5B steps at 1024 tokens, 4 per arm, do not fit one call; not yet run
#                on a GPU: predicted 4-5 min each at 20-30 ms per decode step; GFPO_E2E_ROUNDS=2 if they run
#                long; with GFPO_E2E_EOS_OFFSET set, e.g. to the first call's, the calibration is skipped)
#   profile      bench/profile_fused_loss.py (torch.profiler top ops)         -> profile.txt
#   tune         bench/tune.py (tile size, row block/warps, chunk budget)     -> tune.txt
#   merge        (here, after the calls) one STEM.json from the STEM-{group,loss,train}.json, then its .md and .png;
#                one STEM-e2e.json from the STEM-e2e-*.json, then its .md (bench/e2e_driver.py report)
# STEM = <date>-<gpu>-<commit>; every file lands directly in OUTDIR. The device returns at most 8 files and one
# bench step writes 4-5: run it as `bash bench/gpu_run.sh /tmp/o STEP...; tar czf $OUT/o.tgz -C /tmp/o .` (with
# carry [".whl"] and GFPO_COMMIT=<sha>: .git does not travel) and unpack the files here before `merge`.
# --fast: fewer sizes (the issue's goal sizes only) and fewer rounds.
# GFPO_GPU_RUN_ON_CPU=1: rehearsal on a machine without CUDA: no wheels, no build, Triton interpreter, small
# sizes, tests/test_gpu.py only with GFPO_TEST_DEVICE=cpu.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${1:?usage: bench/gpu_run.sh OUTDIR [--fast] [STEP...]}
shift
FAST=0
STEPS=()
for arg in "$@"; do
  case $arg in
    --fast) FAST=1 ;;
    setup|tests|bench-group|bench-loss|bench-train|bench-e2e|bench-e2e-more|profile|tune|merge) STEPS+=("$arg") ;;
    *) echo "unknown argument: $arg" >&2; exit 2 ;;
  esac
done
[ ${#STEPS[@]} -eq 0 ] && STEPS=(setup tests bench-group bench-loss bench-train bench-e2e bench-e2e-more profile tune)
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
ON_CPU=${GFPO_GPU_RUN_ON_CPU:-0}
if [ "$ON_CPU" = 1 ]; then
  PY=${PYTHON:-python3}
  export TRITON_INTERPRET=1 GFPO_TEST_DEVICE=cpu
else
  PY=${PYTHON:-python3}
  unset TRITON_INTERPRET  # compiled Triton on CUDA: the interpreter would time Python, not kernels
  [ -d /tmp/site ] && export PYTHONPATH=$PWD:/tmp/site
fi
STEP_TIMEOUT=${GFPO_STEP_TIMEOUT:-570}  # under the device's 600 s per command

commit=${GFPO_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo nocommit)}
gpu() {
  "$PY" -c 'import torch,re; n=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"; m=re.search(r"[A-Z]\d{2,4}", n); print((m.group(0) if m else re.sub(r"[^A-Za-z0-9]+","-",n)).lower())' 2>/dev/null || echo unknown
}
STEM="$(date -u +%F)-$(gpu)-$commit"

run_step() {  # name, command...: runs under a timeout, log in OUTDIR/<name>.log, never stops the other steps
  local name=$1; shift
  echo "=== $name: $* (timeout ${STEP_TIMEOUT}s)"
  local t0=$SECONDS
  timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee "$OUTDIR/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
  return "$rc"
}

wheel_stamp() { ls -l .whl/ | sha256sum | cut -d' ' -f1; }  # the carried wheels: names and sizes

extension_current() {  # the extension imports here and is newer than every csrc/ file
  local so
  so=$("$PY" -c 'import importlib.util as u; s = u.find_spec("gfpo_kernels._C"); print(s.origin if s else "")' 2>/dev/null)
  [ -n "$so" ] && [ -z "$(find csrc -newer "$so" -type f | head -1)" ]
}

step_setup() {
  if [ "$ON_CPU" != 1 ]; then
    if [ "$(cat /tmp/site/.installed 2>/dev/null)" != "$(wheel_stamp)" ]; then
      rm -rf /tmp/site
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
      # Packages that PyPI has as sdists only (none today; scripts/gpu_wheels.sh says which): built here, with the
      # image's setuptools (no isolation: nothing can be fetched).
      for sdist in .whl/*.tar.gz; do
        [ -e "$sdist" ] || continue
        "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir --target /tmp/site "$sdist" || return 1
      done
      wheel_stamp >/tmp/site/.installed
    fi
    export PYTHONPATH=$PWD:/tmp/site
    # Against the machine's torch, no isolation, on the LibTorch stable ABI (as scripts/cuda_wheel.sh builds the
    # wheel); TORCH_CUDA_ARCH_LIST=9.0 builds sm_90 code only (fast build).
    TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=16 "$PY" setup.py -q build_ext --inplace || return 1
  fi
  {
    echo "stem: $STEM"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>/dev/null
    "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "SMs", p.multi_processor_count, "mem GiB", round(p.total_memory / 2**30, 1))
for d in ("triton", "transformers", "trl", "accelerate", "datasets", "liger-kernel", "fastdigest", "pytest-benchmark", "hypothesis"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "MISSING")
import gfpo_kernels, trl, datasets, liger_kernel, fastdigest  # noqa: the imports the suites need
from gfpo_kernels import _dispatch
print("HAS_TRITON", _dispatch.HAS_TRITON, "HAS_CPP", getattr(_dispatch, "HAS_CPP", None), "HAS_CPP_CUDA", getattr(_dispatch, "HAS_CPP_CUDA", None))
print("group backends", gfpo_kernels.available_backends("group", "cuda" if torch.cuda.is_available() else "cpu"))
from gfpo_kernels.env_report import environment_report  # the extension's state and build record among it
print(environment_report())
EOF
  } 2>&1 | tee "$OUTDIR/env.txt"
  return "${PIPESTATUS[0]}"
}

step_tests() {
  if [ "$ON_CPU" = 1 ]; then
    run_step tests "$PY" -m pytest -q -x tests/test_gpu.py -p no:cacheprovider
  else
    # The multi-process tests hide the GPU (CUDA_VISIBLE_DEVICES="", gloo on CPU) and take minutes; CI runs them.
    # tests/trl_suite needs TRL's test files, which this machine cannot fetch.
    run_step tests "$PY" -m pytest -q -ra --durations=15 tests/ -p no:cacheprovider --timeout=300 \
      --ignore=tests/test_trainer_multiprocess.py --ignore=tests/test_row_exchange.py \
      --ignore=tests/test_fsdp2_fused_head.py --ignore=tests/test_zero3_fused_head.py --ignore=tests/trl_suite
  fi
}

bench_step() {  # part, test files...
  local part=$1; shift
  local json="$OUTDIR/$STEM-$part.json" extra=()
  if [ "$ON_CPU" = 1 ]; then
    extra=(--benchmark-min-rounds=1 --benchmark-max-time=0.01 --benchmark-warmup=off)
  elif [ "$FAST" = 1 ]; then
    extra=(--benchmark-min-rounds=5 --benchmark-max-time=0.2)
  else
    extra=(--benchmark-min-rounds=10 --benchmark-max-time=1.0)
  fi
  run_step "bench-$part" "$PY" -m pytest -q "$@" -p no:cacheprovider --benchmark-json "$json" "${extra[@]}" || true
  [ -s "$json" ] && "$PY" bench/report.py "$json"
}

step_bench_group() {
  local sel=()
  { [ "$FAST" = 1 ] || [ "$ON_CPU" = 1 ]; } && sel=(-k "4096x16 or 8192x64")
  [ "$ON_CPU" = 1 ] && sel=(-k "64x8")
  bench_step group bench/test_bench_group_ops.py "${sel[@]}"
  [ "$ON_CPU" = 1 ] || run_step group-kernel-time "$PY" bench/group_kernel_time.py
  [ -f "$OUTDIR/group-kernel-time.log" ] && mv "$OUTDIR/group-kernel-time.log" "$OUTDIR/group-kernel-time.txt"
  return 0
}

step_bench_loss() {
  local sel=()
  [ "$FAST" = 1 ] && sel=(-k "151936")
  bench_step loss bench/test_bench_linear_grpo.py "${sel[@]}"
  # the cost model's predictions beside the measurements (issue 28): where it misses, recalibrate
  # gfpo_kernels/fused_loss_cost.py from this run
  local json="$OUTDIR/$STEM-loss.json"
  [ -s "$json" ] && "$PY" bench/predicted_vs_measured.py "$json" | tee "$OUTDIR/$STEM-model.md"
  return 0
}

step_bench_train() {
  local files=(bench/test_bench_train_step.py bench/test_bench_early_stop.py bench/test_bench_skip_zero_rows.py)
  [ "$FAST" = 1 ] && files=(bench/test_bench_train_step.py)
  [ "$ON_CPU" = 1 ] && files=(bench/test_bench_early_stop.py -k "4-rule-on")
  bench_step train "${files[@]}"
}

step_bench_e2e() {  # part, arms...: the EOS offset calibrated here unless given, then the arms' steps
  local part=$1; shift
  local size=qwen2-0.5b json="$OUTDIR/$STEM-e2e-$part.json" rounds=()
  if [ "$ON_CPU" = 1 ]; then size=cpu-small; rounds=(GFPO_E2E_ROUNDS=1); fi
  if [ -z "${GFPO_E2E_EOS_OFFSET:-}" ]; then
    run_step e2e-calibration "$PY" bench/e2e_inputs.py "$size" || return 1
    mv "$OUTDIR/e2e-calibration.log" "$OUTDIR/e2e-calibration.txt"
    local offset
    offset=$(sed -n 's/^GFPO_E2E_EOS_OFFSET=//p' "$OUTDIR/e2e-calibration.txt")
    [ -n "$offset" ] || { echo "the calibration gave no offset"; return 1; }
    export GFPO_E2E_EOS_OFFSET=$offset
  fi
  echo "=== EOS offset $GFPO_E2E_EOS_OFFSET"
  run_step "bench-e2e-$part" env GFPO_E2E_SIZE="$size" GFPO_E2E_ARMS="$*" "${rounds[@]}" \
    "$PY" -m pytest -q bench/test_bench_e2e.py -p no:cacheprovider -s --benchmark-json "$json" || true
  [ -s "$json" ] && "$PY" bench/e2e_driver.py report "$json" >/dev/null
}

fast_flag() { { [ "$FAST" = 1 ] || [ "$ON_CPU" = 1 ]; } && echo --fast; }
step_profile() { run_step profile "$PY" bench/profile_fused_loss.py $(fast_flag); }
step_tune() { run_step tune "$PY" bench/tune.py $(fast_flag); }

merge_json() {  # out, parts...: the parts' benchmarks in one pytest-benchmark JSON (the first part's header)
  "$PY" - "$@" <<'EOF'
import json, sys
out, parts = sys.argv[1], sys.argv[2:]
merged = json.load(open(parts[0]))
for p in parts[1:]:
    merged["benchmarks"] += json.load(open(p))["benchmarks"]
json.dump(merged, open(out, "w"), indent=2)
print("merged", len(merged["benchmarks"]), "cases into", out)
EOF
}

step_merge() {  # here, over the files the device calls brought back into OUTDIR
  local parts e2e stem
  parts=($(ls "$OUTDIR"/*-group.json "$OUTDIR"/*-loss.json "$OUTDIR"/*-train.json 2>/dev/null))
  e2e=($(ls "$OUTDIR"/*-e2e-[0-9].json 2>/dev/null))
  if [ ${#parts[@]} -eq 0 ] && [ ${#e2e[@]} -eq 0 ]; then
    echo "no STEM-{group,loss,train,e2e-N}.json in $OUTDIR"; return 1
  fi
  if [ ${#parts[@]} -gt 0 ]; then
    stem=$(basename "${parts[0]}" .json); stem=${stem%-*}
    merge_json "$OUTDIR/$stem.json" "${parts[@]}" && "$PY" bench/report.py "$OUTDIR/$stem.json" || return 1
  fi
  if [ ${#e2e[@]} -gt 0 ]; then
    stem=$(basename "${e2e[0]}" .json); stem=${stem%-e2e-*}
    merge_json "$OUTDIR/$stem-e2e.json" "${e2e[@]}" &&
      "$PY" bench/e2e_driver.py report "$OUTDIR/$stem-e2e.json" >/dev/null
  fi
}

# A device call after a pause may land on a bare machine (no /tmp/site, no CUDA build), and a warm one may hold
# older wheels or an extension built from older csrc/: the benchmarks' importorskip would drop TRL and Liger
# silently, or time old code. So every step on a GPU runs setup first unless both are current (setup itself
# reinstalls the wheels only when .whl/ changed; the build is incremental).
if [ "$ON_CPU" != 1 ] && [ "${STEPS[0]}" != setup ] && [ "${STEPS[0]}" != merge ] &&
   { [ "$(cat /tmp/site/.installed 2>/dev/null)" != "$(wheel_stamp)" ] || ! extension_current; }; then
  echo "=== this machine has no setup yet: running it first"
  STEPS=(setup "${STEPS[@]}")
fi

status=0
for step in "${STEPS[@]}"; do
  t0=$SECONDS
  case $step in
    setup) step_setup ;;
    tests) step_tests ;;
    bench-group) step_bench_group ;;
    bench-loss) step_bench_loss ;;
    bench-train) step_bench_train ;;
    bench-e2e) step_bench_e2e 1 grpo-G8 gfpo-G16-k8 gfpo-G16-k8/without-micro-batch-crop ;;
    bench-e2e-more) step_bench_e2e 2 gfpo-G16-k8-no-savings gfpo-G16-k8-token-efficiency ;;
    profile) step_profile ;;
    tune) step_tune ;;
    merge) step_merge ;;
  esac
  rc=$?
  echo ">>> step $step: rc=$rc, $((SECONDS - t0))s"
  [ $rc -ne 0 ] && status=$rc
  if [ "$step" = setup ] && [ $rc -ne 0 ]; then echo "setup failed: stopping"; exit $rc; fi
done
ls -la "$OUTDIR"
exit $status
