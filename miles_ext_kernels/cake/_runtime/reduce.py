"""Fixed-order column reduction of per-program partial rows: the second stage of a deterministic weight gradient.

Shared by the norms (rmsnorm, gated_rmsnorm): one piece of code for one job, so it lives in the runtime.

A backward kernel that runs `P` persistent programs writes one fp32 partial row each into a `[P, N]` workspace;
`reduce_columns` sums those rows column by column in a fixed order (a fixed number of rows per step, then one
fixed-shape tree inside the program) and writes the result in the gradient's dtype. The order depends only on
`P`, `N` and the compiled route, never on scheduling, so the result repeats bit for bit. With `P == 1` it is a
plain fp32 -> out-dtype cast (used after an atomic accumulation). `row_split`, `weight_grad_buffers` and
`finish_weight_grad` are the launcher side of the same scheme.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_ext_kernels.cake._runtime import build, workspace

BLOCK_P = 32   # partial rows summed per step
BLOCK_N = 128  # columns per program
NUM_WARPS = 4

OUT_DTYPES = (torch.float32, torch.bfloat16)


@triton.jit(do_not_specialize=["P", "N"])
def _reduce_columns_kernel(part_ptr, out_ptr, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < N
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for p0 in range(0, P, BLOCK_P):
        rows = p0 + tl.arange(0, BLOCK_P)
        offs = rows.to(tl.int64)[:, None] * N + cols[None, :]
        acc += tl.load(part_ptr + offs, mask=(rows < P)[:, None] & cmask[None, :], other=0.0)
    total = tl.sum(acc, axis=0)
    tl.store(out_ptr + cols, total.to(out_ptr.dtype.element_ty), mask=cmask)


def reduce_columns(partial: torch.Tensor, P: int, N: int, out: torch.Tensor) -> torch.Tensor:
    """out[:N] = partial viewed as `[P, N]` (fp32, row-major), summed over its rows in a fixed order."""
    grid = ((N + BLOCK_N - 1) // BLOCK_N,)
    _reduce_columns_kernel[grid](partial, out, P, N, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS,
                                 num_stages=1)
    return out


def routes(prefix: str):
    """The reduction's routes (one per output dtype)."""
    return [build.Route(_reduce_columns_kernel, (torch.float32, dt, 264, 2048), (1,),
                        {"BLOCK_P": BLOCK_P, "BLOCK_N": BLOCK_N, "num_warps": NUM_WARPS, "num_stages": 1},
                        f"{prefix}reduce_columns[out={str(dt).replace('torch.', '')}]")
            for dt in OUT_DTYPES]


def row_split(rows: int, programs: int, block_m: int) -> tuple[int, int]:
    """(rows per program, grid) of a persistent backward: `rows` in whole `block_m` blocks over at most `programs`
    programs. Depends only on the three sizes, so the partial-row layout (hence a det gradient's bits) does too."""
    per = build.cdiv(build.cdiv(rows, programs), block_m) * block_m
    return per, build.cdiv(rows, per)


def weight_grad_buffers(op: str, grid: int, n: int, weight: torch.Tensor, atomic: bool):
    """(dw, target) for a backward whose `grid` programs each add a weight-gradient row of `n` columns.

    det (`atomic=False`): target is a `[grid, n]` fp32 workspace of partial rows (pool role `(op, "dw_partial")`),
    summed later in a fixed order. fast with atomics: one zeroed fp32 row (dw itself when the weight is fp32).
    """
    dw = torch.empty(n, dtype=weight.dtype, device=weight.device)
    if not atomic:
        target = workspace.take((op, "dw_partial"), grid * n * 4, device=weight.device).view(torch.float32)
    elif weight.dtype == torch.float32:
        target = dw.zero_()
    else:
        target = workspace.take((op, "dw_accum"), n * 4, device=weight.device).view(torch.float32).zero_()
    return dw, target


def finish_weight_grad(dw: torch.Tensor, target: torch.Tensor, grid: int, n: int, atomic: bool) -> torch.Tensor:
    """dw from what the backward wrote into `target` (see `weight_grad_buffers`)."""
    if not atomic:
        reduce_columns(target, grid, n, dw)
    elif target.data_ptr() != dw.data_ptr():
        reduce_columns(target, 1, n, dw)  # fp32 accumulator -> weight dtype
    return dw


# Backward programs per arch = SMs x the table's per-SM count (fixed per arch, not the live count, so the partial-row
# layout and a det gradient's bits do not depend on the GPU's state).
SMS_BY_ARCH = {"sm_90a": 132}


def table_arch(x: torch.Tensor) -> str:
    """The arch whose config table a row-wise op uses for `x`: its GPU's (checked by the runtime, cached per
    device), or the Hopper table for CPU tensors under the interpreter (so CPU tests run the shipped configs)."""
    arch = build.check_device(x, "x")
    return "sm_90a" if arch == build.INTERPRETER_ARCH else arch


class RowConfigs:
    """Fixed per-call configs of a row-wise op with a persistent backward, by (width, row-count window, arch).

    `fwd_config(width, window)` -> forward launch config; `bwd_config(width, window)` -> (..4 launch values,
    programs per SM). Calls with at most `small_rows` rows use the "small" window. Cached: a dict look-up per call.
    """

    def __init__(self, fwd_config, bwd_config, small_rows: int):
        self.fwd_config, self.bwd_config, self.small_rows = fwd_config, bwd_config, small_rows
        self._cache: dict = {}

    def window(self, rows: int) -> str:
        return "small" if rows <= self.small_rows else "large"

    def __call__(self, width: int, rows: int, arch: str):
        """(forward config, backward config, backward programs)."""
        key = (width, rows <= self.small_rows, arch)
        c = self._cache.get(key)
        if c is None:
            w = self.window(rows)
            b = self.bwd_config(width, w)
            c = self._cache[key] = (self.fwd_config(width, w), b[:4], SMS_BY_ARCH[arch] * b[4])
        return c
