"""Input checks shared by every backend (the reference included), so all of them refuse the same input
with the same message. Every message names the argument and the offending value."""

from __future__ import annotations

import difflib
import numbers

import torch

SCALES = ("group", "batch", "none")


def closest_name(value, choices) -> str | None:
    """The one of `choices` closest to `value` (as text), None when none is close: difflib's similarity ratio >= 0.6.
    One rule for every name a user types: loss types, filters, config keys and fields, reward functions."""
    close = difflib.get_close_matches(str(value), [str(choice) for choice in choices], n=1)
    return close[0] if close else None


def did_you_mean(value, choices) -> str:
    """The end of an unknown-name error: " (did you mean 'x'?)" with closest_name(value, choices), "" when none."""
    close = closest_name(value, choices)
    return f" (did you mean {close!r}?)" if close is not None else ""


def check_group_size(group_size) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got group_size={group_size!r}")
    return int(group_size)


def as_groups(x, group_size: int, name: str, *, ranked: bool = False) -> torch.Tensor:
    """Checks that `x` is a 1-D (N,) or 2-D (num_groups, G) tensor in TRL's layout and returns the
    (num_groups, G) view. Booleans become uint8 (False < True); complex numbers have no order. uint64, which no
    signed type holds: `ranked` tensors (scores, of which only the order counts) become int64 with the top bit
    flipped, the same order exactly; values (rewards) become float64, exact up to 2**53 as for int64."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() not in (1, 2):
        raise ValueError(f"{name} must be 1-D (N,) or 2-D (num_groups, G), got shape {tuple(x.shape)}")
    if x.is_complex():
        raise ValueError(f"{name} must have a real dtype, got {x.dtype}")
    if x.dim() == 2 and x.shape[1] != group_size:
        raise ValueError(f"{name} has shape {tuple(x.shape)} but group_size={group_size}; expected (num_groups, {group_size})")
    n = x.shape[0] if x.dim() == 1 else x.numel()
    if n % group_size != 0:
        raise ValueError(f"{name} has N={n} rows, which is not a multiple of group_size={group_size}")
    if x.dtype == torch.bool:
        x = x.to(torch.uint8)
    elif x.is_floating_point() and x.element_size() == 1:
        x = x.float()  # float8: exact in float32, which every backend reads
    elif x.dtype in (torch.uint16, torch.uint32):
        x = x.long()  # exact; the kernels read signed integers
    elif x.dtype == torch.uint64:
        x = x.view(torch.int64) ^ torch.iinfo(torch.int64).min if ranked else x.double()
    return x.reshape(n // group_size, group_size)


def check_same_shape(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    for x, name in ((a, a_name), (b, b_name)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if a.shape != b.shape:
        raise ValueError(f"{b_name} must have the shape of {a_name} {tuple(a.shape)}, got {tuple(b.shape)}")


def check_keep(keep, rewards: torch.Tensor) -> None:
    """`keep` is a bool mask of the shape of `rewards` (a 0/1 float mask would be read as "nonzero = kept")."""
    check_same_shape(rewards, "rewards", keep, "keep")
    if keep.dtype != torch.bool:
        raise ValueError(f"keep must be a bool tensor, got dtype {keep.dtype}")


def check_largest(largest) -> bool:
    if not isinstance(largest, bool):
        raise ValueError(f"largest must be a bool, got largest={largest!r}")
    return largest


def check_k(k, num_groups: int, group_size: int, device: torch.device) -> int | torch.Tensor:
    """Returns k as a Python int (1 <= k <= G) or as an int64 tensor of length num_groups on `device`
    (0 <= k_g <= G, adaptive k). A 0-d integer tensor counts as a scalar."""
    if isinstance(k, torch.Tensor):
        if k.dtype == torch.bool or k.is_floating_point() or k.is_complex():
            raise ValueError(f"k must be an int or an integer tensor, got a tensor of dtype {k.dtype}")
        if k.dim() == 0:
            k = int(k.item())
        else:
            if k.dim() != 1 or k.shape[0] != num_groups:
                raise ValueError(
                    f"k as a tensor must have shape (num_groups,) = ({num_groups},), got shape {tuple(k.shape)}"
                )
            if num_groups > 0:
                # read on the host: one copy of num_groups values, no kernel on the device (the CUDA op stays the
                # call's one launch). uint64 has no min/max kernels; float64 holds every in-range k exactly and
                # orders the rest
                host = k.cpu()
                wide = host.double() if k.dtype == torch.uint64 else host
                lo, hi = int(wide.min()), int(wide.max())
                if lo < 0 or hi > group_size:
                    bad = lo if lo < 0 else hi
                    raise ValueError(f"every k_g must satisfy 0 <= k_g <= group_size={group_size}, got k_g={bad}")
            return k.to(device=device, dtype=torch.int64)
    if isinstance(k, bool) or not isinstance(k, numbers.Integral):
        raise ValueError(f"k must be an int or an integer tensor, got k={k!r}")
    if not 1 <= k <= group_size:
        raise ValueError(f"k must satisfy 1 <= k <= group_size={group_size}, got k={k}")
    return int(k)


def check_scale_eps(scale, eps) -> None:
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got scale={scale!r}{did_you_mean(scale, SCALES)}")
    # eps > 0: it is what keeps a zero-variance group's advantages 0 rather than 0 / 0
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite float > 0, got eps={eps!r}")


def check_linear_grpo_inputs(
    hidden, weight, target_ids, mask, advantages, *, bias, old_logps, ref_logps, vllm_is_ratio, beta
) -> None:
    """Types, shapes, dtypes and devices of a fused_linear_grpo_loss call (both implementations), without reading
    the device (count_scored reads the target ids)."""
    for x, name in ((hidden, "hidden"), (weight, "weight"), (target_ids, "target_ids"), (mask, "mask"),
                    (advantages, "advantages")):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be 3-D (B, T, H), got shape {tuple(hidden.shape)}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ValueError(f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}")
    B, T, H = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != H:
        raise ValueError(f"weight must be (V, H) with H={H} (the last dim of hidden), got shape {tuple(weight.shape)}")
    V = weight.shape[0]
    if tuple(target_ids.shape) != (B, T):
        raise ValueError(f"target_ids must have shape (B, T) = {(B, T)}, got {tuple(target_ids.shape)}")
    if target_ids.is_floating_point() or target_ids.is_complex() or target_ids.dtype == torch.bool:
        raise ValueError(f"target_ids must be an integer tensor, got dtype {target_ids.dtype}")
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"mask must have shape (B, T) = {(B, T)}, got {tuple(mask.shape)}")
    if tuple(advantages.shape) not in ((B,), (B, T)):
        raise ValueError(f"advantages must have shape (B,) = ({B},) or (B, T), got {tuple(advantages.shape)}")
    if bias is not None and tuple(bias.shape) != (V,):
        raise ValueError(f"bias must have shape (V,) = ({V},), got {tuple(bias.shape)}")
    for x, name in ((old_logps, "old_logps"), (ref_logps, "ref_logps")):
        if x is not None and tuple(x.shape) != (B, T):
            raise ValueError(f"{name} must have shape (B, T) = {(B, T)}, got {tuple(x.shape)}")
    if vllm_is_ratio is not None and tuple(vllm_is_ratio.shape) not in ((B, T), (B, 1), (B,)):
        raise ValueError(f"vllm_is_ratio must have shape (B, T) = {(B, T)}, (B, 1) or (B,), got "
                         f"{tuple(vllm_is_ratio.shape)}")
    named = (("weight", weight), ("target_ids", target_ids), ("mask", mask), ("advantages", advantages),
             ("bias", bias), ("old_logps", old_logps), ("ref_logps", ref_logps), ("vllm_is_ratio", vllm_is_ratio))
    for name, x in named:
        if x is not None and x.device != hidden.device:
            raise ValueError(f"{name} must be on hidden's device {hidden.device}, got {name} on {x.device}")
    if beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta={beta} needs ref_logps (the reference model's per-token log-probabilities)")


def count_scored(live: torch.Tensor, target_ids: torch.Tensor, V: int, subset: torch.Tensor | None = None
                 ) -> tuple[int, int]:
    """(scored tokens, tokens of `subset`) of a checked call (`live` = mask != 0; subset: a (B, T) bool tensor of
    scored tokens, or None: 0), read in one host transfer with the scored target ids' range, which must lie in
    [0, V): not the four syncs of any(), a boolean index, min() and max(). The fused loss sizes its work by them."""
    live_targets = torch.where(live, target_ids, torch.zeros_like(target_ids)).long()
    read = [live.sum(), live_targets.min(), live_targets.max()] + ([] if subset is None else [subset.sum()])
    num_scored, lo, hi, *num_subset = torch.stack(read).tolist() if live.numel() else (0, 0, 0, 0)
    if lo < 0 or hi >= V:
        bad = lo if lo < 0 else hi
        raise ValueError(f"target_ids where mask is set must lie in [0, V={V}), got target id {bad}")
    return num_scored, (num_subset[0] if subset is not None else 0)


def check_num_items_in_batch(n) -> None:
    """The dapo/cispo normaliser: None, a real number, or a one-element real tensor."""
    if n is None:
        return
    if isinstance(n, torch.Tensor):
        if n.numel() == 1 and n.dtype != torch.bool and not n.is_complex():
            return
        shown = f"a tensor of shape {tuple(n.shape)} and dtype {n.dtype}"
    elif isinstance(n, numbers.Real) and not isinstance(n, bool):
        return
    else:
        shown = repr(n)
    raise ValueError(f"num_items_in_batch must be None, a number or a one-element tensor, got {shown}")
