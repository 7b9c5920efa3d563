#!/usr/bin/env bash
# The GPU run: the fused loss and the group op against their baselines with the cost model beside
# them, the tests that need CUDA, and whole Qwen2-0.5B training steps, planned for a lease of 15 minutes of device
# time in all (the machine's start included) and at most 10 minutes a command. The exact device commands, the carried
# paths and the rule for the second call: docs/performance.md, "Running on a GPU".
#
#   bash bench/gpu_run.sh --call 1|2 [--return DIR] [--dry-run] OUTDIR    # a planned device call
#   bash bench/gpu_run.sh OUTDIR [--fast] [STEP...]                      # steps by hand (no plan, 570 s a step)
#   bash bench/gpu_run.sh OUTDIR merge                                    # here, after the calls
#
# The plan, by value: call 1 measures what the performance goals are about, call 2 what is left, and runs only when
# 5 minutes of device time remain after call 1. Each step is STEP:BUDGET:EXPECTED in seconds. BUDGET is the step's own timeout,
# so one slow step cannot eat the ones after it; "rest" is whatever the call has left. EXPECTED is what the step
# should take on an H100 (docs/performance.md says where each figure comes from); the budgets leave room for a 2x
# miss. Every step is also cut at the call's end (GFPO_CALL_SECONDS, minus RESERVE for the last archive), and a step
# left with under MIN_START seconds is skipped, not started.
PLAN_1=(setup:120:60 bench-loss:100:35 bench-group:45:20 tests-gpu:75:35 bench-e2e:rest:230)
PLAN_2=(profile:40:10 tune:60:30 tests-cuda:120:120 bench-e2e-more:180:150 bench-train:90:80 tests-rest:rest:120)
# Call 1's command runs under the run tool's timeout_s=480 (8 minutes): the script ends 15 s before, archive written.
# Call 2's length is the device time left after call 1 (docs/performance.md); 285 s fits the least it may run with.
CALL_SECONDS_1=465
CALL_SECONDS_2=285
RESERVE=${GFPO_RESERVE_SECONDS:-10}
MIN_START=${GFPO_MIN_START_SECONDS:-20}
#
# Steps:
#   setup        install .whl/ into /tmp/site, build the extension with CUDA (skipped when the wheels and csrc/ are
#                what this machine built last), print the environment                 -> env.txt
#   bench-loss   bench/test_bench_linear_grpo.py at the goal shape (N=16384, H=4096, V=151936, bf16, both masks):
#                ours, TRL 1.16's fused head, eager, one cuBLAS GEMM (Liger: by hand, 1.4 s a call, not a goal)
#                                                                                      -> STEM-loss.{json,md,png}
#                and bench/predicted_vs_measured.py, the cost model beside every case  -> STEM-model.md
#   bench-group  bench/test_bench_group_ops.py at 4096x16 and 8192x64                 -> STEM-group.{json,md,png}
#                and bench/group_kernel_time.py (device time, CUDA graphs)            -> group-kernel-time.txt
#   tests-gpu    the tests that run only on CUDA (tests/test_gpu.py, the CUDA-only cases of the loss and group
#                files) and the extension's (its ops, its ABI, validation, the report)   -> tests-gpu.log
#   bench-e2e    the EOS offset calibrated on the device (bench/e2e_inputs.py, 128 steps)  -> e2e-calibration.txt
#                then bench/e2e_driver.py run, interleaved, 1 warm-up and 2 timed steps of grpo-G8, gfpo-G16-k8 and
#                gfpo-G16-k8/without-micro-batch-crop (the crop's saving)           -> STEM-e2e-1.{json,md}
#                (the JSON is rewritten after every timed step: a step cut at its budget keeps the rounds done)
#   profile      bench/profile_fused_loss.py (torch.profiler top ops, goal shape)      -> profile.txt
#   tune         bench/tune.py --fast (tile size, row block, stage rows, buffer share; the model beside each value)
#                                                                                      -> tune.txt
#   tests-cuda   the rest of the test files whose code paths depend on the device (every backend on CUDA)
#                                                                                      -> tests-cuda.log
#   bench-e2e-more  the same as bench-e2e, 1 timed step of gfpo-G16-k8-no-savings and -token-efficiency, with
#                call 1's offset (GFPO_E2E_EOS_OFFSET)                                 -> STEM-e2e-2.{json,md}
#   bench-train  bench/test_bench_train_step.py (use_gfpo_kernels on/off, ~0.5B)       -> STEM-train.{json,md,png}
#   tests-rest   the rest of tests/ but the multi-process tests (they hide the GPU) and TRL's suite (its files
#                cannot be fetched there): device-independent, CI runs them too        -> tests-rest.log
#   merge        (here) one STEM.json from STEM-{group,loss,train}.json, one STEM-e2e.json from STEM-e2e-*.json,
#                their reports, then every result into bench/results/ under the STEM
# STEM = <date>-<gpu>-<commit>; GFPO_COMMIT=<sha> on the device (.git does not travel).
#
# Returned files (--return DIR, the run tool's $OUT, which returns at most 8 files): gpu-run-N.tgz (OUTDIR, written
# to a temporary name and renamed after every step and every TICK seconds, so that a call stopped at its limit still
# returns what it measured), gpu-run-N.log (everything printed, as it is printed) and gpu-run-N-summary.txt.
# --dry-run: prints the plan (PLAN lines: call, step, budget, expected) and the commands, runs nothing.
# GFPO_GPU_RUN_ON_CPU=1: rehearsal on a machine without CUDA: no wheels, no build, Triton interpreter, small sizes,
# the CPU variant of each command (the test steps collect their selection without running it, but for tests-gpu).
{ # the whole script in one compound command: bash parses it before running any of it, so editing the file while a
  # rehearsal runs cannot change (or break) the running copy
set -uo pipefail
cd "$(dirname "$0")/.."
ARGS=("$@")
usage() {
  echo "usage: bench/gpu_run.sh [--call 1|2] [--return DIR] [--dry-run] OUTDIR [--fast] [STEP...]" >&2
  exit 2
}
ALL_STEPS=" setup bench-loss bench-group tests-gpu bench-e2e profile tune tests-cuda bench-e2e-more bench-train
            tests-rest merge "
CALL="" RETURN_DIR="" DRY=0 FAST=0 OUTDIR="" STEPS=()
while [ $# -gt 0 ]; do
  case $1 in
    --call) CALL=${2:-}; shift; [[ $CALL =~ ^[12]$ ]] || usage ;;
    --return) RETURN_DIR=${2:-}; shift; [ -n "$RETURN_DIR" ] || usage ;;
    --dry-run) DRY=1 ;;
    --fast) FAST=1 ;;
    -*) usage ;;
    *) if [ -z "$OUTDIR" ]; then OUTDIR=$1
       elif [[ $ALL_STEPS == *" $1 "* ]]; then STEPS+=("$1")
       else echo "unknown step: $1" >&2; usage; fi ;;
  esac
  shift
