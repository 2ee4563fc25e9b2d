"""Triton kernels of chunked Kimi Delta Attention (chunk BT = 64 tokens), on the delta-rule core shared with gdn.

Per value head `hv` (key head `hv // (HV // H)`), per chunk of one sequence, with G [BT, K] the in-chunk cumulative
sum of the log decay g (one per key dimension d), h [K, V] the state at the chunk start and
Gam_ij = exp(G_i - G_j) per key dimension (j <= i):

    L_ij   = beta_i sum_d k_id k_jd Gam_ij,d  (j < i)       A = (I + L)^-1           (UT / WY representation)
    Aqk_ij = scale sum_d q_id k_jd Gam_ij,d   (j <= i)
    w  = A (beta exp(G) * k)                                 u = A (beta v)
    dlt = u - w h                                            ("v_new": the per-token delta of the rule)
    o  = scale (q * exp(G)) h + Aqk dlt
    h' = exp(G_last)[:, None] * h + (k * exp(G_last - G))^T dlt

The launch sequence follows gdn's where the gate is a scalar's (w/u, state recurrence, o; in-chunk d(dlt), reverse
state recurrence, per-key-head sums) and fla's sub-block structure where it is a vector (`fla/ops/kda/chunk_intra.py`:
small programs per 16-row sub-block): forward gate + cumsum (gc [T, HV, K]), grams (Aqk, and L into fp32 scratch),
block inverse (A); backward in-chunk d(dlt) and dAqk, reverse state recurrence, the dense products (dq, dk's state
terms, dv, dbeta's v and X terms, dL = -A^T dA A^T), the decay-weighted in-chunk products per sub-block, the reverse
scan of dG with the gate's backward, the per-key-head sums and a fixed-order sum of the per-chunk dA_log / ddt_bias
partials. `_dot`, `_rnd`, the 16 x 16 inverse, the L2 norm and the per-key-head sum are the shared core's
(`_impl/delta_rule/common.py`).

Numerics of the in-chunk decay products. Gam differs per key dimension, so sum_d a_id b_jd Gam_ij,d is no plain
matmul, and exp(G_i) and exp(-G_j) alone overflow fp32 once a chunk's cumulative decay passes -88.7 (a decay of -3
per token gets there in 30 tokens). Choice: exact factorizations by 16-row sub-blocks. A pair j < i in different
sub-blocks has a reference row r between them (the later sub-block's first row for the products over rows, the
earlier sub-block's last row for the products over columns), so exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j) with
G_j >= G_r >= G_i for a decay (g <= 0): both factors are exps of non-positive numbers, whatever the decay, so no bound
on the gate is needed (fla's safe_gate path leans on lower_bound >= -5 to put a reference inside a 16-row block; a
pre-gated g promises no such bound), and each such block is one tf32 product. A factor that underflows to 0 stands
for a true product smaller still. A diagonal sub-block (both rows in the same 16) takes the sub-block's row 8 as
the reference where G falls by at most DIAG_SPAN (40) from the first row to it and from it to the last row on every
key dimension of the slice (checked per program from G, no bound on the gate assumed; always true under the safe
gate, 8 x 5, and wherever the decay averages above -5 per token over those rows), so both factors stay within
exp(40), and is one 3xTF32 product (fp32 accuracy; config DIAG "fma": the same factors on the FMA units); where
G falls faster (and always with DIAG "elementwise") it goes elementwise in fp32, exp(G_i - G_j) per entry (exact for
any decay). i == j has Gam = 1. The other products run at tf32 on rounded fp32
operands (fla's precision for them; exact fp32 when the run itself is fp32). `safe_gate` changes no result here
beyond what its gate computes.
Rows past a document's end read the document's last G (the prep's cumsum of g = 0, and clamped row indices
elsewhere): no exp over a pair of rows has a positive argument, so 0 * inf never makes a NaN.
A log decay below G_FLOOR (-128) reads as G_FLOOR, as in gdn (exp(-128) is 0 in fp32; g = -inf gives the exact,
finite result).

Layouts (rows are tokens of the packed sequence): q, k [T, H, K]; v [T, HV, V]; g (log decay, or the raw gate) [T, HV,
K] (these four with row strides SQ, SK, SV, SG: views of a wider projection, heads packed within a row); beta [T, HV]
fp32; gc [T, HV, K] fp32; A, Aqk [T, HV, BT] (L, dAqk, dL: the same, fp32); w [T, HV, K]; u, dlt [T, HV, V]; chunk
states h [P, HV, K, V] with one slot per chunk (slot = bos[n] // BT + n + chunk index); `table`, `se` from
`_runtime.varlen.chunk_table` (every kernel reads the clamped `se`, never cu_seqlens). Initial / final states [N, HV, K,
V], or [N, HV, V, K] with TRANS_STATE (read and written through transposed offsets, no tl.trans).

No kernel feeds a transposed `tl.dot` result into another `tl.dot` (triton 3.4 - 3.7.0 miscompile that on Hopper):
transposed operands are loaded transposed or are elementwise products. No atomics: every sum has one fixed order, so the
results repeat bit for bit.

Interpreter (CPU tests): bf16 arithmetic is broken there, so elementwise math runs on fp32 values, `_dot` converts
its bf16 operands to fp32, `_rnd` rounds to nearest even, and `_tdot` multiplies the tf32-rounded operands exactly
(the GPU's tensor cores read the same rounded values).
"""
import triton
import triton.language as tl

from ..delta_rule import common
from ..delta_rule.common import (
    _causal_store,
    _chunk_doc,
    _dot,
    _dot32,
    _finite_rows,
    _inv_unit_lower,
    _nan_rows,
    _rnd,
    _seq_program,
    _state_start,
    _store_slot,
)

BT = common.BT  # chunk length
G_FLOOR = common.G_FLOOR
# gate kinds (constexpr GATE): the log decay as given; -exp(A_log) softplus(g + dt_bias); lower_bound sigmoid(...)
GATE_NONE, GATE_SOFTPLUS, GATE_SIGMOID = 0, 1, 2
# how the diagonal 16 x 16 sub-blocks are computed (constexpr DIAG): elementwise, exp(G_i - G_j) per entry (exact for
# any decay); about the block's row 8 as one 3xTF32 product on the tensor cores; or about row 8 on the FMA units, one
# column (or row) of the block at a time. The last two fall back to the first where the decay about row 8 is steep.
DIAG_ELEMENTWISE, DIAG_TENSOR_CORES, DIAG_FMA = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
DIAG_MODES = {"elementwise": DIAG_ELEMENTWISE.value, "tensor_cores": DIAG_TENSOR_CORES.value, "fma": DIAG_FMA.value}
# the diagonal sub-blocks' tensor-core products need G to fall by at most this much on either side of the middle row
# (factors <= exp(40) ~ 2.4e17, far from fp32's overflow even times large operands); otherwise elementwise
DIAG_SPAN = tl.constexpr(40.0)


