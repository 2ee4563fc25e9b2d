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

The launch sequence and tiling are gdn's one to one (prep, w/u, state recurrence, o; in-chunk d(dlt), reverse state
recurrence, dq / dk / dw, WY backward, per-key-head sums), with the gate a vector per key dimension: gc is
[T, HV, K], the prep also writes Aqk (a scalar gate lets gdn's o kernel form it from one q k^T product; a vector
gate does not), dG is a [BT, K] tile, and the gate preprocessing (in-kernel gate, its backward to the raw g, A_log
and dt_bias) rides on the prep and WY kernels; a last launch sums the per-chunk dA_log / ddt_bias partials in a
fixed order. `_dot`, `_rnd`, the 16 x 16 inverse, the L2 norm and the per-key-head sum are the shared core's
(`_impl/delta_rule/common.py`).

Numerics of the in-chunk decay products. Gam differs per key dimension, so sum_d a_id b_jd Gam_ij,d is no plain
matmul, and exp(G_i) and exp(-G_j) alone overflow fp32 once a chunk's cumulative decay passes -88.7 (a decay of -3
per token gets there in 30 tokens). Choice: an exact factorization by halving, the same for off-diagonal and
diagonal 16 x 16 blocks. Split the chunk's 64 rows into halves, quarters, ... down to single rows (6 levels): every
pair j < i lies in exactly one pair of sibling blocks (j in the upper, i in the lower sibling), and the lower
sibling's first row r lies between them, so exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j) with G_j >= G_r >= G_i
for a decay (g <= 0): both factors are exps of non-positive numbers, whatever the decay, so no bound on the gate is
needed (fla's safe_gate path leans on lower_bound >= -5 to put a reference inside a 16-row block; a pre-gated g
promises no such bound). A factor that underflows to 0 stands for a true product smaller still. Each level is one
masked [BT, BT] product (`_gated_grams`, `_gated_pair`); i == j has Gam = 1. The products run at tf32 on rounded fp32
operands (fla's precision for them; exact fp32 when the run itself is fp32). `safe_gate` therefore changes no
result here. The prep takes L's 16 x 16 blocks for gdn's block inverse out of the [BT, BT] tile by reshape /
permute / split and puts A back by join (no memory round trip).
Rows past a document's end read the document's last G (the prep's cumsum of g = 0, and clamped row indices
elsewhere): no exp over a pair of rows has a positive argument, so 0 * inf never makes a NaN.
A log decay below G_FLOOR (-128) reads as G_FLOOR, as in gdn (exp(-128) is 0 in fp32; g = -inf gives the exact,
finite result).

Layouts (rows are tokens of the packed sequence): q, k [T, H, K]; v [T, HV, V]; g (log decay, or the raw gate)
[T, HV, K]; beta [T, HV] fp32; gc [T, HV, K] fp32; A, Aqk [T, HV, BT]; w [T, HV, K]; u, dlt [T, HV, V]; chunk
states h [P, HV, K, V] with one slot per chunk (slot = bos[n] // BT + n + chunk index); `table`, `se` from
`_runtime.varlen.chunk_table` (every kernel reads the clamped `se`, never cu_seqlens). Initial / final states
[N, HV, K, V], or [N, HV, V, K] with TRANS_STATE (read and written through transposed offsets, no tl.trans).

No kernel feeds a transposed `tl.dot` result into another `tl.dot` (triton 3.4 - 3.7.0 miscompile that on Hopper):
transposed operands are loaded transposed or are elementwise products; the one transposed product (the column sums
of `_gated_pair`, (x^T M)^T) only feeds adds. No atomics: every sum has one fixed order, so the results repeat bit
for bit.

Interpreter (CPU tests): bf16 arithmetic is broken there, so elementwise math runs on fp32 values, `_dot` converts
its bf16 operands to fp32, `_rnd` rounds to nearest even, and `_tdot` multiplies the tf32-rounded operands exactly
(the GPU's tensor cores read the same rounded values).
"""
import triton
import triton.language as tl

from ..delta_rule import common
from ..delta_rule.common import (
    _causal_store,
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


@triton.jit
def _tdot(a, b, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """a @ b of fp32 decay-weighted operands at tf32 in a bf16 run (fla's precision for these products), exact fp32
    when the run itself is fp32 (DT: the math tests). The operands are rounded to tf32 (nearest even) here: the
    tensor cores ignore the 13 low mantissa bits, a truncation whose bias toward zero adds up in the sums over tokens
    (dA_log, ddt_bias: measured 1.2e-2 -> 6e-3 of their terms' scale). The interpreter multiplies the same rounded
    values exactly (inline: a nested jit call costs it a re-patch of triton.language)."""
    if DT == tl.float32:
        r = tl.dot(a, b, input_precision="ieee")
    else:
        ua = a.to(tl.uint32, bitcast=True)
        ub = b.to(tl.uint32, bitcast=True)
        ra = (((ua + 0xFFF + ((ua >> 13) & 1)) >> 13) << 13).to(tl.float32, bitcast=True)
        rb = (((ub + 0xFFF + ((ub >> 13) & 1)) >> 13) << 13).to(tl.float32, bitcast=True)
        if INTERPRET:
            r = tl.dot(ra, rb, input_precision="ieee")
        else:
            r = tl.dot(ra, rb, input_precision="tf32")
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


# ----------------------------------------------------------------------------------------------------------------
# the in-chunk decay-weighted products, by halving (module docstring)
@triton.jit
def _level(o_t, G, gc, gcol, GC_RS, o_k, t0, eos, S: tl.constexpr):
    """One halving level of a 64-row chunk: (lower, e, pair). lower [BT]: the row is in the lower half of its 2S
    block; e [BT, BK]: exp(G_i - G_r) for lower rows, exp(G_r - G_j) for upper rows, r the lower half's first row
    (both arguments <= 0 for a decay); pair [BT, BT]: (i, j) is a lower row and an upper row of one 2S block."""
    lower = ((o_t // S) % 2) == 1
    ref = (o_t // (2 * S)) * (2 * S) + S
    # one 64-bit base per chunk and 32-bit in-chunk offsets: a [BT, BK] tile of 64-bit pointers costs twice the
    # registers
    rr = tl.minimum(ref, (eos - 1 - t0).to(tl.int32))
    gref = tl.load((gc + t0 * GC_RS + gcol) + rr[:, None] * GC_RS + o_k[None, :])
    e = tl.exp(tl.where(lower[:, None], G - gref, gref - G))
    pair = (o_t[:, None] // (2 * S) == o_t[None, :] // (2 * S)) & lower[:, None] & (((o_t // S) % 2) == 0)[None, :]
    return lower, e, pair


@triton.jit
def _gated_grams(q, k, G, gc, gcol, GC_RS, o_k, t0, eos, BT: tl.constexpr, DT: tl.constexpr,
                 INTERPRET: tl.constexpr):
    """(sq, sk) [BT, BT]: sq_ij = sum_d q_id k_jd Gam_ij,d (j <= i), sk the same with k_i (j < i)."""
    tl.static_assert(BT == 64)
    o_t = tl.arange(0, BT)
    sq = tl.zeros([BT, BT], dtype=tl.float32)
    sk = tl.zeros([BT, BT], dtype=tl.float32)
    for lvl in tl.static_range(6):
        lower, e, pair = _level(o_t, G, gc, gcol, GC_RS, o_k, t0, eos, 32 >> lvl)
        ea = tl.where(lower[:, None], e, 0.)
        kbt = tl.trans(tl.where(lower[:, None], 0., k * e))
        sq += tl.where(pair, _tdot(q * ea, kbt, DT, INTERPRET), 0.)
        sk += tl.where(pair, _tdot(k * ea, kbt, DT, INTERPRET), 0.)
    sq += tl.where(o_t[:, None] == o_t[None, :], tl.sum(q * k, 1)[:, None], 0.)
    return sq, sk


@triton.jit
def _gated_pair(M, xr, xc, G, gc, gcol, GC_RS, o_k, t0, eos, BT: tl.constexpr, BK: tl.constexpr,
                INCL: tl.constexpr, ROWS: tl.constexpr, COLS: tl.constexpr, DT: tl.constexpr,
                INTERPRET: tl.constexpr):
    """The two decay-weighted products of an in-chunk matrix M [BT, BT] (lower triangular: j <= i with INCL, else
    j < i; entries above are never read), per key dimension d of a BK-wide slice:

        R_i = sum_j M_ij xr_j exp(G_i - G_j)   (ROWS)          C_j = sum_i M_ij xc_i exp(G_i - G_j)   (COLS)

    xr, xc [BT, BK] are the operand tiles; G [BT, BK] the chunk's G (padding rows: the last G); gc (row stride GC_RS,
    column offset gcol) its rows in memory."""
    tl.static_assert(BT == 64)
    o_t = tl.arange(0, BT)
    R = tl.zeros([BT, BK], dtype=tl.float32)
    C = tl.zeros([BT, BK], dtype=tl.float32)
    for lvl in tl.static_range(6):
        lower, e, pair = _level(o_t, G, gc, gcol, GC_RS, o_k, t0, eos, 32 >> lvl)
        ms = tl.where(pair, M, 0.)
        if ROWS:
            xu = tl.where(lower[:, None], 0., xr * e)
            R += tl.where(lower[:, None], _tdot(ms, xu, DT, INTERPRET) * e, 0.)
        if COLS:
            xl = tl.where(lower[:, None], xc * e, 0.)
            # (xl^T M)^T: the transposed product feeds only adds, never another matmul
            C += tl.where(lower[:, None], 0., tl.trans(_tdot(tl.trans(xl), ms, DT, INTERPRET)) * e)
    if INCL:
        md = tl.sum(tl.where(o_t[:, None] == o_t[None, :], M, 0.), 1)
        R += md[:, None] * xr
        C += md[:, None] * xc
    return R, C


@triton.jit
def _col4(c):
    """c [16, 16, 2, 2] (block-row index a = 2 a1 + a0 in the last two axes, (a1, a0)) -> its four [16, 16] blocks."""
    e0, e1 = tl.split(c)
    x0, x2 = tl.split(e0)
    x1, x3 = tl.split(e1)
    return x0, x1, x2, x3


@triton.jit
def _join4(x0, x1, x2, x3):
    """The inverse of _col4."""
    return tl.join(tl.join(x0, x2), tl.join(x1, x3))


# ----------------------------------------------------------------------------------------------------------------
# forward
@triton.jit(do_not_specialize=["H", "HV"])
def fwd_prep_kernel(q, k, g, A_log, dt_bias, beta, se, table, gc, A, Aqk, scale, lower_bound, H, HV, K: tl.constexpr,
                    BT: tl.constexpr, BK: tl.constexpr, GATE: tl.constexpr, INTERPRET: tl.constexpr):
    """Per chunk: the gate (GATE), gc = in-chunk cumsum of the log decay; Aqk; A = (I + L)^-1 from L's 16 x 16
    blocks (gdn's block inverse), taken out of the [BT, BT] tile by reshape / permute / split (no memory round trip)
    and put back by join. The key dimensions go in BK-wide slices (the cumsum is per column, the grams add up over
    the slices in one order): one slice's [BT, BK] tiles are live at a time, not the whole [BT, K] set."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic = tl.load(table + 2 * p + 1).to(tl.int64)
    bos = tl.load(se + 2 * n).to(tl.int64)
    eos = tl.load(se + 2 * n + 1).to(tl.int64)
    hk = hv // (HV // H)
    DT = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    t0 = bos + ic * BT
    rows = t0 + o_t
    m = rows < eos
    sq = tl.zeros([BT, BT], dtype=tl.float32)
    sk = tl.zeros([BT, BT], dtype=tl.float32)
    for ks in range(0, K // BK):
        o_k = ks * BK + tl.arange(0, BK)
        qk_off = rows[:, None] * (H * K) + hk * K + o_k[None, :]
        g_off = rows[:, None] * (HV * K) + hv * K + o_k[None, :]
        b_q = tl.load(q + qk_off, mask=m[:, None], other=0.).to(tl.float32)
        b_k = tl.load(k + qk_off, mask=m[:, None], other=0.).to(tl.float32)
        b_g = tl.load(g + g_off, mask=m[:, None], other=0.).to(tl.float32)
        if GATE != 0:
            a_log, bias = _gate_params(A_log, dt_bias, hv, o_k, K, GATE)
            b_g = _gate(b_g + bias[None, :], a_log, lower_bound, GATE)
        # padding rows (g = 0) carry the chunk's last G: no exp below sees a positive difference
        b_g = tl.where(m[:, None], tl.where(b_g < G_FLOOR, G_FLOOR, b_g), 0.)
        b_gc = tl.cumsum(b_g, axis=0)
        tl.store(gc + g_off, b_gc, mask=m[:, None])
        tl.debug_barrier()  # the halving levels read their reference rows of gc back
        s_q, s_k = _gated_grams(b_q, b_k, b_gc, gc, hv * K, HV * K, o_k, t0, eos, BT, DT, INTERPRET)
        sq += s_q
        sk += s_k
    b_b = tl.load(beta + rows * HV + hv, mask=m, other=0.).to(tl.float32)
    a_off = rows[:, None] * (HV * BT) + hv * BT + o_t[None, :]
    tl.store(Aqk + a_off, _rnd(sq * scale, Aqk.dtype.element_ty, INTERPRET), mask=m[:, None])
    # a non-finite entry of L (row i: tokens <= i) would spread to earlier rows of A through the block products'
    # zeros: A from L's finite rows, and A's rows from L's first non-finite row on are NaN (`_finite_rows`)
    b_l, f = _finite_rows(sk * b_b[:, None], BT, 0)
    blk = tl.reshape(tl.permute(tl.reshape(b_l, [4, 16, 4, 16]), (1, 3, 0, 2)), [16, 16, 2, 2, 2, 2])
    c0, c1 = tl.split(blk)  # the block-column index b = 2 b1 + b0: b0 = 0, 1
    c00, c10 = tl.split(c0)  # b = 0, 2
    c01, c11 = tl.split(c1)  # b = 1, 3
    L00, L10, L20, L30 = _col4(c00)
    _x01, L11, L21, L31 = _col4(c01)
    _x02, _x12, L22, L32 = _col4(c10)
    _x03, _x13, _x23, L33 = _col4(c11)

    A00 = _inv_unit_lower(L00)
    A11 = _inv_unit_lower(L11)
    A22 = _inv_unit_lower(L22)
    A33 = _inv_unit_lower(L33)
    A10 = -_dot32(_dot32(A11, L10), A00)
    A21 = -_dot32(_dot32(A22, L21), A11)
    A32 = -_dot32(_dot32(A33, L32), A22)
    A20 = -_dot32(A22, _dot32(L20, A00) + _dot32(L21, A10))
    A31 = -_dot32(A33, _dot32(L31, A11) + _dot32(L32, A21))
    A30 = -_dot32(A33, _dot32(L30, A00) + _dot32(L31, A10) + _dot32(L32, A20))

    z = tl.zeros([16, 16], dtype=tl.float32)
    cols = tl.join(tl.join(_join4(A00, A10, A20, A30), _join4(z, z, A22, A32)),  # block columns 0 and 2
                   tl.join(_join4(z, A11, A21, A31), _join4(z, z, z, A33)))  # 1 and 3
    full = tl.reshape(tl.permute(tl.reshape(cols, [16, 16, 4, 4]), (2, 0, 3, 1)), [BT, BT])
    if f < BT:
        full = _nan_rows(full, f, 0)
    tl.store(A + a_off, _rnd(full, A.dtype.element_ty, INTERPRET), mask=m[:, None])


@triton.jit(do_not_specialize=["H", "HV"])
def fwd_wu_kernel(k, v, beta, gc, A, se, table, w, u, H, HV, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, INTERPRET: tl.constexpr):
    """w = A (beta exp(G) * k), u = A (beta v) per chunk."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic = tl.load(table + 2 * p + 1).to(tl.int64)
    bos = tl.load(se + 2 * n).to(tl.int64)
    eos = tl.load(se + 2 * n + 1).to(tl.int64)
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
    b_k = tl.load(k + rows[:, None] * (H * K) + hk * K + o_k[None, :], mask=m[:, None], other=0.).to(tl.float32)
    # A is lower triangular: a non-finite row of X or Y is zeroed for the product, and the rows of w / u from it on
    # are NaN (`_causal_store`)
    b_x = b_k * (b_b[:, None] * tl.exp(b_gc))
    _causal_store(b_A, b_x, w, rows, m, hv, HV, o_k, K, BT, DT, INTERPRET)
    b_v = tl.load(v + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None], other=0.).to(tl.float32)
    _causal_store(b_A, b_v * b_b[:, None], u, rows, m, hv, HV, o_v, V, BT, DT, INTERPRET)


@triton.jit(do_not_specialize=["H", "HV"])
def fwd_h_kernel(k, w, u, gc, se, h0, h, vn, ht, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, TRANS_STATE: tl.constexpr,
                 STORE_H: tl.constexpr, VU: tl.constexpr, INTERPRET: tl.constexpr):
    """The inter-chunk state recurrence of one sequence and value head (a BV-wide slice of V). STORE_H off: only
    the final state (context parallelism's extra pass). u holds the first VU of the V columns (the rest read 0)."""
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
        b_gct = tl.load(gc + rows[None, :] * (HV * K) + hv * K + o_k[:, None], mask=m[None, :], other=0.)  # G^T
        fac = tl.where(m[None, :], tl.exp(g_last[:, None] - b_gct), 0.)
        b_kt = tl.load(k + rows[None, :] * (H * K) + hk * K + o_k[:, None], mask=m[None, :], other=0.)
        b_kt = _rnd((b_kt.to(tl.float32) * fac), DT, INTERPRET)
        b_h = b_h * tl.exp(g_last)[:, None] + _dot(b_kt, b_vn, INTERPRET)
    if STORE_HT:
        tl.store(ht + st_off, b_h)


@triton.jit(do_not_specialize=["H", "HV"])
def fwd_o_kernel(q, gc, Aqk, vn, h, se, table, o, scale, H, HV, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, INTERPRET: tl.constexpr):
    """o = scale (q * exp(G)) h + Aqk dlt per chunk."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic = tl.load(table + 2 * p + 1).to(tl.int64)
    bos = tl.load(se + 2 * n).to(tl.int64)
    eos = tl.load(se + 2 * n + 1).to(tl.int64)
    hk = hv // (HV // H)
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = tl.arange(0, V)
    rows = bos + ic * BT + o_t
    m = rows < eos
    b_q = tl.load(q + rows[:, None] * (H * K) + hk * K + o_k[None, :], mask=m[:, None], other=0.)
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
def bwd_dvl_kernel(Aqk, do, se, table, dvl, H, HV, V: tl.constexpr, BT: tl.constexpr, INTERPRET: tl.constexpr):
    """The in-chunk part of d(dlt): Aqk^T do (Aqk loaded transposed)."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic = tl.load(table + 2 * p + 1).to(tl.int64)
    bos = tl.load(se + 2 * n).to(tl.int64)
    eos = tl.load(se + 2 * n + 1).to(tl.int64)
    o_t = tl.arange(0, BT)
    o_v = tl.arange(0, V)
    rows = bos + ic * BT + o_t
    m = rows < eos
    b_at = tl.load(Aqk + rows[None, :] * (HV * BT) + hv * BT + o_t[:, None], mask=m[None, :], other=0.)  # [j, i]
    b_do = tl.load(do + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None], other=0.)
    b_dv = _dot(b_at, b_do, INTERPRET)
    tl.store(dvl + rows[:, None] * (HV * V) + hv * V + o_v[None, :], _rnd(b_dv, dvl.dtype.element_ty, INTERPRET),
             mask=m[:, None])


@triton.jit(do_not_specialize=["H", "HV"])
def bwd_dh_kernel(q, k, w, do, dvl, gc, se, dht, dh0, dhe, dd, scale, H, HV, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                  TRANS_STATE: tl.constexpr, INTERPRET: tl.constexpr):
    """Reverse state recurrence: dhe[slot] = d(state at the chunk end); dd = full d(dlt) (dvl, its in-chunk part
    from bwd_dvl_kernel, plus the state's); dh0."""
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
        _store_slot(dhe, slot0 + ic, hv, HV, o_k, o_v, b_dh, K, V, DT, INTERPRET)
        last = tl.minimum(t0 + BT, eos) - 1
        g_last = tl.load(gc + last * (HV * K) + hv * K + o_k)
        b_gc = tl.load(gc + rows[:, None] * (HV * K) + hv * K + o_k[None, :], mask=m[:, None], other=0.)
        fac = tl.where(m[:, None], tl.exp(g_last[None, :] - b_gc), 0.)
        b_k = tl.load(k + rows[:, None] * (H * K) + hk * K + o_k[None, :], mask=m[:, None], other=0.)
        b_kd = _rnd((b_k.to(tl.float32) * fac), DT, INTERPRET)
        b_do = tl.load(do + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None], other=0.)
        b_dvl = tl.load(dvl + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None],
                        other=0.).to(tl.float32)
        b_dd = b_dvl + _dot(b_kd, _rnd(b_dh, DT, INTERPRET), INTERPRET)
        b_dd = _rnd(b_dd, DT, INTERPRET)
        tl.store(dd + rows[:, None] * (HV * V) + hv * V + o_v[None, :], b_dd, mask=m[:, None])
        b_qr = tl.load(q + rows[None, :] * (H * K) + hk * K + o_k[:, None], mask=m[None, :], other=0.)  # q^T
        b_gct = tl.load(gc + rows[None, :] * (HV * K) + hv * K + o_k[:, None], mask=m[None, :], other=0.)  # G^T
        b_qt = _rnd((b_qr.to(tl.float32) * tl.where(m[None, :], tl.exp(b_gct) * scale, 0.)), DT, INTERPRET)
        b_wt = tl.load(w + rows[None, :] * (HV * K) + hv * K + o_k[:, None], mask=m[None, :], other=0.)
        b_dh = b_dh * tl.exp(g_last)[:, None] + _dot(b_qt, b_do, INTERPRET) - _dot(b_wt, b_dd, INTERPRET)
    if STORE_DH0:
        tl.store(dh0 + st_off, b_dh)


@triton.jit(do_not_specialize=["H", "HV"])
def bwd_dqkw_kernel(q, k, vn, do, dd, gc, h, dhe, se, table, dq, dk, dw, dgp, dgx, scale, H, HV, K: tl.constexpr,
                    V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PHASE: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Per chunk and BK-wide slice of K: dq, dk (through o, Aqk and the state update), dw = -dd h^T and the slice's
    part of dG (per value head and key dimension). PHASE 0 does all; PHASE 1 only dq, dw; PHASE 2 only dk, adding
    its dG to what PHASE 1 wrote (two launches, fewer live tiles each; each launch may use its own BK). dgx gets the
    state term of dg itself (not of dG), added by the WY backward after its reverse scan.

    dg without cancellation (as gdn's bwd_dqkw_kernel): each row's own (i = j) o term would appear in q * dq and in
    k * dk, and the state term of dk (k_i * dks_i, of size exp(G_last - G_i)) at row i and summed on the last row;
    their rounding residue would be all of a strongly decayed dg. So dq / dk take the diagonal as an elementwise term
    outside dG, and the state term goes to dg directly as its exclusive prefix sum over rows: dgx gets the term per
    row, the WY backward sums the rows before each (a scan of the row-shifted terms: no difference of large sums)."""
    pid = tl.program_id(0)
    hv = tl.program_id(1)
    p = pid // (K // BK)
    ik = pid % (K // BK)
    n = tl.load(table + 2 * p)
    if n < 0:
        return
    ic = tl.load(table + 2 * p + 1).to(tl.int64)
    bos = tl.load(se + 2 * n).to(tl.int64)
    eos = tl.load(se + 2 * n + 1).to(tl.int64)
    hk = hv // (HV // H)
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = ik * BK + tl.arange(0, BK)
    o_v = tl.arange(0, V)
    t0 = bos + ic * BT
    rows = t0 + o_t
    m = rows < eos
    qk_off = rows[:, None] * (H * K) + hk * K + o_k[None, :]
    v_off = rows[:, None] * (HV * V) + hv * V + o_v[None, :]
    vt_off = rows[None, :] * (HV * V) + hv * V + o_v[:, None]
    st_t = (p.to(tl.int64) * HV + hv) * (K * V) + o_k[None, :] * V + o_v[:, None]  # [V, BK] view of a state
    out_k = rows[:, None] * (HV * K) + hv * K + o_k[None, :]
    b_g = tl.load(gc + tl.minimum(rows, eos - 1)[:, None] * (HV * K) + hv * K + o_k[None, :])
    b_q = tl.load(q + qk_off, mask=m[:, None], other=0.).to(tl.float32)
    b_k = tl.load(k + qk_off, mask=m[:, None], other=0.).to(tl.float32)
    b_do = tl.load(do + v_off, mask=m[:, None], other=0.)
    # dAqk = do dlt^T (Aqk holds the scale): the in-chunk matrix of both decay-weighted products
    b_m = _dot(b_do, tl.load(vn + vt_off, mask=m[None, :], other=0.), INTERPRET) * scale
    md = tl.sum(tl.where(o_t[:, None] == o_t[None, :], b_m, 0.), 1)  # the diagonal (Gam_ii = 1)
    b_dg = tl.zeros([BT, BK], dtype=tl.float32)
    if PHASE != 2:
        b_ht = tl.load(h + st_t)
        b_dq = _dot(b_do, b_ht, INTERPRET) * (tl.exp(b_g) * scale)
        b_dd = tl.load(dd + v_off, mask=m[:, None], other=0.)
        b_dw = -_dot(b_dd, b_ht, INTERPRET)
        tl.store(dw + out_k, _rnd(b_dw, dw.dtype.element_ty, INTERPRET), mask=m[:, None])
        r_q, _c = _gated_pair(b_m, b_k, b_q, b_g, gc, hv * K, HV * K, o_k, t0, eos, BT, BK, False, True, False, DT,
                              INTERPRET)
        b_dq += r_q
        b_dg += b_dq * b_q
        b_dq += md[:, None] * b_k
        tl.store(dq + out_k, _rnd(b_dq, dq.dtype.element_ty, INTERPRET), mask=m[:, None])
    if PHASE != 1:
        _r, c_k = _gated_pair(b_m, b_k, b_q, b_g, gc, hv * K, HV * K, o_k, t0, eos, BT, BK, False, False, True, DT,
                              INTERPRET)
        last = tl.minimum(t0 + BT, eos) - 1
        g_last = tl.load(gc + last * (HV * K) + hv * K + o_k)
        fac = tl.where(m[:, None], tl.exp(g_last[None, :] - b_g), 0.)
        b_dhet = tl.load(dhe + st_t)
        b_vn = tl.load(vn + v_off, mask=m[:, None], other=0.)
        b_dks = _dot(b_vn, b_dhet, INTERPRET) * fac
        b_dg -= c_k * b_k
        b_dk = c_k + md[:, None] * b_q + b_dks
        tl.store(dk + out_k, _rnd(b_dk, dk.dtype.element_ty, INTERPRET), mask=m[:, None])
        tl.store(dgx + out_k, b_dks * b_k, mask=m[:, None])
        # the chunk-end decay exp(G_last) of the state: its dG lands on the last row
        hd = tl.sum(tl.load(h + st_t).to(tl.float32) * b_dhet.to(tl.float32), 0)
        b_dg += tl.where((o_t == (last - t0))[:, None], (tl.exp(g_last) * hd)[None, :], 0.)
        if PHASE == 2:
            b_dg += tl.load(dgp + out_k, mask=m[:, None], other=0.)
    tl.store(dgp + out_k, b_dg, mask=m[:, None])


@triton.jit(do_not_specialize=["H", "HV"])
def bwd_wy_kernel(k, v, beta, g, A_log, dt_bias, gc, A, dw, dd, se, table, dk, dko, dgp, dgx, dv, dbeta, dg, part,
                  lower_bound, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                  GATE: tl.constexpr, INTERPRET: tl.constexpr):
    """Backward through w = A X, u = A Y and A = (I + L)^-1; finishes dk, dv, dbeta and dg (reverse cumsum of dG,
    then through the in-kernel gate). dko = dk + this kernel's dk (dko may be dk); dgp holds the dq / dk / dw
    kernel's dG, dgx the state term of dg per row (its exclusive prefix sum is added after the reverse scan). With
    the gate (GATE): part [P, HV * K + HV]
    gets this chunk's sums over its rows of ddt_bias (column hv * K + d) and of dA_log's terms (column HV * K + hv);
    unused slots write zeros, so a fixed-order column sum over the P slots gives the parameters' gradients.
    The key dimensions go in BK-wide slices, twice: dA sums dw X^T over them; then dL = -A^T dA A^T, and every
    per-key-dimension result (dk, dg, the gate's backward, ddt_bias) is a slice's own; dbeta and dA_log's terms add
    up over the slices in one order."""
    p = tl.program_id(0)
    hv = tl.program_id(1)
    n = tl.load(table + 2 * p)
    if n < 0:
        if GATE != 0:
            prow = p.to(tl.int64) * (HV * K + HV)
            o_kz = tl.arange(0, K)
            tl.store(part + prow + hv * K + o_kz, tl.zeros([K], dtype=tl.float32))
            tl.store(part + prow + HV * K + hv, 0.)
        return
    ic = tl.load(table + 2 * p + 1).to(tl.int64)
    bos = tl.load(se + 2 * n).to(tl.int64)
    eos = tl.load(se + 2 * n + 1).to(tl.int64)
    hk = hv // (HV // H)
    DT = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_v = tl.arange(0, V)
    t0 = bos + ic * BT
    rows = t0 + o_t
    m = rows < eos
    v_off = rows[:, None] * (HV * V) + hv * V + o_v[None, :]

    b_b = tl.load(beta + rows * HV + hv, mask=m, other=0.).to(tl.float32)
    # A^T, Y^T, X^T are transposes of loaded or elementwise (not matmul-produced) tiles: safe on triton 3.6 Hopper
    b_at = tl.trans(tl.load(A + rows[:, None] * (HV * BT) + hv * BT + o_t[None, :], mask=m[:, None], other=0.))
    b_v = tl.load(v + v_off, mask=m[:, None], other=0.).to(tl.float32)
    b_y = _rnd((b_v * b_b[:, None]), DT, INTERPRET)
    b_dd = tl.load(dd + v_off, mask=m[:, None], other=0.)
    b_dy = _dot(b_at, b_dd, INTERPRET)
    tl.store(dv + v_off, _rnd((b_dy * b_b[:, None]), dv.dtype.element_ty, INTERPRET), mask=m[:, None])
    b_db = tl.sum(b_dy * b_v, 1)
    b_da = _dot(b_dd, tl.trans(b_y), INTERPRET)  # dA [i, j], v term
    for ks in range(0, K // BK):  # + the k term, dw X^T
        o_k = ks * BK + tl.arange(0, BK)
        w_off = rows[:, None] * (HV * K) + hv * K + o_k[None, :]
        b_g = tl.load(gc + tl.minimum(rows, eos - 1)[:, None] * (HV * K) + hv * K + o_k[None, :])
        b_kf = tl.load(k + rows[:, None] * (H * K) + hk * K + o_k[None, :], mask=m[:, None], other=0.).to(tl.float32)
        b_x = _rnd((b_kf * (b_b[:, None] * tl.exp(b_g))), DT, INTERPRET)
        b_dw = tl.load(dw + w_off, mask=m[:, None], other=0.)
        b_da += _dot(b_dw, tl.trans(b_x), INTERPRET)
    b_dl = -_dot(_rnd(_dot(b_at, _rnd(b_da, DT, INTERPRET), INTERPRET), DT, INTERPRET), b_at, INTERPRET)
    ta_sum = 0.
    for ks in range(0, K // BK):
        o_k = ks * BK + tl.arange(0, BK)
        w_off = rows[:, None] * (HV * K) + hv * K + o_k[None, :]
        b_g = tl.load(gc + tl.minimum(rows, eos - 1)[:, None] * (HV * K) + hv * K + o_k[None, :])
        eg = tl.exp(b_g)
        bx = b_b[:, None] * eg
        b_kf = tl.load(k + rows[:, None] * (H * K) + hk * K + o_k[None, :], mask=m[:, None], other=0.).to(tl.float32)
        b_dw = tl.load(dw + w_off, mask=m[:, None], other=0.)
        # L_ij = beta_i sum_d k_id k_jd Gam_ij,d: R0_i = sum_j dL_ij k_j Gam (for dk_i, dbeta_i),
        # C_j = sum_i dL_ij beta_i k_i Gam (for dk_j)
        r0, c = _gated_pair(b_dl, b_kf, b_kf * b_b[:, None], b_g, gc, hv * K, HV * K, o_k, t0, eos, BT, BK, False,
                            True, True, DT, INTERPRET)
        b_db += tl.sum(b_kf * r0, 1)
        r0 = r0 * b_b[:, None]
        b_dk = r0 + c
        b_dg = b_kf * (r0 - c)
        b_dx = _dot(b_at, b_dw, INTERPRET)
        b_db += tl.sum(b_dx * b_kf * eg, 1)
        b_dg += b_dx * b_kf * bx
        b_dk += b_dx * bx

        b_dk += tl.load(dk + w_off, mask=m[:, None], other=0.).to(tl.float32)
        tl.store(dko + w_off, _rnd(b_dk, dko.dtype.element_ty, INTERPRET), mask=m[:, None])
        b_dg += tl.load(dgp + w_off, mask=m[:, None], other=0.)
        b_dg = tl.where(m[:, None], b_dg, 0.)
        # d of each token's log decay: a reverse scan (total - cumsum + x would leave every token an error of eps
        # times the chunk's total, one error shared by all of them, which the sums over tokens of ddt_bias / dA_log
        # add up)
        b_dg = tl.cumsum(b_dg, axis=0, reverse=True)
        # + the state term's exclusive prefix sum: row t adds dgx's rows < t (the scan of the rows shifted by one)
        b_dg += tl.cumsum(tl.load(dgx + w_off - HV * K, mask=(m & (o_t > 0))[:, None], other=0.), axis=0)
        if GATE != 0:
            a_log, bias = _gate_params(A_log, dt_bias, hv, o_k, K, GATE)
            x = tl.load(g + w_off, mask=m[:, None], other=0.).to(tl.float32) + bias[None, :]
            ea = tl.exp(a_log)
            if GATE == 1:
                ta = b_dg * (-ea * _softplus(x))  # d g_eff / d A_log = g_eff
                b_dg = b_dg * (-ea * tl.sigmoid(x))
            else:
                s = tl.sigmoid(ea * x)
                b_dg = b_dg * (lower_bound * s * (1. - s) * ea)
                ta = b_dg * x
            b_dg = tl.where(m[:, None], b_dg, 0.)
            prow = p.to(tl.int64) * (HV * K + HV)
            tl.store(part + prow + hv * K + o_k, tl.sum(b_dg, 0))
            ta_sum += tl.sum(tl.sum(tl.where(m[:, None], ta, 0.), 1), 0)
        tl.store(dg + w_off, _rnd(b_dg, dg.dtype.element_ty, INTERPRET), mask=m[:, None])
    if GATE != 0:
        tl.store(part + p.to(tl.int64) * (HV * K + HV) + HV * K + hv, ta_sum)
    tl.store(dbeta + rows * HV + hv, b_db, mask=m)


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
