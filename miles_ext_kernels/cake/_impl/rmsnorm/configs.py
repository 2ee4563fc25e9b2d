"""Fixed launch configs of the rmsnorm kernels (no autotuning: the same table in every process gives the same bits),
picked from the H200 sweeps in bench/NOTES.md, norms.

Token-count windows: calls with T <= SMALL_T rows use the "small" forward configs (fewer rows per program, so short
calls still spread over the SMs); longer calls use "large". The backward is persistent: a fixed number of programs
per SM of the table's arch (not the live SM count), so the partial-row layout, and therefore the det weight
gradient's bits, depend only on the token count. One table serves every arch the op runs on (sm_90a, and the
interpreter, which runs it as sm_90a: `_norms.TABLE_ARCH`).
"""
from __future__ import annotations

import triton

from miles_ext_kernels.cake._runtime.reduce import RowConfigs

SMALL_T = 1024
WINDOWS = ("small", "large")


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


_splits: dict = {}


def split(H: int) -> tuple[int, int]:
    """(BLOCK_A, BLOCK_B): a row as a power-of-two tile [0, BLOCK_A) and, when H is not a power of two, a second
    tile of next_pow2(H - BLOCK_A) columns (masked); H 5120 = 4096 + 1024, 2560 = 2048 + 512, 7168 = 4096 + 4096."""
    s = _splits.get(H)
    if s is None:
        a = 1 << (H.bit_length() - 1)
        s = _splits[H] = (a, (_pow2(H - a) if H > a else 0))
    return s


# Forward, large window, by padded width: (BLOCK_M, num_warps); narrower rows scale BLOCK_M up from the 2048 entry.
FWD_TABLE = {2048: (2, 8), 4096: (2, 8), 8192: (2, 8), 16384: (1, 16)}


def fwd_config(H: int, window: str):
    """(BLOCK_M, num_warps, num_stages) of the forward for width H (one tile of BLOCK_M rows per program)."""
    bn = _pow2(H)
    if window == "small":
        return max(1, 2048 // bn), (4 if bn <= 2048 else 8), 1
    if bn <= 2048:
        bm, nw = FWD_TABLE[2048]
        return bm * 2048 // bn, nw, 1
    return (*FWD_TABLE[bn], 1)


# Backward, by padded width: (BLOCK_M, num_warps, STAGES = row blocks of loads in flight + 1, KAHAN = compensated
# weight-gradient sum, programs per SM).
BWD_TABLE = {2048: (4, 8, 3, True, 1), 4096: (1, 8, 3, True, 2), 8192: (1, 8, 3, True, 1), 16384: (1, 16, 2, True, 1)}
GROUP = 16  # partial rows per group of the in-launch fixed-order weight-gradient sum


# Exact widths whose registers allow another tile than their padded width's entry (checked before BWD_TABLE).
# H 5120 without the Kahan compensation fits two 8-warp CTAs per SM: 0.280 vs 0.355 ms at 32k tokens on the H200,
# dw error vs FP64 at 8k tokens 1.44e-7 vs 1.05e-7 (Liger 1.70e-7 on another input; all from scratch sweeps recorded
# in bench/NOTES.md, norms v4); at H 7168 / 8192 the plain sum was slower.
BWD_BY_WIDTH: dict = {5120: (1, 8, 3, False, 2)}


def bwd_config(H: int, window: str):
    """(BLOCK_M, num_warps, STAGES, KAHAN, programs per SM) of the backward (both windows: same)."""
    if H in BWD_BY_WIDTH:
        return BWD_BY_WIDTH[H]
    bn = _pow2(H)
    if bn <= 2048:
        bm, nw, st, kahan, pps = BWD_TABLE[2048]
        return max(1, bm * 2048 // bn), nw, st, kahan, pps
    return BWD_TABLE[bn]


# (forward config, backward config, backward programs) by (H, window, table arch); cached
ROWS = RowConfigs(fwd_config, bwd_config, SMALL_T)
window_of = ROWS.window
