"""Input checks shared by every backend (the reference included), so all of them refuse the same input
with the same message. Every message names the argument and the offending value."""

from __future__ import annotations

import numbers

import torch

SCALES = ("group", "batch", "none")


def check_group_size(group_size) -> int:
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got group_size={group_size!r}")
    return int(group_size)


def as_groups(x, group_size: int, name: str) -> torch.Tensor:
    """Checks that `x` is a 1-D (N,) or 2-D (num_groups, G) tensor in TRL's layout and returns the
    (num_groups, G) view. Booleans become uint8 (False < True); complex numbers have no order."""
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
    return x.reshape(n // group_size, group_size)


def check_same_shape(a: torch.Tensor, a_name: str, b: torch.Tensor, b_name: str) -> None:
    for x, name in ((a, a_name), (b, b_name)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if a.shape != b.shape:
        raise ValueError(f"{b_name} must have the shape of {a_name} {tuple(a.shape)}, got {tuple(b.shape)}")


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
                lo, hi = int(k.min()), int(k.max())
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
        raise ValueError(f"scale must be one of {SCALES}, got scale={scale!r}")
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps >= 0 or eps == float("inf"):
        raise ValueError(f"eps must be a finite float >= 0, got eps={eps!r}")
