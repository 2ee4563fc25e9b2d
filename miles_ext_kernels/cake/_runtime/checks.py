"""Operand checks shared by every op: each raises ValueError/TypeError naming the argument, before any launch."""
from __future__ import annotations

import math

import torch


def check_tensor(name: str, t, *, dtype=None, ndim=None, last_stride_one: bool = False, device=None,
                 aligned16: bool = False) -> None:
    """Check that `t` is a tensor of the given dtype(s), rank, device, unit last stride and 16-byte alignment."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        allowed = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in allowed:
            want = " or ".join(str(d).replace("torch.", "") for d in allowed)
            raise TypeError(f"{name} must be {want}, got {str(t.dtype).replace('torch.', '')}")
    if ndim is not None:
        allowed_nd = ndim if isinstance(ndim, tuple) else (ndim,)
        if t.dim() not in allowed_nd:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed_nd))} dimensions, got shape "
                             f"{tuple(t.shape)}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    if last_stride_one and t.dim() > 0 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit last stride (got strides {t.stride()}); call .contiguous()")
    if aligned16 and t.numel() > 0 and t.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must start at a 16-byte aligned address (it is a view at an odd offset); "
                         f"call .clone()")


def check_host_int(name: str, value, *, minimum: int | None = 0) -> int:
    """A plain Python int (not a bool, not a tensor) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a host int, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_eps(value, name: str = "eps") -> float:
    """A finite float > 0 (an int is accepted; a bool, a string or a tensor is a TypeError)."""
    if isinstance(value, bool) or not isinstance(value, (float, int)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite float > 0, got {value!r}")
    return float(value)


def check_same_device(names_and_tensors) -> None:
    """All tensors on one device; the first names it."""
    (first_name, first), *rest = names_and_tensors
    for name, t in rest:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_cu_seqlens(name: str, cu_seqlens, num_tokens: int, *, must_end_at_total: bool = False):
    """Validate packed-document boundaries on the host: start at 0, never decrease, end within (or, with
    `must_end_at_total`, exactly at) `num_tokens`. Copies them to the host: one device sync per call, which is why
    ops run it only behind a `check_seqlens` option. Returns the boundaries as a CPU int64 tensor."""
    c = cu_seqlens.detach().to("cpu", torch.int64)
    if c.numel() == 0 or int(c[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {c.tolist()[:1]}")
    if c.shape[0] > 1 and bool((c[1:] < c[:-1]).any()):
        raise ValueError(f"{name} must be non-decreasing")
    end = int(c[-1])
    if end > num_tokens or (must_end_at_total and end != num_tokens):
        want = "exactly at" if must_end_at_total else "within"
        raise ValueError(f"{name} ends at {end}; it must end {want} the {num_tokens} tokens")
    return c
