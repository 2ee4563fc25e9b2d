"""Fixed launch configs of the kda kernels (no autotuning: a new process picks the same config, hence the same bits).

sm_90a: the in-chunk kernels' entries were chosen on an H200 (torch 2.11, triton 3.6) by per-kernel device time at 16
x 2048 tokens, H = HV = 32, K = V = 128 (`bench/kda_profile.py --cfg`, bench/NOTES.md kda v4); the other entries are
gdn's swept table (less gdn's prep, dq / dk / dw and WY entries: kernels kda does not have). The in-chunk kernels are
latency-bound: fewer registers per program (more programs per SM) won over wider tiles in every pair measured.
- gate BK: the gate and in-chunk cumsum of the log decay in BK-wide key slices; SPLIT programs per chunk along K (BK
  32 in 4 programs: 0.345 ms against 0.388 at BK 64 in 2, H200; BK changes the scan's bits).
- grams: one program per chunk and 16-row sub-block (1 warp, BK = 32; with the diagonal sub-block's tensor-core
  product: 1.69 ms against 2.62 at 2 warps; before it, 3.5 ms at 1 warp, 4.2 at 2, 4.5 at 4).
- grams / intra DIAG: how the diagonal 16 x 16 blocks are computed. "tensor_cores" (shipped): about the block's
  middle row as 3xTF32 products, where the decay allows it. "fma": the same factors on the FMA units, a column of
  the block at a time. "elementwise": always the exact fp32 path, exp(G_i - G_j) per entry. The other two modes fall
  back to "elementwise" where the decay is steep, so it is exact for any decay. Each mode has its own bits. The
  diagonal blocks alone took 0.97 ms of the forward at 16 x 2048 H32 (H100, as a kernel of their own); "fma" and
  "elementwise" are the candidates to time against it.
- inv: the block inverse per chunk (2 warps: 0.398 ms against 0.430 at 4, H100, same bits). TC (off): its 16 x 16
  products in 3xTF32 on the tensor cores instead of exact fp32 on the FMA units (other bits; 0.445 ms against
  0.405, H100).
- wu: w and u per chunk (8 warps: 0.634 ms against 0.673 at gdn's 4, H100, same bits).
- dense: the backward's plain matmuls per chunk, BK-wide key slices (32: 3.6 ms, 64: 3.8 with 280 B spilled); its
  slice loop pipelined 4 deep (num_stages 4: 3.29 ms against 3.59 at 2, 3.33 at 3, H200, same bits).
- intra: the backward's decay-weighted in-chunk products, one program per chunk, key slice and sub-block (one
  [16, 16] product per other sub-block of the document, side and M, and the tensor-core diagonal): BK 32 at 2
  warps 4.40 ms; 2 warps BK 64 5.12, BK 16 7.21; 1 warp BK 32 5.67; 4 warps BK 32 5.26, BK 16 13.1; 8 warps BK 64
  7.60 (H100, 16 x 2048 H32, safe gate; BK changes dbeta's bits by ~3e-8, nothing else).
- dg: the reverse scan of dG and the gate's backward per chunk, BK-wide key slices (4 warps: 1.42 ms against 1.55
  at 8, H200; BK 32: 1.37 ms against 1.56 at BK 64, 1.89 at 128 / 8 warps, H100; BK changes dg's bits by ~2e-7).
- o BV: the output kernel in BV-wide value slices (grid axis 2; 128: one slice at the served V <= 128; BV 64: 1.04
  ms against 0.74, H100, same bits).
- "h" takes 2 stages (3 need 246 784 B of shared memory, over the H200's 232 448: the G^T tile of a vector gate is
  pipelined too).
- maxnreg (any entry, optional): a per-thread register cap for that kernel (launch option). Set where a sweep found
  it faster, with the same bits (H100, 16 x 2048 H32, softplus gate, `bench/kda_profile.py`, ms per step): intra
  168 (4.42 -> 3.88; with num_stages 3 3.81; 128: 5.51, 192: 4.70), dg 128 (1.38 -> 1.21; 168: 1.44), wu 128
  (0.667 -> 0.626). At 255 registers these 2- and 4-warp programs ran at 12 % occupancy (ncu), stalled on
  shared-memory round trips; the cap lets more programs share an SM. It lost on grams (168: 1.66 -> 4.06), o
  (128: 0.72 -> 1.29), dvl and inv; on gdn every cap tried lost (bench/NOTES.md).
- final LOW_PARTIALS, LOW_DK (both off, unlike gdn): the per-value-head dq, dk sums read by bwd_final, and the dense
  backward's dk partial completed by the in-chunk backward, in fp32. In the input dtype (bf16, gdn's choice) they
  cost kda dq / dk 1.11 - 1.17x fla 0.6.0's error against FP64 (fla keeps them in fp32); in fp32 0.998x (H100,
  tests/cake/kda/test_kda_gpu.py's cases; bench/NOTES.md kda, "dq / dk partials in fp32").
- h_narrow / dh_narrow: the sequential state kernels switch to these smaller BV tiles where the wide tiles would give
  fewer than NARROW_BELOW programs (few long documents); the choice depends only on host shapes.
- DECAYED (any state entry: h, h_narrow, dh, dh_narrow): that state kernel reads k * exp(G_last - G) (and in dh
  q * exp(G) * scale) from buffers filled per chunk by `decayed` (its key slices BK; once per call, read by every
  state pass of the call, context parallelism's extra passes included) instead of forming them from k, q and the
  fp32 G on its sequential path; the same bits either way. On for the narrow tiles (one 32 768-token
  document, H32: fwd + bwd 20.75 -> 19.02 ms, H100; 2 / 1 stages or dh at BV 16 were slower); off for the wide ones
  (16 x 2048 H32: 17.89 -> 18.76 ms, H100: the operand pass costs more than the wide kernels' exps save).
- gate_sum: the fixed-order column sum of the per-chunk dA_log / ddt_bias partials (BP slots per step, BN columns
  per program).
"""

from ..delta_rule import tables

# gdn's table with the entries above changed (the other entries: `_impl/delta_rule/tables.SWEPT`)
CFG = tables.table(
    gate=dict(num_warps=4, BK=32, SPLIT=4),
    grams=dict(num_warps=1, BK=32, DIAG="tensor_cores"),
    inv=dict(num_warps=2, TC=False),
    o=dict(num_warps=4, BV=128),
    wu=dict(num_warps=8, maxnreg=128),
    h=dict(num_warps=8, num_stages=2, BV=128),
    h_narrow=dict(num_warps=4, num_stages=3, BV=32, DECAYED=True),
    dh_narrow=dict(num_warps=4, num_stages=2, BV=32, DECAYED=True),
    dense=dict(num_warps=8, BK=32, num_stages=4),
    intra=dict(num_warps=2, BK=32, maxnreg=168, num_stages=3, DIAG="tensor_cores"),
    dg=dict(num_warps=4, BK=32, maxnreg=128),
    gate_sum=dict(num_warps=4, BP=32, BN=128),
    decayed=dict(num_warps=4, BK=32),
    final=dict(num_warps=4, BR=16, LOW_PARTIALS=False, LOW_DK=False),
)
for _name in ("prep", "dqkw", "wy"):  # gdn's kernels that kda does not launch
    del CFG[_name]
NARROW_BELOW = tables.NARROW_BELOW  # programs of the wide state tiles under which h_narrow / dh_narrow are used
DEFAULT_STAGES = tables.DEFAULT_STAGES  # num_stages where an entry has none (the chunk kernels have no pipelined loop)

CONFIGS = tables.per_arch(CFG)  # per arch; the interpreter (CPU tests) runs the same table