done
[ -n "$OUTDIR" ] || usage
if [ -n "$CALL" ]; then
  [ ${#STEPS[@]} -eq 0 ] || { echo "--call runs its plan: no STEP arguments" >&2; usage; }
  FAST=1  # the goal sizes only
  plan_var="PLAN_$CALL[@]"; PLAN=("${!plan_var}")
  seconds_var=CALL_SECONDS_$CALL; CALL_SECONDS=${GFPO_CALL_SECONDS:-${!seconds_var}}
else
  [ ${#STEPS[@]} -eq 0 ] && STEPS=(setup bench-loss bench-group tests-gpu bench-e2e profile tune tests-cuda
                                   bench-e2e-more bench-train tests-rest)
  PLAN=(); for s in "${STEPS[@]}"; do PLAN+=("$s:${GFPO_STEP_TIMEOUT:-570}:-"); done  # under the 600 s per command
  CALL_SECONDS=0  # no call deadline
fi
[ -z "$RETURN_DIR" ] || [ -n "$CALL" ] || { echo "--return goes with --call" >&2; usage; }

# Everything printed also goes to RETURN_DIR as it is printed: the script runs again with its output through tee
# (a pipeline, so tee has written the last line before the call returns, which an `exec > >(tee)` does not promise).
if [ -n "$RETURN_DIR" ] && [ "$DRY" = 0 ] && [ -z "${GFPO_GPU_RUN_TEED:-}" ]; then
  mkdir -p "$RETURN_DIR"
  GFPO_GPU_RUN_TEED=1 bash "$0" "${ARGS[@]}" 2>&1 | tee -a "$RETURN_DIR/gpu-run-$CALL.log"
  exit "${PIPESTATUS[0]}"
fi

export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
ON_CPU=${GFPO_GPU_RUN_ON_CPU:-0}
PY=${PYTHON:-python3}
if [ "$ON_CPU" = 1 ]; then
  export TRITON_INTERPRET=1 GFPO_TEST_DEVICE=cpu
else
  unset TRITON_INTERPRET  # compiled Triton on CUDA: the interpreter would time Python, not kernels
  [ -d /tmp/site ] && export PYTHONPATH=$PWD:/tmp/site
fi

# Tests. The CUDA-only cases outside tests/test_gpu.py: those that skip without CUDA (the Triton interpreter cannot
# run them) and the device guards; call 1 runs them, call 2's tests-cuda the rest of their files.
TESTS_GPU=(tests/test_gpu.py tests/test_extension.py tests/test_extension_abi.py tests/test_validation.py
           tests/test_env_report.py
           tests/test_fused_linear_grpo.py::test_weight_gradient_finished_in_at_most_one_pass
           tests/test_fused_linear_grpo.py::test_one_host_read_per_forward
           tests/test_fused_linear_grpo.py::test_logits_gradient_rounded_once
           tests/test_fused_linear_grpo.py::test_one_chunk_writes_the_gradients_in_the_parameter_dtype
           tests/test_fused_linear_grpo.py::test_never_materialises_all_logits
           tests/test_fused_linear_grpo.py::test_no_buffer_spans_every_token_at_the_default_budget
           tests/test_fused_linear_grpo.py::test_triton_launches_make_the_tensors_device_current
           tests/test_group_ops.py::test_triton_launch_makes_the_tensors_device_current)
# The other files whose code paths depend on the device (DEVICE is cuda there, the extension is the CUDA build);
# test_fused_head.py runs on the CPU (use_cpu=True) but failed only on the H100 at cec7c50.
TESTS_CUDA=(tests/test_group_ops.py tests/test_fused_linear_grpo.py tests/test_extension_loading.py
            tests/test_fused_loss_cost.py tests/test_fused_head.py)
# The multi-process tests hide the GPU (CUDA_VISIBLE_DEVICES="", gloo on CPU) and take minutes; TRL's suite needs
# TRL's test files, which that machine cannot fetch.
TESTS_NEVER=(tests/test_trainer_multiprocess.py tests/test_row_exchange.py tests/test_fsdp2_fused_head.py
             tests/test_zero3_fused_head.py tests/trl_suite)

# ------------------------------------------------------------------------------------------------ the plan
plan_field() { local IFS=: f; read -r -a f <<<"$1"; echo "${f[$2 - 1]}"; }  # entry, 1-3: name, budget, expected
if [ "$DRY" = 1 ]; then  # the plan, then every step's commands as the loop below would run them, none run
  echo "call ${CALL:-by hand}: ${CALL_SECONDS} s (0: no deadline), reserve ${RESERVE} s," \
       "steps under ${MIN_START} s left skipped"
  for entry in "${PLAN[@]}"; do
    echo "PLAN call=${CALL:-0} step=$(plan_field "$entry" 1) budget=$(plan_field "$entry" 2)" \
         "expected=$(plan_field "$entry" 3)"
  done
  RETURN_DIR=""
fi

[ "$DRY" = 1 ] || mkdir -p "$OUTDIR"
commit=${GFPO_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo nocommit)}
gpu() {
  { [ "$DRY" = 1 ] || [ -n "${GFPO_GPU_RUN_STUB+x}" ]; } && { echo gpu; return; }
  "$PY" -c 'import torch,re; n=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"; m=re.search(r"[A-Z]\d{2,4}", n); print((m.group(0) if m else re.sub(r"[^A-Za-z0-9]+","-",n)).lower())' 2>/dev/null || echo unknown
}
STEM="$(date -u +%F)-$(gpu)-$commit"
START=$SECONDS
CALL_END=$((CALL_SECONDS > 0 ? START + CALL_SECONDS : 1 << 62))
STEP_END=$CALL_END
SUMMARY=()

snapshot() {  # OUTDIR -> RETURN_DIR/gpu-run-N.tgz: tar to a temporary name beside it, then rename (atomic)
  [ -n "$RETURN_DIR" ] || return 0
  local tmp="$RETURN_DIR/partial-$BASHPID.tgz"
  tar czf "$tmp" -C "$OUTDIR" . 2>/dev/null
  [ $? -le 1 ] && mv -f "$tmp" "$RETURN_DIR/gpu-run-$CALL.tgz"  # 1: a file changed while read; the archive holds
  rm -f "$tmp"
}
write_summary() {
  [ "$DRY" = 0 ] || return 0
  { echo "stem $STEM  call ${CALL:-by hand}  ${CALL_SECONDS} s  elapsed $((SECONDS - START)) s"
    printf '%s\n' "${SUMMARY[@]}"
    [ -n "${GFPO_E2E_EOS_OFFSET:-}" ] && echo "GFPO_E2E_EOS_OFFSET=$GFPO_E2E_EOS_OFFSET"
  } >"$OUTDIR/summary-${CALL:-0}.txt"  # per call: both calls' archives are unpacked into one folder here
  [ -z "$RETURN_DIR" ] || cp "$OUTDIR/summary-$CALL.txt" "$RETURN_DIR/gpu-run-$CALL-summary.txt"
}
if [ -n "$RETURN_DIR" ]; then
  TICK=${GFPO_SNAPSHOT_SECONDS:-15}
  # its output away from the pipe to tee: a sleep holding it would keep the call open after the script ends
  ( while sleep "$TICK"; do snapshot; done ) >/dev/null 2>&1 &
  TICKER=$!
  trap 'kill "$TICKER" 2>/dev/null' EXIT
fi
write_summary

run_step() {  # name, command...: under what is left of the step's budget, log in OUTDIR/<name>.log
  local name=$1; shift
  local left=$((STEP_END - SECONDS))
  if [ "$DRY" = 1 ]; then echo "RUN $name (timeout ${left}s): $*"; return 0; fi
  if [ "$left" -lt 5 ]; then echo "=== $name: skipped, ${left}s left in the step"; return 124; fi
  if [ -n "${GFPO_GPU_RUN_STUB+x}" ]; then  # tests/test_gpu_run_plan.py: each command a sleep, "NAME=SECONDS ..."
    local secs=0 kv
    for kv in $GFPO_GPU_RUN_STUB; do [ "${kv%%=*}" = "$name" ] && secs=${kv#*=}; done
    set -- bash -c 'echo "stub $0"; echo GFPO_E2E_EOS_OFFSET=0.5; sleep "$1"' "$name" "$secs"
  fi
  echo "=== $name: $* (timeout ${left}s)"
  local t0=$SECONDS
  timeout -k 10 "$left" "$@" 2>&1 | tee "$OUTDIR/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name: rc=$rc in $((SECONDS - t0))s"
  return "$rc"
}

wheel_stamp() { cat .whl/* | sha256sum | cut -d' ' -f1; }  # the carried wheels, by content (3.4 MiB)
# What the extension is built from, by content: the tree is copied afresh for every call, so mtimes say nothing.
source_stamp() {
  { "$PY" -c 'import torch; print(torch.__version__)'; cat setup.py csrc/*; } | sha256sum | cut -d' ' -f1
}
EXT_STAMP=/tmp/gfpo-extension.stamp
extension_current() {
  [ "$(cat "$EXT_STAMP" 2>/dev/null)" = "$(source_stamp)" ] &&
    "$PY" -c 'import importlib.util as u, sys; sys.exit(u.find_spec("gfpo_kernels._C") is None)' 2>/dev/null
}

step_setup() {
  if [ "$ON_CPU" != 1 ]; then
    if [ "$DRY" = 1 ] || [ "$(cat /tmp/site/.installed 2>/dev/null)" != "$(wheel_stamp)" ]; then
      rm -rf /tmp/site
      run_step setup-wheels "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || return 1
      # Packages that PyPI has as sdists only (none today; scripts/gpu_wheels.sh says which): built here, with the
      # image's setuptools (no isolation: nothing can be fetched).
      for sdist in .whl/*.tar.gz; do
        [ -e "$sdist" ] || continue
        run_step setup-sdist "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --no-cache-dir \
          --target /tmp/site "$sdist" || return 1
      done
      [ "$DRY" = 1 ] || wheel_stamp >/tmp/site/.installed
    fi
    export PYTHONPATH=$PWD:/tmp/site
    if [ "$DRY" = 0 ] && extension_current; then
      echo "=== setup-build: the extension is built from this csrc/ already"
    else
      # Against the machine's torch, no isolation, on the LibTorch stable ABI (as scripts/cuda_wheel.sh builds the
      # wheel); TORCH_CUDA_ARCH_LIST=9.0 builds sm_90 code only (fast build). A failed build does not stop the call:
      # the Triton paths still measure, env.txt says the extension is missing, the build log comes back.
      if TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=16 run_step setup-build \
           "$PY" setup.py -q build_ext --inplace; then
        [ "$DRY" = 1 ] || source_stamp >"$EXT_STAMP"
      else
        echo "=== setup-build FAILED: going on without the extension"
      fi
    fi
  fi
  [ "$DRY" = 1 ] && { echo "RUN env (env.txt): nvidia-smi, versions, the imports, the environment report"; return 0; }
  [ -n "${GFPO_GPU_RUN_STUB+x}" ] && { run_step env; return; }
  {
    echo "stem: $STEM"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>/dev/null
    "$PY" - <<'EOF'
import importlib.metadata as md, platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda)
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("device", p.name, "SMs", p.multi_processor_count, "mem GiB", round(p.total_memory / 2**30, 1))
for d in ("triton", "transformers", "trl", "accelerate", "datasets", "liger-kernel", "peft", "fastdigest",
          "pytest-benchmark", "pytest-timeout", "hypothesis"):
    try:
        print(d, md.version(d))
    except md.PackageNotFoundError:
        print(d, "MISSING")
import gfpo_kernels, trl, datasets, fastdigest  # noqa: the imports the benchmarks and the trainer need
from gfpo_kernels import _dispatch
print("HAS_TRITON", _dispatch.HAS_TRITON, "HAS_CPP", getattr(_dispatch, "HAS_CPP", None), "HAS_CPP_CUDA", getattr(_dispatch, "HAS_CPP_CUDA", None))
print("group backends", gfpo_kernels.available_backends("group", "cuda" if torch.cuda.is_available() else "cpu"))
from gfpo_kernels.env_report import environment_report  # the extension's state and build record among it
print(environment_report())
EOF
  } 2>&1 | tee "$OUTDIR/env.txt"
  return "${PIPESTATUS[0]}"
}

pytest_step() {  # name, pytest arguments...: -v, so a run cut at its budget has every finished test in its log
  local name=$1; shift
  local extra=(-p no:cacheprovider -ra --durations=15)
  if [ "$ON_CPU" = 1 ] && [ "$name" != tests-gpu ]; then
    extra+=(--collect-only -q)  # the selection is checked; running it is CI's job on a CPU
  else
    extra+=(-v)
    # one hung test, not the whole step (pytest-timeout is listed on the GPU image; without it --timeout would stop
    # pytest at once)
    [ "$ON_CPU" = 1 ] || ! "$PY" -c 'import pytest_timeout' 2>/dev/null || extra+=(--timeout=120)
  fi
  run_step "$name" "$PY" -m pytest "$@" "${extra[@]}"
}
step_tests_gpu() { pytest_step tests-gpu "${TESTS_GPU[@]}"; }
step_tests_cuda() {
  local deselect=()
  for t in "${TESTS_GPU[@]}"; do [[ $t == *::* ]] && deselect+=(--deselect "$t"); done
  pytest_step tests-cuda "${TESTS_CUDA[@]}" "${deselect[@]}"
}
step_tests_rest() {
  local ignore=()
  for t in "${TESTS_GPU[@]}" "${TESTS_CUDA[@]}" "${TESTS_NEVER[@]}"; do
    [[ $t == *::* ]] || ignore+=(--ignore="$t")
  done
  pytest_step tests-rest tests/ "${ignore[@]}"
}

bench_step() {  # part, test files and pytest arguments...
  local part=$1; shift
  local json="$OUTDIR/$STEM-$part.json" extra=()
  if [ "$ON_CPU" = 1 ]; then
    extra=(--benchmark-min-rounds=1 --benchmark-max-time=0.01 --benchmark-warmup=off)
  elif [ "$FAST" = 1 ]; then
    extra=(--benchmark-min-rounds=5 --benchmark-max-time=0.2)
  else
    extra=(--benchmark-min-rounds=10 --benchmark-max-time=1.0)
  fi
  run_step "bench-$part" "$PY" -m pytest -q "$@" -p no:cacheprovider --benchmark-json "$json" "${extra[@]}"
  local rc=$?
  [ -s "$json" ] && run_step "report-$part" "$PY" bench/report.py "$json"  # its .md and .png
  return "$rc"
}

step_bench_loss() {
  local sel=()
  [ "$FAST" = 1 ] && sel=(-k "151936 and not liger")  # the goal shape; Liger takes 1.4 s a call and is no goal
  [ "$ON_CPU" = 1 ] && sel=(-k "not liger")  # the CPU size (N=128, H=64, V=1000)
  bench_step loss bench/test_bench_linear_grpo.py "${sel[@]}"
  local rc=$? json="$OUTDIR/$STEM-loss.json"
  [ -s "$json" ] || return "$rc"
  # The cost model's predictions beside the measurements: where it misses, recalibrate bench/fused_loss_cost.py
  # from this run. The one line that runs the model:
  run_step model "$PY" bench/predicted_vs_measured.py "$json"
  [ -f "$OUTDIR/model.log" ] && mv "$OUTDIR/model.log" "$OUTDIR/$STEM-model.md"
  return "$rc"
}

step_bench_group() {
  local sel=()
  [ "$FAST" = 1 ] && sel=(-k "4096x16 or 8192x64")
  [ "$ON_CPU" = 1 ] && sel=(-k "64x8")
  bench_step group bench/test_bench_group_ops.py "${sel[@]}"
  local rc=$?
  [ "$ON_CPU" = 1 ] || run_step group-kernel-time "$PY" bench/group_kernel_time.py || rc=$?
  [ -f "$OUTDIR/group-kernel-time.log" ] && mv "$OUTDIR/group-kernel-time.log" "$OUTDIR/group-kernel-time.txt"
  return "$rc"
}

step_bench_train() {
  local files=(bench/test_bench_train_step.py bench/test_bench_early_stop.py bench/test_bench_skip_zero_rows.py)
  [ "$FAST" = 1 ] && files=(bench/test_bench_train_step.py)
  [ "$ON_CPU" = 1 ] && files=(bench/test_bench_early_stop.py -k "4-rule-on")
  bench_step train "${files[@]}"
}

step_bench_e2e() {  # part, timed rounds, arms...: the EOS offset calibrated here unless given, then the arms' steps
  local part=$1 rounds=$2; shift 2
  local size=qwen2-0.5b json="$OUTDIR/$STEM-e2e-$part.json"
  [ "$ON_CPU" = 1 ] && size=cpu-small rounds=1
  rounds=${GFPO_E2E_ROUNDS:-$rounds}
  if [ -z "${GFPO_E2E_EOS_OFFSET:-}" ]; then
    # 128 steps of 4 samples a prompt, as the committed offset was found on a CPU; no second generation to measure
    # the lengths (the arms without early stop report them): 1024 steps would cost a minute here
    run_step e2e-calibration "$PY" bench/e2e_inputs.py "$size" --steps 128 --no-measure || return  # its status
    local offset=OFFSET
    if [ "$DRY" = 0 ]; then
      mv "$OUTDIR/e2e-calibration.log" "$OUTDIR/e2e-calibration.txt"
      offset=$(sed -n 's/^GFPO_E2E_EOS_OFFSET=//p' "$OUTDIR/e2e-calibration.txt")
    fi
    [ -n "$offset" ] || { echo "the calibration gave no offset"; return 1; }
    export GFPO_E2E_EOS_OFFSET=$offset
  fi
  echo "=== EOS offset $GFPO_E2E_EOS_OFFSET"
  run_step "bench-e2e-$part" "$PY" bench/e2e_driver.py run --size "$size" --arms "$@" --rounds "$rounds" \
    --warmup 1 --json "$json"
  local rc=$?
  [ -s "$json" ] || return "$rc"
  [ "$rc" = 0 ] || echo "=== bench-e2e-$part stopped (rc=$rc): $json holds the timed steps it finished"
  return "$rc"
}

step_profile() { run_step profile "$PY" bench/profile_fused_loss.py $([ "$ON_CPU" = 1 ] && echo --fast); }
step_tune() { run_step tune "$PY" bench/tune.py --fast; }

merge_json() {  # out, parts...: the parts' benchmarks in one JSON (the first part's header), the commit filled in
  "$PY" - "$@" <<'EOF'
import json, os, sys
out, parts = sys.argv[1], sys.argv[2:]
merged = json.load(open(parts[0]))
for p in parts[1:]:
    merged["benchmarks"] += json.load(open(p))["benchmarks"]
commit = os.environ.get("GFPO_COMMIT")
if commit and not (merged.get("commit_info") or {}).get("id"):  # the device has no .git: pytest-benchmark left it out
    merged["commit_info"] = {"id": commit, "dirty": False, "from": "GFPO_COMMIT (the stem)"}
json.dump(merged, open(out, "w"), indent=2)
print("merged", len(merged["benchmarks"]), "cases into", out)
EOF
}

step_merge() {  # here, over the files the device calls brought back into OUTDIR
  local parts e2e stem results=${GFPO_RESULTS_DIR:-bench/results}
  parts=($(ls "$OUTDIR"/*-group.json "$OUTDIR"/*-loss.json "$OUTDIR"/*-train.json 2>/dev/null))
  e2e=($(ls "$OUTDIR"/*-e2e-[0-9].json 2>/dev/null))
  if [ ${#parts[@]} -eq 0 ] && [ ${#e2e[@]} -eq 0 ]; then
    echo "no STEM-{group,loss,train,e2e-N}.json in $OUTDIR"; return 1
  fi
  if [ ${#parts[@]} -gt 0 ]; then
    stem=$(basename "${parts[0]}" .json); stem=${stem%-*}
    GFPO_COMMIT=${stem##*-} merge_json "$OUTDIR/$stem.json" "${parts[@]}" &&
      "$PY" bench/report.py "$OUTDIR/$stem.json" || return 1
  fi
  if [ ${#e2e[@]} -gt 0 ]; then
    stem=$(basename "${e2e[0]}" .json); stem=${stem%-e2e-*}
    GFPO_COMMIT=${stem##*-} merge_json "$OUTDIR/$stem-e2e.json" "${e2e[@]}" &&
      "$PY" bench/e2e_driver.py report "$OUTDIR/$stem-e2e.json" >/dev/null || return 1
  fi
  # into bench/results/ under the stem: the merged files, the model table, and the text files as STEM-<name>.txt
  mkdir -p "$results"
  local f name
  for f in "$OUTDIR/$stem".{json,md,png} "$OUTDIR/$stem"-{model.md,e2e.json,e2e.md}; do
    [ -f "$f" ] && cp "$f" "$results/" && echo "-> $results/$(basename "$f")"
  done
  for f in "$OUTDIR"/env.txt "$OUTDIR"/group-kernel-time.txt "$OUTDIR"/e2e-calibration.txt "$OUTDIR"/profile.log \
           "$OUTDIR"/tune.log "$OUTDIR"/tests-*.log "$OUTDIR"/summary-[12].txt; do
    [ -f "$f" ] || continue
    name=$(basename "$f"); name=${name%.*}
    cp "$f" "$results/$stem-$name.txt" && echo "-> $results/$stem-$name.txt"
  done
}

# A planned call may land on a bare machine (no /tmp/site, no CUDA build), and a warm one may hold older wheels or
# an extension built from other csrc/: the benchmarks' importorskip would drop TRL silently, or time old code. So
# on a GPU every call but merge runs setup first unless both are current (and a current setup takes seconds).
first=$(plan_field "${PLAN[0]}" 1)
if [ "$ON_CPU" != 1 ] && [ "$DRY" = 0 ] && [ "$first" != setup ] && [ "$first" != merge ] &&
   { [ "$(cat /tmp/site/.installed 2>/dev/null)" != "$(wheel_stamp)" ] || ! extension_current; }; then
  echo "=== this machine has no setup yet: running it first"
  PLAN=("${PLAN_1[0]}" "${PLAN[@]}")  # setup, as call 1 plans it
fi

status=0
for entry in "${PLAN[@]}"; do
  step=$(plan_field "$entry" 1) budget=$(plan_field "$entry" 2) expected=$(plan_field "$entry" 3)
  left=$((CALL_END - RESERVE - SECONDS))
  if [ "$budget" = rest ]; then timeout_s=$left; else timeout_s=$((budget < left ? budget : left)); fi
  if [ "$timeout_s" -lt "$MIN_START" ]; then
    echo ">>> step $step: skipped, ${left}s left in the call"
    SUMMARY+=("$(printf '%-15s budget %-5s expected %-4s skipped (%ss left)' "$step" "$budget" "$expected" "$left")")
    write_summary; snapshot
    continue
  fi
  STEP_END=$((SECONDS + timeout_s))
  t0=$SECONDS
  echo ">>> step $step: budget $budget s, expected $expected s, timeout ${timeout_s}s," \
       "$((SECONDS - START))s into the call"
  case $step in
    setup) step_setup ;;
    bench-loss) step_bench_loss ;;
    bench-group) step_bench_group ;;
    tests-gpu) step_tests_gpu ;;
    bench-e2e) step_bench_e2e 1 2 grpo-G8 gfpo-G16-k8 gfpo-G16-k8/without-micro-batch-crop ;;
    profile) step_profile ;;
    tune) step_tune ;;
    tests-cuda) step_tests_cuda ;;
    bench-e2e-more) step_bench_e2e 2 1 gfpo-G16-k8-no-savings gfpo-G16-k8-token-efficiency ;;
    bench-train) step_bench_train ;;
    tests-rest) step_tests_rest ;;
    merge) step_merge ;;
  esac
  rc=$?
  echo ">>> step $step: rc=$rc, $((SECONDS - t0))s"
  SUMMARY+=("$(printf '%-15s budget %-5s expected %-4s rc %-3s %ss' "$step" "$budget" "$expected" "$rc" "$((SECONDS - t0))")")
  write_summary; snapshot
  # A step cut at its budget (124) is the plan working, not a failure; the summary names it. Exit status 1 means a
  # step failed (the run tool reads 124 as the command timing out).
  [ $rc -ne 0 ] && [ $rc -ne 124 ] && status=1
  if [ "$step" = setup ] && [ $rc -ne 0 ]; then echo "setup failed: stopping"; status=1; break; fi
done
if [ -n "$RETURN_DIR" ]; then  # the ticker stopped first: a tar it began earlier must not replace the last archive
  kill "$TICKER" 2>/dev/null; wait "$TICKER" 2>/dev/null
  write_summary; snapshot; rm -f "$RETURN_DIR"/partial-*.tgz
fi
[ "$DRY" = 1 ] && exit 0
echo; cat "$OUTDIR/summary-${CALL:-0}.txt"
ls -la "$OUTDIR" ${RETURN_DIR:+"$RETURN_DIR"}
exit $status
}
