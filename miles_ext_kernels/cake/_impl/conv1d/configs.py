"""Fixed launch configs of the conv1d kernels, per arch (no autotuning: a new process picks the same config, hence
the same bits).
- fwd / bwd: a program owns BLOCK_D channels x CHUNK tokens and loads ROWS rows ahead of the arithmetic.
- red: the dw reduction (`dw_reduce_kernel`): BLOCK_P token-block partials per step, BLOCK_D channels per program.
sm_90a: picked on the H200 by `python bench/conv1d.py --sweep` (bench/NOTES.md, conv1d). The interpreter (CPU
tests) runs small blocks, so tiny shapes still span several programs.
"""

CONFIGS = {
    "sm_90a": {
        "fwd": dict(BLOCK_D=128, CHUNK=64, ROWS=8, num_warps=1, num_stages=1),
        "bwd": dict(BLOCK_D=128, CHUNK=256, ROWS=8, num_warps=1, num_stages=1),
        "red": dict(BLOCK_P=16, BLOCK_D=256, num_warps=4, num_stages=1),
    },
    "interpreter": {
        "fwd": dict(BLOCK_D=32, CHUNK=8, ROWS=8, num_warps=1, num_stages=1),
        "bwd": dict(BLOCK_D=32, CHUNK=16, ROWS=8, num_warps=1, num_stages=1),
        "red": dict(BLOCK_P=4, BLOCK_D=32, num_warps=1, num_stages=1),
    },
}
