"""Fixed launch configs of the gated_rmsnorm kernels (no autotuning), from the H200 sweeps in bench/NOTES.md, norms.

Windows by row count N = tokens x heads: N <= SMALL_N uses the "small" forward configs. The backward is
persistent: a fixed number of programs per SM of the table's arch (not the live SM count), so the det weight
gradient's bits depend only on N. One table serves every arch the op runs on (sm_90a, and the interpreter, which
runs it as sm_90a: `_norms.TABLE_ARCH`).
"""
from __future__ import annotations

import triton

from miles_ext_kernels.cake._runtime.reduce import RowConfigs

SMALL_N = 4096
WINDOWS = ("small", "large")

# Forward, large window: (elements per tile, num_warps): at 32 heads x 128 x 32k tokens 0.188 ms vs 0.201 for
# (4096, 4) and 0.224 for (8192, 8).
FWD_LARGE = (1024, 2)


def fwd_config(D: int, window: str):
    """(BLOCK_M, BLOCK_D, num_warps, num_stages) of the forward for head dim D."""
    bd = triton.next_power_of_2(D)
    if window == "small":
        return max(1, 2048 // bd), bd, 4, 1
    return max(1, FWD_LARGE[0] // bd), bd, FWD_LARGE[1], 1


# Backward (both windows): (elements per tile, num_warps, STAGES = row blocks of loads in flight + 1, programs per
# SM): 0.357 ms at 32 x 128 x 32k tokens vs 0.397 for the unpipelined (8192, 16, 1, 1).
BWD_TILE = (8192, 8, 3, 1)


def bwd_config(D: int, window: str):
    """(BLOCK_M, BLOCK_D, num_warps, STAGES, programs per SM) of the backward (both windows: same)."""
    bd = triton.next_power_of_2(D)
    el, nw, st, pps = BWD_TILE
    return max(1, el // bd), bd, nw, st, pps


# (forward config, backward config, backward programs) by (D, window, table arch); cached
ROWS = RowConfigs(fwd_config, bwd_config, SMALL_N)
window_of = ROWS.window
