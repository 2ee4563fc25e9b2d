"""Gluon helpers shared by the gqa kernels of `gluon_fwd.py` and `gluon_bwd.py`: mbarrier rings, TMA requests, row
stores.

A ring is a [STAGES, ...] shared-memory buffer with two [STAGES, 1] mbarrier arrays: "ready" (or "full"), completed
by the producer (a TMA's bytes, or an arrive) once a stage holds use i, and "empty", completed by the consumers'
arrives once they have released it. The stage and phase of each use come from `ring_slot`. Partitions take a ring
as the tuple (smem, ready, empty).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from . import kernels as K


@gluon.jit
def ring_slot(bars, i):
    """Stage and phase of use i (0, 1, ...) of a ring whose mbarriers are `bars` ([STAGES, 1]; a [1] barrier is a
    ring of one stage). Use i takes stage i % STAGES and is completion number i // STAGES of that stage's barriers,
    so consumers wait on "ready" for phase (i // STAGES) & 1. The producer of use i waits on "empty" for the release
    of use i - STAGES, phase ^ 1: a fresh mbarrier counts as having completed the phase before phase 0, so the
    first STAGES uses do not wait."""
    STAGES: gl.constexpr = bars.shape[0]
    return i % STAGES, (i // STAGES) & 1


@gluon.jit
def request(desc, smem, bar, row, col):
    """TMA of one [rows, D] tile into `smem`, completing on `bar`."""
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], bar, smem)


@gluon.jit
def zero_rows(PTR, row0, T, st, sh, h, ROWS: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
    """PTR[row0 + r, h, :] = 0 for the rows r < ROWS with row0 + r < T (padding rows past the last segment)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    gl.store(PTR + rows.to(gl.int64)[:, None] * st + h * sh + d[None, :],
             gl.zeros([ROWS, D], PTR.dtype.element_ty, layout), mask=(rows < T)[:, None])


@gluon.jit
def zero_rows_from(smem, first, BM: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr):
    """Zero rows [first, BM) of a [BM, D] bf16 tile, 64 columns at a time (few registers)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    rows = gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    for c in gl.static_range(D // 64):
        part = smem.slice(c * 64, 64, dim=1)
        part.store(gl.where((rows < first)[:, None], part.load(layout), 0.0))


@gluon.jit
def store_rows(smem, PTR, row0, head, st, sh, n_valid, ROWS: gl.constexpr, D: gl.constexpr,
               num_warps: gl.constexpr):
    """Rows [0, n_valid) of a [ROWS, D] shared-memory tile to PTR[row0 + r, head, :] (16-byte stores, 64 columns at
    a time: few registers; stores straight from an MMA layout need a pointer per element, which spilled)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    base = PTR + row0.to(gl.int64) * st + head * sh + (r[:, None] * st + d[None, :])
    for c in gl.static_range(D // 64):
        gl.store(base + c * 64, smem.slice(c * 64, 64, dim=1).load(layout), mask=(r < n_valid)[:, None])


@gluon.jit
def query_tile(TS, CU_Q, CU_K, t, n_seg, n_iter, BM: gl.constexpr, BN: gl.constexpr):
    """The query tile t (heaviest first within its segment: `kernels._find_tile`) of the forward and the dQ pass:
    its segment's query start q0 and length L_q, key start k0 and length L_k, the tile's first row m0, the causal
    offset L_k - L_q, and the number of BN-key blocks it sees."""
    local, q0, L_q, k0, L_k = K._find_tile(TS, CU_Q, CU_K, t, n_seg, n_iter, True)  # scalar code, shared
    m0 = local * BM
    offset = L_k - L_q
    hi = gl.maximum(gl.minimum(L_k, m0 + BM + offset), 0)
    return q0, L_q, k0, L_k, m0, offset, (hi + BN - 1) // BN
