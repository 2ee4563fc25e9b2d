"""Fixed-order column reduction of per-program partial rows: the second stage of a deterministic weight gradient.

Shared by the norms (rmsnorm, gated_rmsnorm): one piece of code for one job, so it lives in the runtime.

A backward kernel that runs `P` persistent programs writes one fp32 partial row each into a `[P, N]` workspace;
`reduce_columns` sums those rows column by column in a fixed order (a fixed number of rows per step, then one
fixed-shape tree inside the program) and writes the result in the gradient's dtype. The order depends only on
`P`, `N` and the compiled route, never on scheduling, so the result repeats bit for bit. With `P == 1` it is a
plain fp32 -> out-dtype cast (used after an atomic accumulation). `row_split`, `weight_grad_buffers` and
`finish_weight_grad` are the launcher side of the same scheme.

`fixed_order_finish` does the same second stage inside the backward's own launch (one launch instead of two; its
counters come from `counters`).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_ext_kernels.cake._runtime import build, config, workspace

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


@triton.jit
def _sum_rows(src_ptr, row0, nrows, dst_ptr, N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    """dst[:N] = sum of rows [row0, row0 + nrows) of `src_ptr` ([*, N] fp32), in a fixed order: BLOCK_R rows per
    step, then one fixed-shape tree. Loads bypass L1 (`.cg`): the rows were written by other programs."""
    r = tl.arange(0, BLOCK_R)
    for c0 in range(0, N, BLOCK_C):
        cols = c0 + tl.arange(0, BLOCK_C)
        cm = cols < N
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for r0 in range(0, nrows, BLOCK_R):
            rr = r0 + r
            offs = (row0 + rr).to(tl.int64)[:, None] * N + cols[None, :]
            acc += tl.load(src_ptr + offs, mask=(rr < nrows)[:, None] & cm[None, :], other=0.0, cache_modifier=".cg")
        tl.store(dst_ptr + cols, tl.sum(acc, axis=0).to(dst_ptr.dtype.element_ty), mask=cm)


@triton.jit
def fixed_order_finish(part_ptr, cnt_ptr, out_ptr, pid, P, N: tl.constexpr, GROUP: tl.constexpr,
                       BLOCK_C: tl.constexpr):
    """The second stage of a deterministic weight gradient inside the backward's own launch.

    Call after program `pid` (of `P`) has stored its fp32 partial row `pid` of `part_ptr`, a `[P + cdiv(P, GROUP),
    N]` workspace. The last program to finish in each group of GROUP consecutive programs sums that group's rows
    (fixed order) into row `P + group`; the last group to finish sums those `cdiv(P, GROUP)` rows (fixed order) into
    `out_ptr` (N columns, cast to its dtype). "Last" is decided by int32 counters `cnt_ptr[0 : cdiv(P, GROUP) + 1]`
    (zero on entry; each is reset by the program that completes it, so they are zero again when the launch ends).
    Which program does a sum never changes what is summed or in which order, so the bits depend only on P and N.
    Ordering: the CTA barrier puts every thread's partial-row stores before the acq_rel counter update (the layer-norm
    tutorial's lock pattern); the summing program reads with `.cg` loads, from L2."""
    NG = (P + GROUP - 1) // GROUP
    g = pid // GROUP
    gsize = tl.minimum(GROUP, P - g * GROUP)
    tl.debug_barrier()
    old = tl.atomic_add(cnt_ptr + g, 1, sem="acq_rel", scope="gpu")
    if old == gsize - 1:
        tl.atomic_xchg(cnt_ptr + g, 0, sem="relaxed", scope="gpu")
        _sum_rows(part_ptr, g * GROUP, gsize, part_ptr + (P + g).to(tl.int64) * N, N, GROUP, BLOCK_C)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + NG, 1, sem="acq_rel", scope="gpu")
        if done == NG - 1:
            tl.atomic_xchg(cnt_ptr + NG, 0, sem="relaxed", scope="gpu")
            _sum_rows(part_ptr, P, NG, out_ptr, N, GROUP, BLOCK_C)


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

    `fwd_config(width, window)` -> forward launch config; `bwd_config(width, window)` -> (..launch values,
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
            c = self._cache[key] = (self.fwd_config(width, w), b[:-1], SMS_BY_ARCH[arch] * b[-1])
        return c


# ------------------------------------------------------------------------------------------------------------------
# counters of `fixed_order_finish`: one zeroed int32 array per (device, stream), reset by the kernels themselves
COUNTER_SLOTS = 64  # groups + 1: enough for P <= 63 * GROUP programs
_counters: dict = {}


def counters(t: torch.Tensor) -> torch.Tensor:
    """Zeroed int32 counters for a `fixed_order_finish` launch on `t`'s device and the current stream. Cached per
    (device, stream): launches on one stream run one after another and leave the counters zero. While a CUDA graph
    is being captured, a fresh zeroed array is allocated (its zeroing is captured with the launch)."""
    idx = t.get_device()
    if idx < 0:  # CPU tensor under the interpreter
        key = (idx, 0)
    else:
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=t.device)
        key = (idx, torch._C._cuda_getCurrentRawStream(idx))
    c = _counters.get(key)
    if c is None:
        c = _counters[key] = torch.zeros(COUNTER_SLOTS, dtype=torch.int32, device=t.device)
    return c


def partial_rows(op: str, n: int, device) -> torch.Tensor:
    """An fp32 workspace of `n` elements for partial rows (pool role `(op, "dw_partial")`; a plain `torch.empty`
    when the pool bound is 0, as `workspace.take` would do, without its generic host work)."""
    if config.pool_bytes() == 0:
        return torch.empty(n, dtype=torch.float32, device=device)
    return workspace.take((op, "dw_partial"), n * 4, device=device).view(torch.float32)


def finish_rows(P: int, group: int) -> int:
    """Rows of the fp32 workspace a `fixed_order_finish` launch of P programs needs (partials + group sums)."""
    ng = -(-P // group)
    if ng + 1 > COUNTER_SLOTS:
        raise ValueError(f"{P} programs need {ng + 1} counters, more than {COUNTER_SLOTS}")
    return P + ng