@triton.jit
def _tdot(a, b, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """a @ b of fp32 decay-weighted operands at tf32 in a bf16 run (fla's precision for these products), exact fp32
    when the run itself is fp32 (DT: the math tests). The operands are rounded to tf32 (nearest even) here: the
    tensor cores ignore the 13 low mantissa bits, a truncation whose bias toward zero adds up in the sums over tokens
    (dA_log, ddt_bias: measured 1.2e-2 -> 6e-3 of their terms' scale). The interpreter multiplies the same rounded
    values exactly (inline: a nested jit call costs it a re-patch of triton.language)."""
    if DT == tl.float32:
        r = tl.dot(a, b, input_precision="ieee")
    elif INTERPRET:  # the same rounding in integer arithmetic
        ua = a.to(tl.uint32, bitcast=True)
        ub = b.to(tl.uint32, bitcast=True)
        ra = (((ua + 0xFFF + ((ua >> 13) & 1)) >> 13) << 13).to(tl.float32, bitcast=True)
        rb = (((ub + 0xFFF + ((ub >> 13) & 1)) >> 13) << 13).to(tl.float32, bitcast=True)
        r = tl.dot(ra, rb, input_precision="ieee")
    else:
        r = tl.dot(_tf32_rn(a), _tf32_rn(b), input_precision="tf32")
    return r


@triton.jit
def _tf32_rn(x):
    """fp32 x rounded to tf32 (10 mantissa bits) to nearest even by one conversion per element (sm_90's
    cvt.rn.tf32.f32, an F2FP: ~4 integer instructions fewer than the interpreter's rounding, the same bits for finite
    x, and a NaN stays NaN)."""
    return tl.inline_asm_elementwise("cvt.rn.tf32.f32 $0, $1;", "=r,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _xdot(a, b, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """a @ b of fp32 operands at about fp32 accuracy: 3xTF32 on the tensor cores in a bf16 run (a = a_hi + a_lo,
    a_hi b_hi + a_hi b_lo + a_lo b_hi), exact fp32 when the run itself is fp32 and in the interpreter. The diagonal
    sub-blocks' products (`_diag_refs`) use it: the accuracy of the elementwise fp32 path they stand for."""
    if DT == tl.float32 or INTERPRET:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        r = tl.dot(a, b, input_precision="tf32x3")
    return r


@triton.jit
def _softplus(x):
    """log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)), log1p to fp32 accuracy as u log(w) / (w - 1), w = 1 + u."""
    u = tl.exp(-tl.abs(x))
    w = 1. + u
    return tl.maximum(x, 0.) + tl.where(w == 1., u, tl.log(w) * (u / (w - 1.)))


@triton.jit
def _gate_params(A_log, dt_bias, hv, o_k, K: tl.constexpr, GATE: tl.constexpr):
    """(A_log[hv], dt_bias[hv, o_k]) in fp32; zeros without the in-kernel gate (the pointers are stand-ins)."""
    if GATE != 0:
        a_log = tl.load(A_log + hv).to(tl.float32)
        bias = tl.load(dt_bias + hv * K + o_k).to(tl.float32)
    else:
        a_log = 0.
        bias = tl.zeros(o_k.shape, dtype=tl.float32)
    return a_log, bias


@triton.jit
def _gate(x, a_log, lower_bound, GATE: tl.constexpr):
    """The in-kernel gate's log decay from x = g + dt_bias."""
    if GATE == 1:
        r = -tl.exp(a_log) * _softplus(x)
    else:
        r = lower_bound * tl.sigmoid(tl.exp(a_log) * x)
    return r


@triton.jit
def _join4(x0, x1, x2, x3):
    """Four [16, 16] blocks x0..x3 as one [16, 16, 2, 2] tile (block index a = 2 a1 + a0 in the last two axes,
    (a1, a0))."""
    return tl.join(tl.join(x0, x2), tl.join(x1, x3))


@triton.jit
def _mblk(M, nr, r0, c0, BT: tl.constexpr, RS, TRANS: tl.constexpr):
    """The [16, 16] block of a chunk's in-chunk matrix (M: its row 0, row stride RS) at rows r0, columns c0 (TRANS:
    its transpose, loaded transposed); rows at or past nr (the document's end) read 0."""
    o = tl.arange(0, 16)
    r = r0 + o
    if TRANS:
        x = tl.load(M + r[None, :] * RS + c0 + o[:, None], mask=(r < nr)[None, :], other=0.)
    else:
        x = tl.load(M + r[:, None] * RS + c0 + o[None, :], mask=(r < nr)[:, None], other=0.)
    return x


@triton.jit
def _rows(x, nr, r0, RS, o_k, N: tl.constexpr, CLAMP: tl.constexpr):
    """Rows [r0, r0 + N) of a chunk (x: its row 0, row stride RS) in the key slice o_k, fp32: 0 at or past nr (the
    document's end), or with CLAMP (the cumulative gate) the document's last row."""
    r = r0 + tl.arange(0, N)
    if CLAMP:
        b = tl.load(x + tl.minimum(r, nr - 1)[:, None] * RS + o_k[None, :])
    else:
        b = tl.load(x + r[:, None] * RS + o_k[None, :], mask=(r < nr)[:, None], other=0.)
    return b.to(tl.float32)


@triton.jit
def _diag_refs(gcb, nr, r0, RS, o_k, gn):
    """The diagonal sub-block's reference for its tensor-core products: (gm, ok) with gm the log decay G at its row 8
    (the document's last row past its end) and ok whether every factor about it stays within exp(DIAG_SPAN): G from
    the first row gn down to gm, and from gm down to the last row, by at most DIAG_SPAN on every key dimension of the
    slice (a NaN fails it). A bounded gate always passes (the safe gate: 8 x 5); a sub-block that fails takes the
    elementwise path, exact for any decay."""
    gm = tl.load(gcb + tl.minimum(r0 + 8, nr - 1) * RS + o_k)
    gl = tl.load(gcb + tl.minimum(r0 + 15, nr - 1) * RS + o_k)
    ok = (gn - gm <= DIAG_SPAN) & (gm - gl <= DIAG_SPAN)
    return gm, tl.sum(tl.where(ok, 0, 1), 0) == 0


# ----------------------------------------------------------------------------------------------------------------
# forward
@triton.jit
def _bad(a, b, c, d):
    """[16]: the rows of a [16, 64] strip of four [16, 16] blocks that hold a NaN or an inf."""
    return (tl.sum(a * 0., 1) + tl.sum(b * 0., 1) + tl.sum(c * 0., 1) + tl.sum(d * 0., 1)) != 0.


@triton.jit
def _store_strip(out, t0, eos, r0: tl.constexpr, hv, HV, b0, b1, b2, b3, first, BT: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """Rows [r0, r0 + 16) of a chunk's [BT, BT] matrix ([T, HV, BT] layout) from its four [16, 16] blocks (block
    column J = bJ), the rows from `first` on NaN (`_nan_rows`)."""
    o = tl.arange(0, 16)
    rows = t0 + r0 + o
    strip = tl.reshape(tl.permute(_join4(b0, b1, b2, b3), (0, 2, 3, 1)), [16, BT])
    if first < BT:
        strip = _nan_rows(strip, first, r0)
    tl.store(out + rows[:, None] * (HV * BT) + hv * BT + tl.arange(0, BT)[None, :],
             _rnd(strip, out.dtype.element_ty, INTERPRET), mask=(rows < eos)[:, None])


@triton.jit(do_not_specialize=["H", "HV"])
def fwd_gate_kernel(g, A_log, dt_bias, se, table, gc, lower_bound, SG, H, HV, K: tl.constexpr, BT: tl.constexpr,
                    BK: tl.constexpr, SPLIT: tl.constexpr, GATE: tl.constexpr):
    """Per chunk and 1 / SPLIT of the key dimensions (grid axis 2): the gate (GATE) and gc = the in-chunk cumsum of
    the log decay, in BK-wide key slices. g's rows are SG elements apart (a view of a wider projection is read in
    place), its heads packed within a row."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    NS: tl.constexpr = K // BK // SPLIT  # key slices per program
    ks0 = tl.program_id(2) * NS
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic, bos, eos = _chunk_doc(table, se, p, n)
    o_t = tl.arange(0, BT)
    rows = bos + ic * BT + o_t
    m = rows < eos
    for ks in range(ks0, ks0 + NS):
        o_k = ks * BK + tl.arange(0, BK)
        col = hv * K + o_k[None, :]
        b_g = tl.load(g + rows[:, None] * SG + col, mask=m[:, None], other=0.).to(tl.float32)
        if GATE != 0:
            a_log, bias = _gate_params(A_log, dt_bias, hv, o_k, K, GATE)
            b_g = _gate(b_g + bias[None, :], a_log, lower_bound, GATE)
        b_g = tl.where(m[:, None], tl.where(b_g < G_FLOOR, G_FLOOR, b_g), 0.)
        tl.store(gc + rows[:, None] * (HV * K) + col, tl.cumsum(b_g, axis=0), mask=m[:, None])


@triton.jit(do_not_specialize=["H", "HV"])
def fwd_grams_kernel(q, k, gc, beta, se, table, Aqk, Ls, scale, SQ, SK, H, HV, K: tl.constexpr, BT: tl.constexpr,
                     BK: tl.constexpr, DIAG: tl.constexpr, INTERPRET: tl.constexpr):
    """Per chunk and 16-row sub-block i: its rows of Aqk (stored) and of L (fp32, into Ls for fwd_inv_kernel), by
    sub-blocks (module docstring): the earlier rows in one product, (q_i, k_i * exp(G_i - G_r)) times
    (k_j exp(G_r - G_j))^T over every row j before the sub-block's first row r (both factors <= 1); the diagonal
    sub-block as one 3xTF32 product with its row 8 as the reference where the decay about it is bounded
    (`_diag_refs`; DIAG: or the same factors on the FMA units, one column at a time), otherwise (and always with
    DIAG_ELEMENTWISE) elementwise, one column at a time (exact for any decay). The key dimensions go in BK-wide
    slices."""
    pid = tl.program_id(0)
    hv = tl.program_id(1)
    i = pid % 4
    p = pid // 4
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic, bos, eos = _chunk_doc(table, se, p, n)
    t0 = bos + ic * BT
    nr = tl.minimum(eos - t0, BT).to(tl.int32)
    r0 = i * 16
    if r0 >= nr:
        return
    hk = hv // (HV // H)
    DT = k.dtype.element_ty
    o = tl.arange(0, 16)
    o_t = tl.arange(0, BT)
    qb = q + t0 * SQ + hk * K
    kb = k + t0 * SK + hk * K
    gcb = gc + t0 * (HV * K) + hv * K
    r = r0 + o
    m = r < nr
    before = (o_t < r0)[:, None]
    sq = tl.zeros([16, BT], dtype=tl.float32)
    sk = tl.zeros([16, BT], dtype=tl.float32)
    dq = tl.zeros([16, 16], dtype=tl.float32)  # the diagonal sub-block
    dk = tl.zeros([16, 16], dtype=tl.float32)
    for ks in range(0, K // BK):
        o_k = ks * BK + tl.arange(0, BK)
        b_q = _rows(qb, nr, r0, SQ, o_k, 16, False)
        b_k = _rows(kb, nr, r0, SK, o_k, 16, False)
        b_g = _rows(gcb, nr, r0, HV * K, o_k, 16, True)
        gn = tl.load(gcb + r0 * (HV * K) + o_k)
        e = tl.exp(b_g - gn[None, :])
        ka = tl.load(kb + o_t[:, None] * SK + o_k[None, :], mask=before, other=0.).to(tl.float32)
        ga = tl.load(gcb + o_t[:, None] * (HV * K) + o_k[None, :], mask=before, other=0.)  # rows < r0 < nr
        # selected after the product: the rows from r on (exp of a positive difference) never count
        kgt = tl.trans(tl.where(before, ka * tl.exp(gn[None, :] - ga), 0.))
        sq += _tdot(b_q * e, kgt, DT, INTERPRET)
        sk += _tdot(b_k * e, kgt, DT, INTERPRET)
        # both diagonal paths without a branch (an if / else around them gave NaNs on the elementwise side, triton
        # 3.6 on Hopper): the product about row 8, kept where the span allows it (its exponents capped, so it stays
        # finite where it is dropped), and the elementwise loop, 16 steps where it does not and none where it does
        # (DIAG_ELEMENTWISE: always). Entries above the diagonal are dropped after the slices
        if DIAG == DIAG_ELEMENTWISE:
            steps = 16
        else:
            gm, diag_ok = _diag_refs(gcb, nr, r0, HV * K, o_k, gn)
            em = tl.exp(tl.minimum(b_g - gm[None, :], DIAG_SPAN))
            if DIAG == DIAG_TENSOR_CORES:
                kdt = tl.trans(b_k * tl.exp(tl.minimum(gm[None, :] - b_g, DIAG_SPAN)))
                dq += tl.where(diag_ok, _xdot(b_q * em, kdt, DT, INTERPRET), 0.)
                dk += tl.where(diag_ok, _xdot(b_k * em, kdt, DT, INTERPRET), 0.)
            else:  # the same factors, column j at a time on the FMA units: one [BK] exp per column
                qm = b_q * em
                km = b_k * em
                for j in range(0, tl.where(diag_ok, 16, 0)):
                    rc = tl.minimum(r0 + j, nr - 1)
                    kj = tl.where(r0 + j < nr, tl.load(kb + rc * SK + o_k).to(tl.float32), 0.)
                    kf = kj * tl.exp(tl.minimum(gm - tl.load(gcb + rc * (HV * K) + o_k), DIAG_SPAN))
                    sel = (o == j)[None, :]
                    dq = tl.where(sel, dq + tl.sum(qm * kf[None, :], 1)[:, None], dq)
                    dk = tl.where(sel, dk + tl.sum(km * kf[None, :], 1)[:, None], dk)
            steps = tl.where(diag_ok, 0, 16)
        for j in range(0, steps):
            rc = tl.minimum(r0 + j, nr - 1)
            kj = tl.where(r0 + j < nr, tl.load(kb + rc * SK + o_k).to(tl.float32), 0.)
            gj = tl.load(gcb + rc * (HV * K) + o_k)
            # masked after the product: a non-finite k_j must not reach the rows before it
            kje = tl.where((o >= j)[:, None], tl.exp(b_g - gj[None, :]) * kj[None, :], 0.)
            sel = (o == j)[None, :]
            dq = tl.where(sel, dq + tl.sum(b_q * kje, 1)[:, None], dq)
            dk = tl.where(sel, dk + tl.sum(b_k * kje, 1)[:, None], dk)
    b_b = tl.load(beta + (t0 + r) * HV + hv, mask=m, other=0.).to(tl.float32)
    # two disjoint stores: the strip outside the diagonal sub-block, then the sub-block (j <= i for Aqk, j < i for L)
    a_off = (t0 + r)[:, None] * (HV * BT) + hv * BT + o_t[None, :]
    ms = m[:, None] & ((o_t < r0) | (o_t >= r0 + 16))[None, :]
    tl.store(Aqk + a_off, _rnd(sq * scale, Aqk.dtype.element_ty, INTERPRET), mask=ms)
    tl.store(Ls + a_off, sk * b_b[:, None], mask=ms)
    d_off = (t0 + r)[:, None] * (HV * BT) + hv * BT + r0 + o[None, :]
    dq = tl.where(o[:, None] >= o[None, :], dq, 0.)
    dk = tl.where(o[:, None] > o[None, :], dk, 0.)
    tl.store(Aqk + d_off, _rnd(dq * scale, Aqk.dtype.element_ty, INTERPRET), mask=m[:, None])
    tl.store(Ls + d_off, dk * b_b[:, None], mask=m[:, None])


@triton.jit(do_not_specialize=["HV"])
def fwd_inv_kernel(Ls, se, table, A, HV, BT: tl.constexpr, TC: tl.constexpr, INTERPRET: tl.constexpr):
    """Per chunk: A = (I + L)^-1 from L's 16 x 16 blocks (fwd_grams_kernel's Ls; gdn's block inverse), its 16 x 16
    products in exact fp32 or, with TC, 3xTF32 on the tensor cores (`_dot32`)."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic, bos, eos = _chunk_doc(table, se, p, n)
    t0 = bos + ic * BT
    nr = tl.minimum(eos - t0, BT).to(tl.int32)
    lb = Ls + t0 * (HV * BT) + hv * BT
    o = tl.arange(0, 16)
    strict = o[:, None] > o[None, :]
    L00 = tl.where(strict, _mblk(lb, nr, 0, 0, BT, HV * BT, False), 0.)
    L10 = _mblk(lb, nr, 16, 0, BT, HV * BT, False)
    L11 = tl.where(strict, _mblk(lb, nr, 16, 16, BT, HV * BT, False), 0.)
    L20 = _mblk(lb, nr, 32, 0, BT, HV * BT, False)
    L21 = _mblk(lb, nr, 32, 16, BT, HV * BT, False)
    L22 = tl.where(strict, _mblk(lb, nr, 32, 32, BT, HV * BT, False), 0.)
    L30 = _mblk(lb, nr, 48, 0, BT, HV * BT, False)
    L31 = _mblk(lb, nr, 48, 16, BT, HV * BT, False)
    L32 = _mblk(lb, nr, 48, 32, BT, HV * BT, False)
    L33 = tl.where(strict, _mblk(lb, nr, 48, 48, BT, HV * BT, False), 0.)
    z = tl.zeros([16, 16], dtype=tl.float32)
    # a non-finite entry of L (row i: tokens <= i) would spread to earlier rows of A through the block products'
    # zeros: A from L's finite rows, and A's rows from L's first non-finite row on are NaN (`_finite_rows`)
    f = tl.zeros([], dtype=tl.int32) + BT
    if tl.sum(tl.sum(L00 + L10 + L11 + L20 + L21 + L22 + L30 + L31 + L32 + L33, 1) * 0., 0) != 0.:
        x0 = _bad(L00, z, z, z)
        x1 = _bad(L10, L11, z, z)
        x2 = _bad(L20, L21, L22, z)
        x3 = _bad(L30, L31, L32, L33)
        f = tl.minimum(tl.minimum(tl.min(tl.where(x0, o, 2 ** 30), 0), tl.min(tl.where(x1, o + 16, 2 ** 30), 0)),
                       tl.minimum(tl.min(tl.where(x2, o + 32, 2 ** 30), 0), tl.min(tl.where(x3, o + 48, 2 ** 30), 0)))
        L00 = tl.where(x0[:, None], 0., L00)
        L10 = tl.where(x1[:, None], 0., L10)
        L11 = tl.where(x1[:, None], 0., L11)
        L20 = tl.where(x2[:, None], 0., L20)
        L21 = tl.where(x2[:, None], 0., L21)
        L22 = tl.where(x2[:, None], 0., L22)
        L30 = tl.where(x3[:, None], 0., L30)
        L31 = tl.where(x3[:, None], 0., L31)
        L32 = tl.where(x3[:, None], 0., L32)
        L33 = tl.where(x3[:, None], 0., L33)
    A00 = _inv_unit_lower(L00, TC)
    A11 = _inv_unit_lower(L11, TC)
    A22 = _inv_unit_lower(L22, TC)
    A33 = _inv_unit_lower(L33, TC)
    A10 = -_dot32(_dot32(A11, L10, TC), A00, TC)
    A21 = -_dot32(_dot32(A22, L21, TC), A11, TC)
    A32 = -_dot32(_dot32(A33, L32, TC), A22, TC)
    A20 = -_dot32(A22, _dot32(L20, A00, TC) + _dot32(L21, A10, TC), TC)
    A31 = -_dot32(A33, _dot32(L31, A11, TC) + _dot32(L32, A21, TC), TC)
    A30 = -_dot32(A33, _dot32(L30, A00, TC) + _dot32(L31, A10, TC) + _dot32(L32, A20, TC), TC)
    _store_strip(A, t0, eos, 0, hv, HV, A00, z, z, z, f, BT, INTERPRET)
    _store_strip(A, t0, eos, 16, hv, HV, A10, A11, z, z, f, BT, INTERPRET)
    _store_strip(A, t0, eos, 32, hv, HV, A20, A21, A22, z, f, BT, INTERPRET)
    _store_strip(A, t0, eos, 48, hv, HV, A30, A31, A32, A33, f, BT, INTERPRET)


@triton.jit(do_not_specialize=["H", "HV"])
def fwd_wu_kernel(k, v, beta, gc, A, se, table, w, u, SK, SV, H, HV, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, INTERPRET: tl.constexpr):
    """w = A (beta exp(G) * k), u = A (beta v) per chunk. SK, SV: k's and v's row strides (elements between
    tokens)."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic, bos, eos = _chunk_doc(table, se, p, n)
    hk = hv // (HV // H)
    DT = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    rows = bos + ic * BT + o_t
    m = rows < eos
    b_A = tl.load(A + rows[:, None] * (HV * BT) + hv * BT + o_t[None, :], mask=m[:, None], other=0.)
    b_gc = tl.load(gc + rows[:, None] * (HV * K) + hv * K + o_k[None, :], mask=m[:, None], other=0.)
    b_b = tl.load(beta + rows * HV + hv, mask=m, other=0.).to(tl.float32)
    b_k = tl.load(k + rows[:, None] * SK + hk * K + o_k[None, :], mask=m[:, None], other=0.).to(tl.float32)
    # A is lower triangular: a non-finite row of X or Y is zeroed for the product, and the rows of w / u from it on
    # are NaN (`_causal_store`)
    b_x = b_k * (b_b[:, None] * tl.exp(b_gc))
    _causal_store(b_A, b_x, w, rows, m, hv, HV, o_k, K, BT, DT, INTERPRET)
    b_v = tl.load(v + rows[:, None] * SV + hv * V + o_v[None, :], mask=m[:, None], other=0.).to(tl.float32)
    _causal_store(b_A, b_v * b_b[:, None], u, rows, m, hv, HV, o_v, V, BT, DT, INTERPRET)


@triton.jit(do_not_specialize=["H", "HV"])
def decayed_kernel(q, k, gc, se, table, kd, qg, scale, SQ, SK, H, HV, K: tl.constexpr, BT: tl.constexpr,
                   BK: tl.constexpr, WITH_Q: tl.constexpr, INTERPRET: tl.constexpr):
    """Per chunk, the state kernels' decay-weighted operands, for their DECAYED route: kd = k * exp(G_last - G) and
    (WITH_Q) qg = q * exp(G) * scale, both rounded to the run's dtype, [T, HV, K] (0 past the document's end): the
    same values, bit for bit, that fwd_h_kernel and bwd_dh_kernel otherwise form per chunk on their sequential path
    (the same fp32 operands from gc and the same operations), so the route changes the time, never the bits."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic, bos, eos = _chunk_doc(table, se, p, n)
    hk = hv // (HV // H)
    DT = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    t0 = bos + ic * BT
    rows = t0 + o_t
    m = rows < eos
    last = tl.minimum(t0 + BT, eos) - 1
    for ks in range(0, K // BK):
        o_k = ks * BK + tl.arange(0, BK)
        g_off = rows[:, None] * (HV * K) + hv * K + o_k[None, :]
        g_last = tl.load(gc + last * (HV * K) + hv * K + o_k)
        b_g = tl.load(gc + g_off, mask=m[:, None], other=0.)
        fac = tl.where(m[:, None], tl.exp(g_last[None, :] - b_g), 0.)
        b_k = tl.load(k + rows[:, None] * SK + hk * K + o_k[None, :], mask=m[:, None], other=0.)
        tl.store(kd + g_off, _rnd((b_k.to(tl.float32) * fac), DT, INTERPRET), mask=m[:, None])
        if WITH_Q:
            b_q = tl.load(q + rows[:, None] * SQ + hk * K + o_k[None, :], mask=m[:, None], other=0.)
            b_qg = _rnd((b_q.to(tl.float32) * tl.where(m[:, None], tl.exp(b_g) * scale, 0.)), DT, INTERPRET)
            tl.store(qg + g_off, b_qg, mask=m[:, None])


@triton.jit(do_not_specialize=["H", "HV"])
def fwd_h_kernel(k, kd, w, u, gc, se, h0, h, vn, ht, SK, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, TRANS_STATE: tl.constexpr,
                 STORE_H: tl.constexpr, VU: tl.constexpr, DECAYED: tl.constexpr, INTERPRET: tl.constexpr):
    """The inter-chunk state recurrence of one sequence and value head (a BV-wide slice of V). STORE_H off: only
    the final state (context parallelism's extra pass). u holds the first VU of the V columns (the rest read 0).
    DECAYED: k * exp(G_last - G) is read from kd (decayed_kernel) instead of formed here from k and G (same bits)."""
    iv, n, hv, hk, bos, eos, nt, slot0 = _seq_program(se, H, HV, BT)
    DT = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = iv * BV + tl.arange(0, BV)
    st_off, b_h = _state_start(h0, n, hv, HV, o_k, o_v, K, V, BV, USE_H0, TRANS_STATE)
    for ic in range(0, nt):
        t0 = bos + ic * BT
        rows = t0 + o_t
        m = rows < eos
        if STORE_H:
            _store_slot(h, slot0 + ic, hv, HV, o_k, o_v, b_h, K, V, DT, INTERPRET)
        b_w = tl.load(w + rows[:, None] * (HV * K) + hv * K + o_k[None, :], mask=m[:, None], other=0.)
        if VU == V:
            b_u = tl.load(u + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None], other=0.)
        else:
            b_u = tl.load(u + rows[:, None] * (HV * VU) + hv * VU + o_v[None, :], mask=m[:, None] & (o_v < VU)[None, :],
                          other=0.)
        b_vn = b_u.to(tl.float32) - _dot(b_w, _rnd(b_h, DT, INTERPRET), INTERPRET)
        b_vn = _rnd(b_vn, DT, INTERPRET)
        if STORE_H:
            tl.store(vn + rows[:, None] * (HV * V) + hv * V + o_v[None, :], b_vn, mask=m[:, None])
        last = tl.minimum(t0 + BT, eos) - 1
        g_last = tl.load(gc + last * (HV * K) + hv * K + o_k)
        if DECAYED:
            b_kt = tl.load(kd + rows[None, :] * (HV * K) + hv * K + o_k[:, None], mask=m[None, :], other=0.)
        else:
            b_gct = tl.load(gc + rows[None, :] * (HV * K) + hv * K + o_k[:, None], mask=m[None, :], other=0.)  # G^T
            fac = tl.where(m[None, :], tl.exp(g_last[:, None] - b_gct), 0.)
            b_kt = tl.load(k + rows[None, :] * SK + hk * K + o_k[:, None], mask=m[None, :], other=0.)
            b_kt = _rnd((b_kt.to(tl.float32) * fac), DT, INTERPRET)
        b_h = b_h * tl.exp(g_last)[:, None] + _dot(b_kt, b_vn, INTERPRET)
    if STORE_HT:
        tl.store(ht + st_off, b_h)


@triton.jit(do_not_specialize=["H", "HV"])
def fwd_o_kernel(q, gc, Aqk, vn, h, se, table, o, scale, SQ, H, HV, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, BV: tl.constexpr, INTERPRET: tl.constexpr):
    """o = scale (q * exp(G)) h + Aqk dlt per chunk and BV-wide slice of V (grid axis 2)."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    iv = tl.program_id(2)
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic, bos, eos = _chunk_doc(table, se, p, n)
    hk = hv // (HV // H)
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = iv * BV + tl.arange(0, BV)
    rows = bos + ic * BT + o_t
    m = rows < eos
    b_q = tl.load(q + rows[:, None] * SQ + hk * K + o_k[None, :], mask=m[:, None], other=0.)
    b_gc = tl.load(gc + rows[:, None] * (HV * K) + hv * K + o_k[None, :], mask=m[:, None], other=0.)
    b_qg = _rnd((b_q.to(tl.float32) * tl.exp(b_gc)), DT, INTERPRET)
    b_h = tl.load(h + (p.to(tl.int64) * HV + hv) * (K * V) + o_k[:, None] * V + o_v[None, :])
    b_o = _dot(b_qg, b_h, INTERPRET) * scale
    b_a = tl.load(Aqk + rows[:, None] * (HV * BT) + hv * BT + o_t[None, :], mask=m[:, None], other=0.)
    b_vn = tl.load(vn + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None], other=0.)
    # Aqk is lower triangular: a non-finite row of dlt is zeroed for the product, o's rows from it on are NaN
    b_vn, fv = _finite_rows(b_vn, BT, 0)
    b_o += _dot(b_a, b_vn, INTERPRET)
    if fv < BT:
        b_o = _nan_rows(b_o, fv, 0)
    tl.store(o + rows[:, None] * (HV * V) + hv * V + o_v[None, :], _rnd(b_o, o.dtype.element_ty, INTERPRET),
             mask=m[:, None])


# ----------------------------------------------------------------------------------------------------------------
# backward
@triton.jit(do_not_specialize=["H", "HV"])
def bwd_dvl_kernel(Aqk, do, vn, se, table, dvl, dAqk, scale, H, HV, V: tl.constexpr, BT: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """The in-chunk part of d(dlt): Aqk^T do (Aqk loaded transposed); dAqk = scale do dlt^T (j <= i, zeros above;
    fp32), the in-chunk matrix of the decay-weighted products that bwd_intra_kernel takes back through."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic, bos, eos = _chunk_doc(table, se, p, n)
    o_t = tl.arange(0, BT)
    o_v = tl.arange(0, V)
    rows = bos + ic * BT + o_t
    m = rows < eos
    b_at = tl.load(Aqk + rows[None, :] * (HV * BT) + hv * BT + o_t[:, None], mask=m[None, :], other=0.)  # [j, i]
    b_do = tl.load(do + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None], other=0.)
    b_dv = _dot(b_at, b_do, INTERPRET)
    tl.store(dvl + rows[:, None] * (HV * V) + hv * V + o_v[None, :], _rnd(b_dv, dvl.dtype.element_ty, INTERPRET),
             mask=m[:, None])
    b_vnt = tl.load(vn + rows[None, :] * (HV * V) + hv * V + o_v[:, None], mask=m[None, :], other=0.)  # dlt^T
    b_m = tl.where(o_t[:, None] >= o_t[None, :], _dot(b_do, b_vnt, INTERPRET) * scale, 0.)
    tl.store(dAqk + rows[:, None] * (HV * BT) + hv * BT + o_t[None, :], b_m, mask=m[:, None])


@triton.jit(do_not_specialize=["H", "HV"])
def bwd_dh_kernel(q, k, kd, qg, w, do, dvl, gc, se, dht, dh0, dhe, dd, scale, SQ, SK, H, HV, K: tl.constexpr,
                  V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                  STORE_DHE: tl.constexpr, TRANS_STATE: tl.constexpr, DECAYED: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Reverse state recurrence: dhe[slot] = d(state at the chunk end); dd = full d(dlt) (dvl, its in-chunk part
    from bwd_dvl_kernel, plus the state's); dh0. STORE_DHE off: only dh0 (context parallelism's extra pass, whose
    dhe and dd the op's own pass would overwrite). DECAYED: k * exp(G_last - G) and q * exp(G) * scale are read
    from kd and qg (decayed_kernel) instead of formed here (same bits)."""
    iv, n, hv, hk, bos, eos, nt, slot0 = _seq_program(se, H, HV, BT)
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = iv * BV + tl.arange(0, BV)
    st_off, b_dh = _state_start(dht, n, hv, HV, o_k, o_v, K, V, BV, USE_DHT, TRANS_STATE)
    for j in range(0, nt):
        ic = nt - 1 - j
        t0 = bos + ic * BT
        rows = t0 + o_t
        m = rows < eos
        if STORE_DHE:
            _store_slot(dhe, slot0 + ic, hv, HV, o_k, o_v, b_dh, K, V, DT, INTERPRET)
        last = tl.minimum(t0 + BT, eos) - 1
        g_last = tl.load(gc + last * (HV * K) + hv * K + o_k)
        if DECAYED:
            b_kd = tl.load(kd + rows[:, None] * (HV * K) + hv * K + o_k[None, :], mask=m[:, None], other=0.)
        else:
            b_gc = tl.load(gc + rows[:, None] * (HV * K) + hv * K + o_k[None, :], mask=m[:, None], other=0.)
            fac = tl.where(m[:, None], tl.exp(g_last[None, :] - b_gc), 0.)
            b_k = tl.load(k + rows[:, None] * SK + hk * K + o_k[None, :], mask=m[:, None], other=0.)
            b_kd = _rnd((b_k.to(tl.float32) * fac), DT, INTERPRET)
        b_do = tl.load(do + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None], other=0.)
        b_dvl = tl.load(dvl + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None],
                        other=0.).to(tl.float32)
        b_dd = b_dvl + _dot(b_kd, _rnd(b_dh, DT, INTERPRET), INTERPRET)
        b_dd = _rnd(b_dd, DT, INTERPRET)
        if STORE_DHE:
            tl.store(dd + rows[:, None] * (HV * V) + hv * V + o_v[None, :], b_dd, mask=m[:, None])
        if DECAYED:
            b_qt = tl.load(qg + rows[None, :] * (HV * K) + hv * K + o_k[:, None], mask=m[None, :], other=0.)
        else:
            b_qr = tl.load(q + rows[None, :] * SQ + hk * K + o_k[:, None], mask=m[None, :], other=0.)  # q^T
            b_gct = tl.load(gc + rows[None, :] * (HV * K) + hv * K + o_k[:, None], mask=m[None, :], other=0.)  # G^T
            b_qt = _rnd((b_qr.to(tl.float32) * tl.where(m[None, :], tl.exp(b_gct) * scale, 0.)), DT, INTERPRET)
        b_wt = tl.load(w + rows[None, :] * (HV * K) + hv * K + o_k[:, None], mask=m[None, :], other=0.)
        b_dh = b_dh * tl.exp(g_last)[:, None] + _dot(b_qt, b_do, INTERPRET) - _dot(b_wt, b_dd, INTERPRET)
    if STORE_DH0:
        tl.store(dh0 + st_off, b_dh)


@triton.jit(do_not_specialize=["H", "HV"])
def bwd_dense_kernel(q, k, v, vn, beta, do, dd, gc, A, h, dhe, se, table, dqs, dks, dgs, dgx, dv, dbs, dL, scale, SQ,
                     SK, SV, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """Per chunk, every backward product that is a plain matmul: through o's state term (dq), the state update
    (dk's state term, the chunk-end decay), w = A X and u = A Y (dX, dY: dk, dbeta, dv, dA), and dL = -A^T dA A^T
    (strictly lower, fp32) for bwd_intra_kernel, which adds the decay-weighted in-chunk products and finishes dq,
    dk, dbeta and dg. Writes dqs, dks (the partial dq, dk), dbs (dbeta's partial, fp32), dgs (this kernel's part of
    dG, fp32), dgx (the state term of dg, below), dv. The key dimensions go in BK-wide slices; dA adds dw X^T over
    them in one order.

    dg without cancellation (as gdn's): the state term of dk, k_i * dks_i of size exp(G_last - G_i), would appear at
    row i and summed on the last row of dG; it goes to dg directly as its exclusive prefix sum over rows (dgx: the
    term per row; bwd_dg_kernel reads it back shifted by one row)."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic, bos, eos = _chunk_doc(table, se, p, n)
    hk = hv // (HV // H)
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_v = tl.arange(0, V)
    t0 = bos + ic * BT
    rows = t0 + o_t
    m = rows < eos
    v_off = rows[:, None] * (HV * V) + hv * V + o_v[None, :]
    b_b = tl.load(beta + rows * HV + hv, mask=m, other=0.).to(tl.float32)
    # A^T is loaded transposed: no transposed matmul result feeds a product (triton 3.6 Hopper)
    b_at = tl.load(A + rows[None, :] * (HV * BT) + hv * BT + o_t[:, None], mask=m[None, :], other=0.)
    b_do = tl.load(do + v_off, mask=m[:, None], other=0.)
    b_vn = tl.load(vn + v_off, mask=m[:, None], other=0.)
    b_dd = tl.load(dd + v_off, mask=m[:, None], other=0.)
    last = tl.minimum(t0 + BT, eos) - 1
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_da = tl.zeros([BT, BT], dtype=tl.float32)
    for ks in range(0, K // BK):
        o_k = ks * BK + tl.arange(0, BK)
        k_off = rows[:, None] * (HV * K) + hv * K + o_k[None, :]
        st_t = (p.to(tl.int64) * HV + hv) * (K * V) + o_k[None, :] * V + o_v[:, None]  # [V, BK] view of a state
        b_g = tl.load(gc + tl.minimum(rows, eos - 1)[:, None] * (HV * K) + hv * K + o_k[None, :])
        eg = tl.exp(b_g)
        g_last = tl.load(gc + last * (HV * K) + hv * K + o_k)
        fac = tl.where(m[:, None], tl.exp(g_last[None, :] - b_g), 0.)
        b_q = tl.load(q + rows[:, None] * SQ + hk * K + o_k[None, :], mask=m[:, None], other=0.).to(tl.float32)
        b_k = tl.load(k + rows[:, None] * SK + hk * K + o_k[None, :], mask=m[:, None], other=0.).to(tl.float32)
        b_ht = tl.load(h + st_t)
        b_dhet = tl.load(dhe + st_t)
        b_dq = _dot(b_do, b_ht, INTERPRET) * (eg * scale)
        b_dk = _dot(b_vn, b_dhet, INTERPRET) * fac
        tl.store(dgx + k_off, b_dk * b_k, mask=m[:, None])
        b_dw = _rnd(-_dot(b_dd, b_ht, INTERPRET), DT, INTERPRET)
        bx = b_b[:, None] * eg
        b_x = _rnd(b_k * bx, DT, INTERPRET)
        b_da += _dot(b_dw, tl.trans(b_x), INTERPRET)  # dA [i, j], the k term
        b_dx = _dot(b_at, b_dw, INTERPRET)
        b_db += tl.sum(b_dx * b_k * eg, 1)
        b_dg = b_q * b_dq + b_dx * b_k * bx
        b_dk += b_dx * bx
        # the chunk-end decay exp(G_last) of the state: its dG lands on the last row
        hd = tl.sum(b_ht.to(tl.float32) * b_dhet.to(tl.float32), 0)
        b_dg += tl.where((o_t == (last - t0))[:, None], (tl.exp(g_last) * hd)[None, :], 0.)
        tl.store(dqs + k_off, _rnd(b_dq, dqs.dtype.element_ty, INTERPRET), mask=m[:, None])
        tl.store(dks + k_off, _rnd(b_dk, dks.dtype.element_ty, INTERPRET), mask=m[:, None])
        tl.store(dgs + k_off, b_dg, mask=m[:, None])
    b_v = tl.load(v + rows[:, None] * SV + hv * V + o_v[None, :], mask=m[:, None], other=0.).to(tl.float32)
    b_y = _rnd((b_v * b_b[:, None]), DT, INTERPRET)
    b_dy = _dot(b_at, b_dd, INTERPRET)
    tl.store(dv + v_off, _rnd((b_dy * b_b[:, None]), dv.dtype.element_ty, INTERPRET), mask=m[:, None])
    b_db += tl.sum(b_dy * b_v, 1)
    tl.store(dbs + rows * HV + hv, b_db, mask=m)
    b_da += _dot(b_dd, tl.trans(b_y), INTERPRET)  # the v term
    b_dl = -_dot(_rnd(_dot(b_at, _rnd(b_da, DT, INTERPRET), INTERPRET), DT, INTERPRET), b_at, INTERPRET)
    tl.store(dL + rows[:, None] * (HV * BT) + hv * BT + o_t[None, :],
             tl.where(o_t[:, None] > o_t[None, :], b_dl, 0.), mask=m[:, None])


@triton.jit(do_not_specialize=["TT", "H", "HV"])
def bwd_intra_kernel(q, k, beta, gc, dAqk, dL, se, table, dqs, dks, dq, dk, dbp, dGi, TT, SQ, SK, H, HV,
                     K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DIAG: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """Per chunk, BK-wide key slice and 16-row sub-block, the decay-weighted in-chunk products of the backward
    (module docstring), of M = dAqk (Aqk_ij = scale sum_d q_id k_jd Gam_ij,d, j <= i) and M = dL
    (L_ij = beta_i sum_d k_id k_jd Gam_ij,d, j < i):
        rows R_i = sum_j M_ij k_j Gam_ij (dq_i; beta_i R_i to dk_i, sum_d k_id R_id to dbeta_i)
        cols C_j = sum_i M_ij x_i Gam_ij, x = q (dAqk), beta k (dL) (dk_j)
    Writes dq, dk (per value head: bwd_dense_kernel's partials plus these), this slice's part of dbeta (dbp[slice],
    [K // BK + 1, T, HV]; TT: the rows of T) and dG = q R^qk + k (beta R^L) - k (C^qk + C^L) (dGi, fp32;
    bwd_dg_kernel scans it). The earlier sub-blocks go in one [16, 16] x [16, BK] product per sub-block and M with
    this sub-block's first row as the reference, the later ones likewise with its last row (`_intra_blocks`; only
    the document's sub-blocks); the diagonal sub-block in one 3xTF32 product per side and M with its row 8 as the
    reference where the decay about it is bounded (`_diag_refs`; DIAG: or the same factors on the FMA units, one row
    of the block at a time), otherwise (and always with DIAG_ELEMENTWISE) elementwise, one row at a time. The
    diagonal of dAqk (Gam = 1) goes to dq, dk elementwise and never into dG (its q * dq and k * dk terms cancel
    exactly). What does not depend on the key slice (the diagonal blocks of M) is loaded first (`_intra_slice` does
    the slice's work)."""
    NK: tl.constexpr = K // BK
    pid = tl.program_id(0)
    hv = tl.program_id(1)
    i = pid % 4
    ks = (pid // 4) % NK
    p = pid // (4 * NK)
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic, bos, eos = _chunk_doc(table, se, p, n)
    t0 = bos + ic * BT
    nr = tl.minimum(eos - t0, BT).to(tl.int32)  # the chunk's rows in the document
    r0 = i * 16
    if r0 >= nr:
        return
    hk = hv // (HV // H)
    o = tl.arange(0, 16)
    # one 64-bit base per tensor and 32-bit in-chunk offsets (a tile of 64-bit pointers costs twice the registers)
    qb = q + t0 * SQ + hk * K
    kb = k + t0 * SK + hk * K
    gcb = gc + t0 * (HV * K) + hv * K
    bb = beta + t0 * HV + hv
    mqb = dAqk + t0 * (HV * BT) + hv * BT
    mlb = dL + t0 * (HV * BT) + hv * BT
    r = r0 + o
    m = r < nr
    b_b = tl.load(bb + r * HV, mask=m, other=0.).to(tl.float32)
    # what does not depend on the key slice: the diagonal blocks of M (the diagonal of dAqk goes elementwise)
    mq = _mblk(mqb, nr, r0, r0, BT, HV * BT, False)
    ml = _mblk(mlb, nr, r0, r0, BT, HV * BT, False)
    mqt = _mblk(mqb, nr, r0, r0, BT, HV * BT, True)
    mlt = _mblk(mlb, nr, r0, r0, BT, HV * BT, True)
    # a one-trip loop: it keeps the slice's loads and products after these loads (straight-line code got them
    # interleaved and spilled, bench/NOTES.md kda v5.1)
    for ks1 in range(ks, ks + 1):
        _intra_slice(ks1, qb, kb, gcb, bb, mqb, mlb, dqs, dks, dq, dk, dbp, dGi, t0, hv, r0, nr, r, m, b_b, mq, ml,
                     mqt, mlt, TT, SQ, SK, HV, K, BT, BK, k.dtype.element_ty, DIAG, INTERPRET)


@triton.jit
def _intra_blocks(qb, kb, gcb, bb, mqb, mlb, r0, nr, gn, gl, o_k, SQ, SK, HV, K: tl.constexpr, BT: tl.constexpr,
                  BK: tl.constexpr, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """The off-diagonal part of bwd_intra_kernel's products for sub-block r0 in one key slice, one [16, 16] x
    [16, BK] product per other sub-block of the document and M: rows R^qk, R^L over each earlier sub-block c
    (M's block (r0, c) times k_c exp(G_r - G_c), r = this sub-block's first row, gn its G) and columns C^qk, C^L
    over each later one (M's block (c, r0) transposed times q_c, beta_c k_c times exp(G_c - G_l), l = this
    sub-block's last row, gl its G): every factor <= 1. The rows' factor exp(G_i - G_r) and the columns'
    exp(G_l - G_j) are the caller's. A later sub-block's rows past the document's end read 0."""
    o = tl.arange(0, 16)
    rq = tl.zeros([16, BK], dtype=tl.float32)
    rl = tl.zeros([16, BK], dtype=tl.float32)
    cq = tl.zeros([16, BK], dtype=tl.float32)
    cl = tl.zeros([16, BK], dtype=tl.float32)
    for c0 in range(0, r0, 16):
        kc = _rows(kb, nr, c0, SK, o_k, 16, False)
        kg = kc * tl.exp(gn[None, :] - _rows(gcb, nr, c0, HV * K, o_k, 16, True))
        rq += _tdot(_mblk(mqb, nr, r0, c0, BT, HV * BT, False), kg, DT, INTERPRET)
        rl += _tdot(_mblk(mlb, nr, r0, c0, BT, HV * BT, False), kg, DT, INTERPRET)
    for c0 in range(r0 + 16, nr, 16):
        rc = c0 + o
        mc = rc < nr
        qc = _rows(qb, nr, c0, SQ, o_k, 16, False)
        kc = _rows(kb, nr, c0, SK, o_k, 16, False)
        bc = tl.load(bb + rc * HV, mask=mc, other=0.).to(tl.float32)
        el = tl.where(mc[:, None], tl.exp(_rows(gcb, nr, c0, HV * K, o_k, 16, True) - gl[None, :]), 0.)
        cq += _tdot(_mblk(mqb, nr, c0, r0, BT, HV * BT, True), qc * el, DT, INTERPRET)
        cl += _tdot(_mblk(mlb, nr, c0, r0, BT, HV * BT, True), (bc[:, None] * kc) * el, DT, INTERPRET)
    return rq, rl, cq, cl


@triton.jit
def _diag_step(qb, kb, bb, gcb, mqb, mlb, r, m, r0, j, nr, o, o_k, SQ, SK, HV, K: tl.constexpr, BT: tl.constexpr):
    """What a step j of bwd_intra_kernel's diagonal loops reads: row j's q, k, beta (0 past the document's end) and
    G (its last row there), M's column j (dAqk, dL) and its row j."""
    rc = tl.minimum(r0 + j, nr - 1)
    ok = r0 + j < nr
    qj = tl.where(ok, tl.load(qb + rc * SQ + o_k).to(tl.float32), 0.)
    kj = tl.where(ok, tl.load(kb + rc * SK + o_k).to(tl.float32), 0.)
    bj = tl.where(ok, tl.load(bb + rc * HV).to(tl.float32), 0.)
    gj = tl.load(gcb + rc * (HV * K) + o_k)
    mq_c = tl.load(mqb + r * (HV * BT) + r0 + j, mask=m, other=0.)
    ml_c = tl.load(mlb + r * (HV * BT) + r0 + j, mask=m, other=0.)
    mq_r = tl.where(ok, tl.load(mqb + rc * (HV * BT) + r0 + o), 0.)
    ml_r = tl.where(ok, tl.load(mlb + rc * (HV * BT) + r0 + o), 0.)
    return qj, kj, bj, gj, mq_c, ml_c, mq_r, ml_r


@triton.jit
def _intra_slice(ks, qb, kb, gcb, bb, mqb, mlb, dqs, dks, dq, dk, dbp, dGi, t0, hv, r0, nr, r, m, b_b, mq, ml, mqt,
                 mlt, TT, SQ, SK, HV, K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, DT: tl.constexpr,
                 DIAG: tl.constexpr, INTERPRET: tl.constexpr):
    """bwd_intra_kernel's work on key slice ks (mq .. mlt: the sub-block's diagonal blocks of M; DT: the run's
    dtype)."""
    o = tl.arange(0, 16)
    o_k = ks * BK + tl.arange(0, BK)
    k_off = t0 * (HV * K) + hv * K + r[:, None] * (HV * K) + o_k[None, :]
    # what the end of the slice reads, issued first (its latency overlaps the products)
    p_dq = tl.load(dqs + k_off, mask=m[:, None], other=0.).to(tl.float32)
    p_dk = tl.load(dks + k_off, mask=m[:, None], other=0.).to(tl.float32)
    b_q = _rows(qb, nr, r0, SQ, o_k, 16, False)
    b_k = _rows(kb, nr, r0, SK, o_k, 16, False)
    b_g = _rows(gcb, nr, r0, HV * K, o_k, 16, True)
    gn = tl.load(gcb + r0 * (HV * K) + o_k)  # the earlier sub-blocks' reference: this one's first row
    gl = tl.load(gcb + tl.minimum(r0 + 15, nr - 1) * (HV * K) + o_k)  # the later ones': its last row
    rq, rl, cq, cl = _intra_blocks(qb, kb, gcb, bb, mqb, mlb, r0, nr, gn, gl, o_k, SQ, SK, HV, K, BT, BK, DT,
                                   INTERPRET)
    eq = tl.exp(b_g - gn[None, :])
    ek = tl.exp(gl[None, :] - b_g)
    rq *= eq
    rl *= eq
    cq *= ek
    cl *= ek
    # the diagonal sub-block, both paths without a branch (as in fwd_grams_kernel): about its row 8 where the span
    # allows it (rows j < i for R, i > j for C), on the tensor cores or (DIAG_FMA) the FMA units, elementwise where it
    # does not (and always with DIAG_ELEMENTWISE)
    if DIAG == DIAG_ELEMENTWISE:
        steps = 16
    else:
        gm, diag_ok = _diag_refs(gcb, nr, r0, HV * K, o_k, gn)
        em = tl.exp(tl.minimum(b_g - gm[None, :], DIAG_SPAN))
        en = tl.exp(tl.minimum(gm[None, :] - b_g, DIAG_SPAN))
        if DIAG == DIAG_TENSOR_CORES:
            low = o[:, None] > o[None, :]
            kd = b_k * en
            rq += tl.where(diag_ok, _xdot(tl.where(low, mq, 0.), kd, DT, INTERPRET) * em, 0.)
            rl += tl.where(diag_ok, _xdot(tl.where(low, ml, 0.), kd, DT, INTERPRET) * em, 0.)
            up = o[:, None] < o[None, :]  # transposed: entry (j, i) of M^T, i > j
            cq += tl.where(diag_ok, _xdot(tl.where(up, mqt, 0.), b_q * em, DT, INTERPRET) * en, 0.)
            cl += tl.where(diag_ok, _xdot(tl.where(up, mlt, 0.), (b_b[:, None] * b_k) * em, DT, INTERPRET) * en, 0.)
        else:  # the same factors, row j's column of M for the rows and its row for the columns, one [BK] exp each
            for j in range(0, tl.where(diag_ok, 16, 0)):
                qj, kj, bj, gj, mq_c, ml_c, mq_r, ml_r = _diag_step(qb, kb, bb, gcb, mqb, mlb, r, m, r0, j, nr, o,
                                                                    o_k, SQ, SK, HV, K, BT)
                kf = kj * tl.exp(tl.minimum(gm - gj, DIAG_SPAN))  # k_j exp(G_m - G_j)
                ef = tl.exp(tl.minimum(gj - gm, DIAG_SPAN))  # exp(G_j - G_m)
                below = (o > j)[:, None]
                above = (o < j)[:, None]
                # masked after the products: a non-finite row j must not reach the other side
                rq += tl.where(below, mq_c[:, None] * kf[None, :] * em, 0.)
                rl += tl.where(below, ml_c[:, None] * kf[None, :] * em, 0.)
                cq += tl.where(above, mq_r[:, None] * (qj * ef)[None, :] * en, 0.)
                cl += tl.where(above, ml_r[:, None] * (bj * kj * ef)[None, :] * en, 0.)
        steps = tl.where(diag_ok, 0, 16)
    # elementwise (exact for any decay): row j's column of M for the rows, its row for the columns;
    # e_ij = exp(-|G_i - G_j|) is the factor of the pair on either side of j
    for j in range(0, steps):
        qj, kj, bj, gj, mq_c, ml_c, mq_r, ml_r = _diag_step(qb, kb, bb, gcb, mqb, mlb, r, m, r0, j, nr, o, o_k, SQ,
                                                            SK, HV, K, BT)
        dlt = b_g - gj[None, :]
        below = (o > j)[:, None]
        above = (o < j)[:, None]
        e = tl.exp(tl.where(below, dlt, -dlt))
        # masked after the products: a non-finite row j must not reach the other side
        rq += tl.where(below, mq_c[:, None] * kj[None, :] * e, 0.)
        rl += tl.where(below, ml_c[:, None] * kj[None, :] * e, 0.)
        cq += tl.where(above, mq_r[:, None] * qj[None, :] * e, 0.)
        cl += tl.where(above, ml_r[:, None] * (bj * kj)[None, :] * e, 0.)
    md = tl.sum(tl.where(o[:, None] == o[None, :], mq, 0.), 1)
    rl_b = rl * b_b[:, None]
    tl.store(dq + k_off, _rnd(rq + md[:, None] * b_k + p_dq, dq.dtype.element_ty, INTERPRET), mask=m[:, None])
    tl.store(dk + k_off, _rnd(rl_b + cq + cl + md[:, None] * b_q + p_dk, dk.dtype.element_ty, INTERPRET),
             mask=m[:, None])
    tl.store(dbp + ks * (TT * HV) + (t0 + r) * HV + hv, tl.sum(b_k * rl, 1), mask=m)
    tl.store(dGi + k_off, b_q * rq + b_k * (rl_b - cq - cl), mask=m[:, None])


@triton.jit(do_not_specialize=["TT", "H", "HV"])
def bwd_dg_kernel(g, A_log, dt_bias, dGi, dGd, dgx, dbp, se, table, dbeta, dg, part, lower_bound, SG, TT, H, HV,
                  K: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, NB: tl.constexpr, GATE: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """Per chunk: dg = the reverse in-chunk scan of dG (bwd_intra_kernel's dGi plus bwd_dense_kernel's dGd) plus the
    exclusive prefix of the state term dgx, then through the in-kernel gate (GATE): part [P, HV * K + HV] gets this
    chunk's sums over its rows of ddt_bias (column hv * K + d) and of dA_log's terms (column HV * K + hv); unused
    slots write zeros, so a fixed-order column sum over the P slots gives the parameters' gradients. dbeta = the sum
    of its NB partials (dbp [NB, T, HV]) in slot order. The key dimensions go in BK-wide slices; g's rows are SG
    elements apart (fwd_gate_kernel)."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(table + 2 * p)
    prow = p.to(tl.int64) * (HV * K + HV)
    if n < 0:
        if GATE != 0:
            o_kz = tl.arange(0, K)
            tl.store(part + prow + hv * K + o_kz, tl.zeros([K], dtype=tl.float32))
            tl.store(part + prow + HV * K + hv, 0.)
        return
    ic, bos, eos = _chunk_doc(table, se, p, n)
    o_t = tl.arange(0, BT)
    rows = bos + ic * BT + o_t
    m = rows < eos
    ta_sum = 0.
    for ks in range(0, K // BK):
        o_k = ks * BK + tl.arange(0, BK)
        k_off = rows[:, None] * (HV * K) + hv * K + o_k[None, :]
        b_dG = tl.load(dGi + k_off, mask=m[:, None], other=0.) + tl.load(dGd + k_off, mask=m[:, None], other=0.)
        # a reverse scan (not total - cumsum + x: that leaves every token an error of eps times the chunk's total,
        # one error shared by all of them, which the sums over tokens of ddt_bias / dA_log add up)
        b_dg = tl.cumsum(b_dG, axis=0, reverse=True)
        # + the state term's exclusive prefix sum: row t adds dgx's rows < t (the scan of the rows shifted by one)
        b_dg += tl.cumsum(tl.load(dgx + k_off - HV * K, mask=(m & (o_t > 0))[:, None], other=0.), axis=0)
        if GATE != 0:
            a_log, bias = _gate_params(A_log, dt_bias, hv, o_k, K, GATE)
            x = tl.load(g + rows[:, None] * SG + hv * K + o_k[None, :], mask=m[:, None], other=0.).to(tl.float32)
            x += bias[None, :]
            ea = tl.exp(a_log)
            if GATE == 1:
                ta = b_dg * (-ea * _softplus(x))  # d g_eff / d A_log = g_eff
                b_dg = b_dg * (-ea * tl.sigmoid(x))
            else:
                s = tl.sigmoid(ea * x)
                b_dg = b_dg * (lower_bound * s * (1. - s) * ea)
                ta = b_dg * x
            b_dg = tl.where(m[:, None], b_dg, 0.)
            tl.store(part + prow + hv * K + o_k, tl.sum(b_dg, 0))
            ta_sum += tl.sum(tl.sum(tl.where(m[:, None], ta, 0.), 1), 0)
        tl.store(dg + k_off, _rnd(b_dg, dg.dtype.element_ty, INTERPRET), mask=m[:, None])
    if GATE != 0:
        tl.store(part + prow + HV * K + hv, ta_sum)
    db = tl.zeros([BT], dtype=tl.float32)
    for s in range(0, NB):
        db += tl.load(dbp + s * (TT * HV) + rows * HV + hv, mask=m, other=0.)
    tl.store(dbeta + rows * HV + hv, db, mask=m)


@triton.jit(do_not_specialize=["P", "N1", "N2"])
def gate_sum_kernel(part, out1, out2, P, N1, N2, BP: tl.constexpr, BN: tl.constexpr):
    """Columns of part [P, N1 + N2] summed over its P rows in one fixed order (BP rows per step, then one fixed
    tree): columns [0, N1) into out1, [N1, N1 + N2) into out2 (ddt_bias and dA_log)."""
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    N = N1 + N2
    cm = cols < N
    acc = tl.zeros([BP, BN], dtype=tl.float32)
    for p0 in range(0, P, BP):
        r = p0 + tl.arange(0, BP)
        acc += tl.load(part + r.to(tl.int64)[:, None] * N + cols[None, :], mask=(r < P)[:, None] & cm[None, :],
                       other=0.)
    tot = tl.sum(acc, 0)
    tl.store(out1 + cols, tot.to(out1.dtype.element_ty), mask=cols < N1)
    tl.store(out2 + tl.maximum(cols - N1, 0), tot.to(out2.dtype.element_ty), mask=cm & (cols >= N1))
