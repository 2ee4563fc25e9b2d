"""Fixed launch configs of the kda kernels (no autotuning: a new process picks the same config, hence the same bits).

UNTUNED: the sm_90a table is a first guess from gdn's swept table (same launch sequence and tiles), adjusted for the
larger live tiles of a per-key-dimension gate, and not swept on a GPU (the key slices below: one A/B,
bench/NOTES.md). Every route at K = V = 128 compiles for sm_90a (bench/kda_sass.py, triton 3.6 and 3.9); from the
first ptxas counts (before the key slices): "h" takes 2 stages (3 need 246 784 B of shared memory, over the
H200's 232 448: the G^T tile of a vector gate is pipelined too), the prep and dqkw 8 warps (4 spilled 2.1 /
1.5 KB; 8: 0.9 / 0.1 KB), the WY backward stays at 8 (16 caps registers at 128 and spills more; at 8 it spilled
~3 KB). BV / BK are capped at the head dims.
- prep BK, wy BK: the prep's grams and the WY backward loop over BK-wide key slices (64: one slice's tiles live at a
  time; offline, triton 3.6, sm_90a: the prep's spill 0.9 - 1.7 KB per thread at BK = K -> 0.3 KB, the WY
  backward's 2.3 - 2.6 KB -> 1.2 - 1.4 KB; 32-wide slices compile to the m64n16 / mma.sync tf32 shapes the journal
  suspects of triton 3.6's Hopper fault). wy num_stages 1: two stages double its shared memory to 256 KB, over the
  H200's 227 KB.
- maxnreg (any entry, optional): a per-thread register cap for that kernel (launch option); none set yet. Offline
  (triton 3.6, sm_90a): the prep at 128 spills 1.2 KB per thread (at the 255 default: 0.3 KB), dq / dk / dw 1.0 KB
  (0.1 KB) - the price of two CTAs of 8 warps per SM, to be measured against one (bench/NOTES.md, kda v3).
- dqkw BK < K: dq / dk / dw in K slices (each slice writes its own key dimensions of dG); SPLIT: dq, dw and dk in
  two launches (the dk launch adds its dG to the first's; num_warps_dk, BK_dk are the dk launch's).
- final LOW_PARTIALS: the per-value-head dq, dk sums read by bwd_final kept in the input dtype (bf16) instead of
  fp32; LOW_DK: dq/dk/dw's dk part, read back and completed by the WY backward, in the input dtype too (gdn's
  choices; see gdn's configs).
- h_narrow / dh_narrow: the sequential state kernels switch to these smaller BV tiles where the wide tiles would give
  fewer than NARROW_BELOW programs (few long documents); the choice depends only on host shapes.
- gate_sum: the fixed-order column sum of the per-chunk dA_log / ddt_bias partials (BP slots per step, BN columns
  per program).
"""

from ..delta_rule import tables

# gdn's table with the entries above changed (the other entries: `_impl/delta_rule/tables.SWEPT`)
CFG = tables.table(
    prep=dict(num_warps=8, BK=64),
    h=dict(num_warps=8, num_stages=2, BV=128),
    dqkw=dict(num_warps=8, BK=64, SPLIT=True, num_warps_dk=8, BK_dk=64),
    wy=dict(num_warps=8, num_stages=1, BK=64),
    gate_sum=dict(num_warps=4, BP=32, BN=128),
)
NARROW_BELOW = tables.NARROW_BELOW  # programs of the wide state tiles under which h_narrow / dh_narrow are used
DEFAULT_STAGES = tables.DEFAULT_STAGES  # num_stages where an entry has none (the chunk kernels have no pipelined loop)

CONFIGS = tables.per_arch(CFG)  # per arch; the interpreter (CPU tests) runs the same table
