"""Ahead-of-time compilation of every Triton kernel configuration the wrappers launch, for GPUs this machine does
not have: compile errors, registers and spills (local memory) per kernel, for sm_90 (H100/H200) and sm_80 (A100).

Triton compiles to PTX and runs its bundled ptxas without a GPU; `ptxas -v` (the same bundled ptxas) reports
registers and spills. Run: `python scripts/triton_aot.py [--arch 90 80] [--quick] [--json FILE]`, without
TRITON_INTERPRET=1 (Triton 3.9's interpreter mode breaks compilation in the same process).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import tempfile
import warnings

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from gfpo_kernels import group_ops_triton, linear_grpo_triton
from gfpo_kernels.loss_types import POLICY_TERMS


@dataclasses.dataclass
class Launch:
    """One configuration of a kernel as a wrapper launches it: argument types and constexpr values."""

    name: str
    kernel: object
    signature: dict
    constexprs: dict
    num_warps: int = 4


def _group_launches(group_sizes) -> list[Launch]:
    """The group kernel's modes (filter + advantages, advantages only, filter only) at the tile shape the wrapper
    picks for each group size G, with many groups (the widest ROWS)."""
    kernel = group_ops_triton._group_filter_advantages_kernel
    modes = {
        "filter+adv fp32, k int": dict(scores="*fp32", k=None, keep_in=None, rewards="*fp32", std=True),
        "filter+adv bf16, k per group": dict(scores="*bf16", k="*i64", keep_in=None, rewards="*fp32", std=True),
        "adv only, keep in": dict(scores=None, k=None, keep_in="*i1", rewards="*fp32", std=True),
        # scale="batch": centred fp64 rewards out, for the wrapper to divide by the batch std
        "adv only fp64, batch scale": dict(scores=None, k=None, keep_in=None, rewards="*fp64", std=False, adv="*fp64"),
        "filter only": dict(scores="*fp32", k=None, keep_in=None, rewards=None, std=False),
    }
    launches = []
    for G in group_sizes:
        rows, block_g, num_warps = group_ops_triton.launch_config(1 << 20, G)  # many groups: the widest tile
        for mode, m in modes.items():
            pointers = {"scores_ptr": m["scores"], "k_ptr": m["k"], "keep_in_ptr": m["keep_in"],
                        "rewards_ptr": m["rewards"], "keep_out_ptr": "*i1",
                        "adv_ptr": m.get("adv", "*fp32") if m["rewards"] else None}
            signature = {name: (kind or "constexpr") for name, kind in pointers.items()}
            signature.update(num_groups="i32", G="i32", k_scalar="i32")
            constexprs = {name: None for name, kind in pointers.items() if kind is None}
            constexprs.update(EPS=1e-4, LARGEST=False, HAS_SCORES=m["scores"] is not None, K_IS_TENSOR=m["k"] is not None,
                              HAS_KEEP_IN=m["keep_in"] is not None, HAS_REWARDS=m["rewards"] is not None,
                              DIVIDE_BY_STD=m["std"], UPCAST_SCORES=m["scores"] == "*bf16", ROWS=rows,
                              BLOCK_G=block_g)
            signature.update({name: "constexpr" for name in constexprs})
            launches.append(Launch(f"group G={G} ({mode})", kernel, signature, constexprs, num_warps))
    return launches


COMBINE_FLAGS = ("BLOCK_S", "HAS_SOFTCAP", "SCATTER", "LOSS", "HAS_OLD", "HAS_DELTA", "HAS_RATIO", "HAS_KL", "BIAS_KL",
                 "HAS_PHI")


def _row_launches(vocab_sizes) -> list[Launch]:
    """The fused loss's row passes (log-sum-exp partials and their combination, with each loss type's gradient,
    grad-logits) at the block size the wrapper picks, and its backward's scale-into and scale-in-place kernels."""
    launches = []
    for V in vocab_sizes:
        block = min(linear_grpo_triton.BLOCK_V, triton.next_power_of_2(V))
        common = {"logits_ptr": "*fp32", "stride": "i32", "targets_ptr": "*i64", "lse_ptr": "*fp32", "V": "i32",
                  "inv_t": "fp32", "BLOCK": "constexpr"}
        partials = {"m_ptr": "*fp32", "s_ptr": "*fp32", "d_ptr": "*fp32"}
        splits, _ = linear_grpo_triton._split_span(256, V, block)  # a stage of 256 rows: Qwen's at H=4096
        for cap in (False, True):  # without and with a logit soft cap (Gemma 2)
            name = " softcap" if cap else ""
            launches.append(Launch(f"logsumexp partial V={V}{name}", linear_grpo_triton._logsumexp_partial_kernel,
                                   {"logits_ptr": "*fp32", "stride": "i32", **partials, "V": "i32", "span": "i32",
                                    "inv_t": "fp32", "softcap": "fp32", "SPLITS": "i32", "BLOCK": "constexpr",
                                    "HAS_SOFTCAP": "constexpr"}, {"BLOCK": block, "HAS_SOFTCAP": cap}))
            # the log-prob pass's second kernel: statistics only (forward), or with the loss gradient of each policy
            # term (loss_types.POLICY_TERMS: one branch each), every input its wrapper can pass (old, ref, vLLM
            # ratio, delta, bias-corrected KL, a sequence weight) on: the most registers
            kinds = {"": None, **{f" + g {term.name}": term for term in POLICY_TERMS}}
            for kind_name, term in kinds.items():
                on = term is not None
                launches.append(Launch(
                    f"logprob/entropy combine V={V}{kind_name}{name}",
                    linear_grpo_triton._logprob_entropy_combine_kernel,
                    {"logits_ptr": "*fp32", "stride": "i32", "targets_ptr": "*i64", **partials, "logp_ptr": "*fp32",
                     "entropy_ptr": "*fp32", "lse_ptr": "*fp32", "positions_ptr": "*i64", "adv_ptr": "*fp32",
                     "weight_ptr": "*fp32", "old_ptr": "*fp32", "ref_ptr": "*fp32", "ratio_ptr": "*fp32",
                     "phi_ptr": "*fp32", "g_ptr": "*fp32", "inv_t": "fp32", "softcap": "fp32", "SPLITS": "i32",
                     "clip_low": "fp32", "clip_high": "fp32", "delta": "fp32", "tau_pos": "fp32", "tau_neg": "fp32",
                     "beta": "fp32", **{flag: "constexpr" for flag in COMBINE_FLAGS}},
                    {"BLOCK_S": triton.next_power_of_2(splits), "HAS_SOFTCAP": cap, "SCATTER": True,
                     "LOSS": term.triton_branch if on else linear_grpo_triton.NO_GRAD, "HAS_OLD": on,
                     "HAS_DELTA": on, "HAS_RATIO": on and term.takes_is_ratio, "HAS_KL": on, "BIAS_KL": on,
                     "HAS_PHI": on and term.sequence_weight}))
            for out in ("fp32", "bf16", "fp16"):  # in place, or rounded into the gradient GEMMs' operand dtype
                launches.append(Launch(f"grad-logits V={V} -> {out}{name}", linear_grpo_triton._grad_logits_kernel,
                                       {**common, "out_ptr": f"*{out}", "out_stride": "i32", "g_ptr": "*fp32",
                                        "softcap": "fp32", "HAS_SOFTCAP": "constexpr"},
                                       {"BLOCK": block, "HAS_SOFTCAP": cap}))
    for out in ("bf16", "fp16"):  # backward: the fp32 gradient accumulators into the parameters' dtype
        launches.append(Launch(f"scale-into -> {out}", linear_grpo_triton._scale_into_kernel,
                               {"src_ptr": "*fp32", "scale_ptr": "*fp32", "out_ptr": f"*{out}", "numel": "i32",
                                "BLOCK": "constexpr"}, {"BLOCK": linear_grpo_triton.SCALE_BLOCK}, num_warps=8))
    for dtype in ("fp32", "bf16", "fp16"):  # backward: a gradient written in its parameter's dtype, scaled in place
        launches.append(Launch(f"scale-in-place {dtype}", linear_grpo_triton._scale_in_place_kernel,
                               {"x_ptr": f"*{dtype}", "scale_ptr": "*fp32", "numel": "i32", "BLOCK": "constexpr"},
                               {"BLOCK": linear_grpo_triton.SCALE_BLOCK}, num_warps=8))
    return launches


