"""The fused linear GRPO loss's GEMMs: their operands, the projection into fp32 logits, the two gradient GEMMs with
fp32 accumulation rounded once to the dtype they write, and backward's scaling of the gradients they wrote.

Precision: the GEMMs accumulate in fp32 (split-K partial sums included: fp32_reductions). For bf16/fp16 operands
that cuBLAS multiplies as such, the logits gradient is rounded to that dtype once before the two gradient GEMMs (as
TRL and Liger do). A gradient a GEMM writes in a half-precision parameter's dtype is rounded once, as the cast of an
fp32 sum would be. Where cuBLAS cannot write fp32 from half-precision operands (CPU; bf16 before sm_80;
half_gemm_on_device) the operands are rounded to their dtype and then held in fp32, and the gradients are kept in
fp32 until backward.
"""

from __future__ import annotations

import contextlib
import threading

import torch


def operand_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype TRL's path would run the LM head GEMM in: the autocast dtype under autocast (an fp32 head under
    bf16 autocast runs bf16 GEMMs, as F.linear would), otherwise the common dtype of hidden and weight."""
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


def half_gemm_on_device(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether cuBLAS can multiply `dtype` operands into an fp32 output on `device` (torch.mm's out_dtype, CUDA
    only, torch >= 2.8, the declared floor): bf16 needs compute capability 8.0 or higher, and fp16 is refused
    while torch.backends.cuda.matmul.allow_fp16_accumulation is set (checks of PyTorch 2.8-2.11's Blas.cpp)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if dtype == torch.bfloat16:
        return torch.cuda.get_device_capability(device)[0] >= 8
    return not getattr(torch.backends.cuda.matmul, "allow_fp16_accumulation", False)


def gemm_operands(hidden_rows: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The GEMM operands in `dtype` (None: operand_dtype), prepared once per call. Where cuBLAS writes fp32 from
    half precision operands (half_gemm_on_device) they stay bf16/fp16, so the weight is never copied to fp32.
    Elsewhere (the CPU has no out_dtype GEMM; bf16 before sm_80) the operands, rounded to `dtype` first, are
    converted to fp32 here once, not per chunk: the same numerics (the products of the rounded values accumulated
    in fp32), at the cost of an fp32 copy of the weight."""
    dtype = operand_dtype(hidden_rows, weight) if dtype is None else dtype
    h, w = hidden_rows.to(dtype), weight.to(dtype)
    if half_gemm_on_device(hidden_rows.device, dtype):
        return h, w
    return h.float(), w.float()


def written_dtype(param_dtype: torch.dtype, operand: torch.dtype) -> torch.dtype:
    """The dtype a gradient GEMM writes for a parameter of `param_dtype`: the parameter's own where cuBLAS writes it
    from `operand` operands (the same dtype, or fp32), else fp32 (cast in backward)."""
    return param_dtype if param_dtype in (operand, torch.float32) else torch.float32


def project(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out = h @ weight^T (+ bias, fp32) in fp32, from operands prepared by gemm_operands."""
    if h.dtype == torch.float32:
        torch.mm(h, weight.t(), out=out)
    else:
        torch.mm(h, weight.t(), out_dtype=torch.float32, out=out)
    if bias is not None:
        out.add_(bias)
    return out


# fp32_reductions: the calls inside such a block, per flag, and what to restore when the last one leaves
_reductions_lock = threading.Lock()
_reductions_held: dict[str, list] = {}


@contextlib.contextmanager
def fp32_reductions(dtype: torch.dtype, device: torch.device):
    """cuBLAS may add split-K partial products in a half-precision output's dtype, which PyTorch allows by default
    (torch.backends.cuda.matmul.allow_bf16/fp16_reduced_precision_reduction): disallowed around the GEMMs that write
    a gradient in bf16/fp16, so that every sum is fp32 until its one rounding.

    The flag is process-wide (PyTorch has no per-call setting). Blocks that overlap, in several threads, share one
    change: the first to enter turns reduced precision off, the last to leave restores the user's setting, unless
    the flag was set again meanwhile (that setting is kept). Other threads' half-precision GEMMs that run while a
    block is open reduce in fp32 too (more exactly, never less)."""
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        yield
        return
    matmul = torch.backends.cuda.matmul
    name = f"allow_{'bf16' if dtype == torch.bfloat16 else 'fp16'}_reduced_precision_reduction"
    with _reductions_lock:
        held = _reductions_held.get(name)
        if held is None:
            # torch >= 2.10 keeps a second flag, split-K allowed, which setting a bool turns on: kept as the user set
            # it
            split_k = getattr(matmul, name + "_split_k", None)
            held = _reductions_held[name] = [0, getattr(matmul, name), split_k]
            setattr(matmul, name, False if split_k is None else (False, split_k))
        held[0] += 1
    try:
        yield
    finally:
        with _reductions_lock:
            held[0] -= 1
            if held[0] == 0:
                del _reductions_held[name]
                _, previous, split_k = held
                if getattr(matmul, name) is False:  # else set again inside the block: that setting stays
                    setattr(matmul, name, previous if split_k is None else (previous, split_k))


def gemm(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool = False) -> None:
    """out = a @ b (accumulate: out += a @ b, fp32 out only) with fp32 accumulation, rounded once to out's dtype (a:
    the logits gradient, in b's dtype; b: an operand from gemm_operands; out: fp32, or b's half dtype)."""
    assert not accumulate or out.dtype == torch.float32, "only an fp32 accumulator adds"
    if out.dtype == b.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            with fp32_reductions(out.dtype, out.device):
                torch.mm(a, b, out=out)
    elif out.dtype == torch.float32:
        if accumulate:
            torch.addmm(out, a, b, out_dtype=torch.float32, out=out)
        else:
            torch.mm(a, b, out_dtype=torch.float32, out=out)
    else:
        raise AssertionError(f"no GEMM writes {out.dtype} from {b.dtype} operands")
