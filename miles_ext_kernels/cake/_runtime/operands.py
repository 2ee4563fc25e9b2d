"""Operand preparation shared by every op: read a tensor in place when the kernels can, copy it otherwise.

The kernels are compiled for 16-byte aligned pointers (Triton specializes on it) and, in most ops, vectorised row
loads that need row strides in whole 16-byte units; anything else would either be a new specialization or a wrong
assumption, so such operands are copied into a contiguous buffer first. Views of a packed projection (a column
slice of a wider tensor, head-strided q/k/v) are the common case that reads in place.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

import torch

# How often an operand had to be copied before a launch, by (op, argument name): tests read it to tell which path ran.
COPIES: Counter = Counter()


def operand(t: torch.Tensor, op: str, name: str, *, view: Optional[tuple] = None, stride_multiple: int = 1,
            contiguous: bool = False, fits: Optional[Callable[[torch.Tensor], bool]] = None) -> torch.Tensor:
    """`t` (as `t.view(*view)` when given) as the kernels read it.

    In place when it starts 16-byte aligned and either (contiguous=True) is contiguous, or has a unit last stride
    and every other stride of a dimension longer than 1 a multiple of `stride_multiple` elements, and `fits(v)`
    (an op's own condition, e.g. offsets that must stay within int32) holds. Otherwise a contiguous copy of that
    shape, counted in `COPIES[(op, name)]`.
    """
    if t.is_contiguous() and (t.data_ptr() % 16 == 0 or t.numel() == 0):
        # the common case first: a few us of checks per operand matter on the host path (a copy of a contiguous
        # tensor would have its strides, so the stride condition cannot fail here)
        v = t if view is None else t.view(*view)
        if fits is None or fits(v):
            return v
    v = t
    if view is not None:
        try:
            v = t.view(*view)
        except RuntimeError:  # not viewable without a copy
            v = None
    if v is not None and _in_place(v, stride_multiple, contiguous) and (fits is None or fits(v)):
        return v
    COPIES[(op, name)] += 1
    shape = tuple(view) if view is not None else t.shape
    out = torch.empty(t.reshape(shape).shape if -1 in shape else shape, dtype=t.dtype, device=t.device)
    out.copy_(t.reshape(out.shape))
    return out


def _in_place(v: torch.Tensor, multiple: int, contiguous: bool) -> bool:
    if v.numel() and v.data_ptr() % 16:
        return False
    if contiguous:
        return v.is_contiguous()
    if v.dim() and v.shape[-1] > 1 and v.stride(-1) != 1:
        return False
    return all(st % multiple == 0 for n, st in zip(v.shape[:-1], v.stride()[:-1]) if n > 1)


def copies(op: str) -> dict:
    """{argument name: copies so far} of one op."""
    return {name: n for (o, name), n in COPIES.items() if o == op}
