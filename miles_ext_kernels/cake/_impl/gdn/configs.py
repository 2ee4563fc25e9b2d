"""Fixed launch configs of the gdn kernels (no autotuning: a new process picks the same config, hence the same
bits), chosen per kernel by a sweep at the shape of record (32k tokens, HV 32, K = V = 128) on an H200 (sm_90a,
triton 3.6). BV / BK are capped at the head dims.
- dqkw BK < K: dq / dk / dw in K slices (the WY backward adds their partial dG in slice order); SPLIT: dq, dw and
  dk in two launches (fewer live tiles each; num_warps_dk, BK_dk are the dk launch's).
- final LOW_PARTIALS: the per-value-head dq, dk sums read by bwd_final kept in the input dtype (bf16: half the bytes,
  one more rounding) instead of fp32. LOW_DK: dq/dk/dw's dk part, read back and completed by the WY backward, in
  the input dtype too (its fp32 tile was what made the WY backward slow: 1.33 -> 1.10 ms). Both on: fwd + bwd
  6.95 -> 6.49 ms at 16 x 2048 on the H200; dq / dk errors vs FP64 rise ~10 % and stay below fla's on the same
  inputs (see bench/NOTES.md). Both off restores fp32 partials (the more accurate, slower path).
- h_narrow / dh_narrow: the sequential state kernels (one program per sequence, value head and BV block) switch to
  these smaller BV tiles (when they are smaller at this V) where the wide tiles would give fewer than NARROW_BELOW
  programs (few long documents, e.g.
  one 32k document: 32 programs on 132 SMs). The choice depends only on the number of sequences and heads (host
  shapes), so a call's bits still repeat.
"""

from ..delta_rule import tables

CFG = tables.table()  # the swept values above: `_impl/delta_rule/tables.SWEPT` (kda's table starts from them)
NARROW_BELOW = tables.NARROW_BELOW  # programs of the wide state tiles under which h_narrow / dh_narrow are used
DEFAULT_STAGES = tables.DEFAULT_STAGES  # num_stages where an entry has none (the chunk kernels have no pipelined loop)

CONFIGS = tables.per_arch(CFG)  # per arch; the interpreter (CPU tests) runs the same table
