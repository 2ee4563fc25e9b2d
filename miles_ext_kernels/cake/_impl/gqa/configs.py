"""Fixed launch configs of the gqa kernels per arch (no runtime autotune: a new process picks the same config, hence
the same bits); the interpreter is one more key. Nothing here depends on T or B, so a document's bits do not depend
on the pack it sits in. The measurements behind each choice are in bench/NOTES.md (gqa).
"""
from miles_ext_kernels.cake._runtime.build import INTERPRETER_ARCH

CONFIGS = {
    "sm_90a": {
        # DIAG_ONLY: the causal mask is computed only for key blocks on the diagonal (a branch, not a second loop)
        "fwd": dict(BM=128, BN=64, num_warps=8, num_stages=2, DIAG_ONLY=True),
        # the Gluon forward (gluon_fwd.py: a TMA loader warp and one partition per 64-row warpgroup; 4 warps is the
        # default partition of a 12-warp CTA, 168 registers a thread before reallocation, then 240 for each
        # warpgroup and 24 for the loader's) with the same BM, BN and the same bits; operands whose heads are not
        # contiguous within a row take the Triton forward above
        "fwd_gluon": dict(BM=128, BN=64, STAGES=2, num_warps=4, maxnreg=168),
        # short documents (max_seqlen_k <= SHORT_MAX_SEQLEN_K): 64-row tiles in `gluon_fwd.fwd_short_kernel`, one
        # warpgroup that issues its own TMA loads into one K and one V buffer (no loader warp: 98 KB of shared memory
        # and 128 threads, so two programs share an SM and one's loads and store overlap the other's matmuls). Same
        # bits as the route above: a 64-row tile runs the rows of one warpgroup of a 128-row tile in the same order.
        # The Triton config is the tile prefix's and the second pass's (and the forward's where the Gluon kernel
        # cannot read the operands)
        "fwd_short": dict(BM=64, BN=64, num_warps=4, num_stages=2, DIAG_ONLY=True),
        "fwd_gluon_short": dict(BM=64, BN=64, SELF_LOADING=True, num_warps=4),
        "dq": dict(BM=128, BN=64, num_warps=8, num_stages=1),
        # the Gluon dQ pass (gluon_bwd.py): same tiles; operands the Gluon forward cannot read take "dq" above
        "dq_gluon": dict(BM=128, BN=64, num_warps=8),
        # short documents (max_seqlen_k <= SHORT_DQ_MAX_SEQLEN_K): the same dQ kernel at 64-row tiles of one warpgroup
        # and 32-key blocks (115 KB of shared memory, 204 registers: two programs per SM; 64-key blocks or 128 rows at
        # 32 keys keep one program per SM and were slower). Same bits as the route above: each row's products
        # contract over the same keys in the same 16-key steps
        "dq_short": dict(BM=64, BN=32, num_warps=4, num_stages=1),
        "dq_gluon_short": dict(BM=64, BN=32, num_warps=4),
        # S = Q K^T with 128 query rows as M: both warpgroups share the work (a 64-row M replicates it)
        # PAIR "auto": programs take key tiles i and n-1-i of a segment where a model of the schedule says it
        # shortens it (near-equal documents, few programs per SM); the bits are the same either way
        "dkdv": dict(BM=128, BN=64, num_warps=8, num_stages=1, S_ROWS=True, PAIR="auto"),
        # the Gluon dK/dV pass (gluon_bwd.py: a TMA loader warp and two warpgroups, one per accumulator); 4 warps
        # is its default partition (the CTA has 12 warps: 4 + 4 + the loader's warpgroup; 168 registers a thread
        # before reallocation, then 240 for each compute warpgroup and 24 for the loader's). Operands the Gluon
        # forward cannot read take "dkdv" above
        # ROUND "auto": on near-equal documents, tile j of every segment runs before tile j + 1 of any (the heaviest
        # tiles of the last segments no longer start last); the order of programs only, never the bits
        "dkdv_gluon": dict(BM=64, BN=64, num_warps=4, maxnreg=168, ROUND="auto"),
    },
    # the interpreter (CPU tests): small blocks so tiny shapes still cross tile and mask boundaries
    INTERPRETER_ARCH: {
        "fwd": dict(BM=16, BN=16, num_warps=4, num_stages=1, DIAG_ONLY=True),
        "dq": dict(BM=16, BN=16, num_warps=4, num_stages=1),
        "dkdv": dict(BM=16, BN=16, num_warps=4, num_stages=1, S_ROWS=True, PAIR=True),
    },
}

# the forward's second pass (kernels._fwd_fix_kernel): FIX_CHUNK rows of LSE per read, one program per SM
# (FIX_PROGRAMS_OFF_GPU where there is none: the interpreter, meta tensors)
FIX_CHUNK = 2048
FIX_PROGRAMS_OFF_GPU = 2
# the forward's short-document route: calls whose max_seqlen_k (a host value) is at most this many keys. On the H100
# the 64-row self-loading kernel beats the 128-row one from 32-token documents (0.46 against 0.91 ms) to 512 (0.403
# against 0.419) and loses from 1024 on (bench/NOTES.md, gqa: the short-document route)
SHORT_MAX_SEQLEN_K = 512
# the dQ pass's short-document route: calls whose max_seqlen_k is at most this many keys. On the H200 the 64-row dQ
# pass beats the 128-row one from 32-token documents (0.58 against 1.30 ms) to 512 (0.630 against 0.639) and loses
# from 1024 on (0.95 against 0.90; bench/NOTES.md, gqa: the dQ pass on short documents)
SHORT_DQ_MAX_SEQLEN_K = 512
SCHEDULE_MAX_WAVES = 12  # "auto" orders are modelled only up to this many dK/dV programs per SM
# PAIR "auto" pairs only where the model's makespan drops below this fraction: the paired kernel spills a little
# more, so a small predicted gain measured none (bench/NOTES.md, gqa: PAIR)
PAIR_GAIN = 0.85
# ROUND "auto" (Gluon dK/dV) orders by rounds only where the model's makespan drops below this fraction: rounds
# spread the running programs over every segment and kv head, which costs L2 locality (bench/NOTES.md, gqa: ROUND)
ROUND_GAIN = 0.95