def launches(quick: bool = False) -> list[Launch]:
    """Every kernel configuration to compile (`quick`: the smallest and largest group size and vocabulary)."""
    group_sizes = (16, 4096) if quick else (2, 8, 16, 64, 256, 1024, 4096)
    vocab_sizes = (151936,) if quick else (1000, 32000, 151936)
    return _group_launches(group_sizes) + _row_launches(vocab_sizes)


def _ptxas(arch: int) -> str:
    """The ptxas Triton itself assembles sm_<arch> with (it bundles two)."""
    from triton.backends.nvidia.compiler import get_ptxas

    return get_ptxas(arch).path


def _resource_usage(ptx: str, arch: int) -> dict:
    """Registers, stack frame and spill bytes per thread, as ptxas reports them (`-v`) for the kernel's PTX."""
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        run = subprocess.run([_ptxas(arch), "-v", f"--gpu-name={gpu}", path, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    if run.returncode:
        raise RuntimeError(f"ptxas failed for sm_{arch}:\n{run.stderr}")
    text = run.stdout + run.stderr
    frame = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", text)
    registers = re.search(r"Used (\d+) registers", text)
    if frame is None or registers is None:
        raise RuntimeError(f"ptxas -v printed no resource usage:\n{text}")
    stack, stores, loads = map(int, frame.groups())
    return {"registers": int(registers.group(1)), "stack": stack, "spill_stores": stores, "spill_loads": loads}


def compile_launch(launch: Launch, arch: int) -> dict:
    """Compiles `launch` for sm_<arch>; returns its registers, stack frame and spill bytes per thread, and the
    PTX conversions from fp32 to half precision (`half_conversions`: their opcodes, which name the rounding mode)."""
    ptx = compile_ptx(launch, arch)
    usage = _resource_usage(ptx, arch)
    # conversions to half precision (cvt.<rounding>.<bf16|f16>.f32); widening ones (cvt.f32.bf16) are exact
    usage["half_conversions"] = sorted({line.split()[0] for line in ptx.splitlines()
                                        if re.match(r"\s*cvt\.(\w+\.)?(bf16|f16)(x2)?\.f32", line)})
    return usage


def compile_ptx(launch: Launch, arch: int) -> str:
    """The PTX Triton generates for `launch` on sm_<arch>."""
    # the launch's argument order is the kernel's: ASTSource expects the signature in that order
    kernel = launch.kernel
    if not isinstance(kernel, JITFunction):  # under TRITON_INTERPRET=1 (the CPU tests) @triton.jit interprets
        kernel = JITFunction(kernel.fn)
    signature = {name: launch.signature[name] for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=launch.constexprs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Triton's notice about its FP-fusion default
        compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32),
                                  options={"num_warps": launch.num_warps})
    return compiled.asm["ptx"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[90, 80], help="compute capabilities (default 90 80)")
    parser.add_argument("--quick", action="store_true", help="only the smallest and largest shapes")
    parser.add_argument("--json", help="also write every result to this file (tests/test_triton_aot.py reads it)")
    args = parser.parse_args(argv)
    results = []
    print("| kernel | sm | warps | registers | stack frame | spill stores / loads (bytes) |\n|---|---|---|---|---|---|")
    spilled = 0
    for launch in launches(args.quick):
        for arch in args.arch:
            usage = compile_launch(launch, arch)
            spilled += usage["spill_stores"] > 0
            results.append({"name": launch.name, "arch": arch, "num_warps": launch.num_warps, **usage})
            print(f"| {launch.name} | {arch} | {launch.num_warps} | {usage['registers']} | {usage['stack']} | "
                  f"{usage['spill_stores']} / {usage['spill_loads']} |")
    print(f"\n{spilled} configuration(s) spill to local memory")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if spilled else 0


if __name__ == "__main__":
    raise SystemExit(main())
