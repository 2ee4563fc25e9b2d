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

CFG = {
    "l2norm": dict(num_warps=4, BR=16),
    "prep": dict(num_warps=2),
    "wu": dict(num_warps=4),
    "h": dict(num_warps=8, num_stages=3, BV=128),
    "h_narrow": dict(num_warps=4, num_stages=3, BV=32),
    "o": dict(num_warps=4),
    "dvl": dict(num_warps=4),
    "dh": dict(num_warps=8, num_stages=1, BV=128),
    "dh_narrow": dict(num_warps=4, num_stages=2, BV=32),
    "dqkw": dict(num_warps=4, BK=128, SPLIT=True, num_warps_dk=4, BK_dk=128),
    "wy": dict(num_warps=4),
    "final": dict(num_warps=4, BR=16, LOW_PARTIALS=True, LOW_DK=True),
}
NARROW_BELOW = 128  # programs of the wide state tiles under which h_narrow / dh_narrow are used
DEFAULT_STAGES = 2  # num_stages where an entry has none (the chunk kernels have no pipelined loop)

# per arch; the interpreter (CPU tests) runs the same table
CONFIGS = {"sm_90a": CFG, "interpreter": CFG}
