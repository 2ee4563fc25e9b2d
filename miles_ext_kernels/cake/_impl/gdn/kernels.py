"""Triton kernels of the chunked Gated DeltaNet (chunk BT = 64 tokens).

Per value head `hv` (key head `hv // (HV // H)`), per chunk of one sequence, with G the in-chunk cumulative sum of
the log-decay g, h the state at the chunk start and D_ij = exp(G_i - G_j):

    L  = strict_tril(beta_i (k_i . k_j) D_ij)           A = (I + L)^-1           (UT / WY representation)
    w  = A (beta exp(G) k)                               u = A (beta v)
    dlt = u - w h                                        ("v_new": the per-token delta of the rule)
    o  = scale (exp(G) q) h + scale tril(q k^T * D) dlt
    h' = exp(G_last) h + (k exp(G_last - G))^T dlt

Layouts (rows are tokens of the packed sequence): q, k [T, H, K]; v [T, HV, V] (these three with row strides SQ, SK,
SV: views of a wider projection, heads packed within a row); g, beta, gc [T, HV] fp32; A [T, HV, BT]; w [T, HV, K];
u, dlt [T, HV, V]; chunk states h [P, HV, K, V] with one slot per chunk, slot = bos[n] // BT + n + chunk index (P =
cdiv(T, BT) + N slots bound it without a device->host sync). `table` [P, 2] int32 maps a slot to (sequence or -1,
chunk index); `se` [N, 2] int32 holds each sequence's (bos, eos), cu_seqlens clamped into [0, T] by the table kernel
(the only kernel that reads cu_seqlens).

Rows past a document's end are loaded as zeros, but their G as the document's last G (`_chunk_gc`, and the prep's
cumsum of g = 0): an exp(G_i - G_j) over a pair of rows never has a positive argument, which a strong decay
(G_j < -88.7) would overflow into inf and 0 * inf into a NaN that a matmul spreads to every row of the chunk.

A NaN or an inf at token j must not reach the rows i < j of its chunk. The in-chunk products with a causally masked
(lower-triangular) matrix, M x with M = L's blocks inside the inverse, A (for w, u) and tril(q k^T D) (for o), would
carry it there through M's zeros (0 * NaN = NaN): each such right operand has its non-finite rows zeroed and the
first such row noted (`common._finite_rows`; inline over L's row blocks in the prep), and the product's rows from
that row on are set to NaN. Products
that contract over the key dimension or act on a row's own data, and the state (which sums over the chunk), need
nothing: rows from j on, and later chunks through the state, come out non-finite as in exact arithmetic. The common
case costs one sum of 0 * x per operand tile.

No kernel transposes a `tl.dot` result: every transposed operand is loaded transposed from memory (triton 3.4 -
3.7.0 miscompile `tl.trans` of a wgmma result fed to another dot on Hopper). No atomics: every sum has one fixed
order, so the results repeat bit for bit.

Interpreter (CPU tests): bf16 arithmetic is broken there, so elementwise math runs on fp32 values and `_dot`
converts its (bf16-rounded) operands to fp32 under the INTERPRET flag.
"""
import triton
import triton.language as tl

# the gate-independent kernels and helpers live in the delta-rule core shared with kda
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
    _store_a,
    _store_slot,
)

BT = common.BT  # chunk length
G_FLOOR = common.G_FLOOR


@triton.jit
def _chunk_of(table, se, SPLIT: tl.constexpr):
    """A chunk kernel's program (`_chunk_program`: p, ik, hv, n) and its slot's chunk index, bos and eos, read
    before the kernel's unused-slot check (n = -1 reads sequence 0's bounds)."""
    p, ik, hv, n = common._chunk_program(table, SPLIT)
    ic, bos, eos = common._chunk_doc(table, se, p, tl.maximum(n, 0))
    return p, ik, hv, n, ic, bos, eos


@triton.jit
def _chunk_gc(gc, rows, eos, hv, HV):
    """G of a chunk's rows, rows past the document's end reading its last row's: G only falls along a document, so no
    exp(G_i - G_j) with a padding row i has a positive argument (a padding G of 0 overflowed it once G_j < -88.7,
    and 0 * inf spread NaN through the chunk's matmuls). Padding rows' q, k, v, beta are 0, so their terms stay 0."""
    return tl.load(gc + tl.minimum(rows, eos - 1) * HV + hv)


# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _prep_rows(k, g, beta, gc, rows, m, off, hk, hv, SK, HV, K: tl.constexpr):
    o_k = tl.arange(0, K)
    b_k = tl.load(k + rows[:, None] * SK + hk * K + o_k[None, :], mask=m[:, None], other=0.)
    b_g = tl.load(g + rows * HV + hv, mask=m, other=0.).to(tl.float32)
    b_g = tl.where(b_g < G_FLOOR, G_FLOOR, b_g)
    # padding rows (g = 0) carry the chunk's last G: no exp below sees a positive difference
    b_gc = tl.cumsum(b_g, axis=0) + off
    tl.store(gc + rows * HV + hv, b_gc, mask=m)
    b_b = tl.load(beta + rows * HV + hv, mask=m, other=0.).to(tl.float32)
    return b_k, b_gc, b_b, off + tl.sum(b_g, axis=0)


@triton.jit
def _l_block(ka, kb, ga, gb, ba, DIAG: tl.constexpr, INTERPRET: tl.constexpr):
    s = _dot(ka, tl.trans(kb), INTERPRET)
    if DIAG:
        o = tl.arange(0, 16)
        msk = o[:, None] > o[None, :]
        d = tl.where(msk, ga[:, None] - gb[None, :], 0.)
        r = tl.where(msk, s * tl.exp(d) * ba[:, None], 0.)
    else:
        r = s * tl.exp(ga[:, None] - gb[None, :]) * ba[:, None]
    return r


@triton.jit(do_not_specialize=["H", "HV"])
def fwd_prep_kernel(k, g, beta, se, table, gc, A, SK, H, HV, K: tl.constexpr, BT: tl.constexpr,
                    INTERPRET: tl.constexpr):
    """Per chunk: gc = in-chunk cumsum of g; A = (I + L)^-1, in 16 x 16 blocks."""
    p, _ik, hv, n, ic, bos, eos = _chunk_of(table, se, 1)
    if n < 0:
        return
    hk = hv // (HV // H)
    t0 = bos + ic * BT
    r0 = t0 + tl.arange(0, 16)
    r1 = r0 + 16
    r2 = r0 + 32
    r3 = r0 + 48
    m0 = r0 < eos
    m1 = r1 < eos
    m2 = r2 < eos
    m3 = r3 < eos
    k0, g0, b0, off = _prep_rows(k, g, beta, gc, r0, m0, 0., hk, hv, SK, HV, K)
    k1, g1, b1, off = _prep_rows(k, g, beta, gc, r1, m1, off, hk, hv, SK, HV, K)
    k2, g2, b2, off = _prep_rows(k, g, beta, gc, r2, m2, off, hk, hv, SK, HV, K)
    k3, g3, b3, off = _prep_rows(k, g, beta, gc, r3, m3, off, hk, hv, SK, HV, K)

    L00 = _l_block(k0, k0, g0, g0, b0, True, INTERPRET)
    L11 = _l_block(k1, k1, g1, g1, b1, True, INTERPRET)
    L22 = _l_block(k2, k2, g2, g2, b2, True, INTERPRET)
    L33 = _l_block(k3, k3, g3, g3, b3, True, INTERPRET)
    L10 = _l_block(k1, k0, g1, g0, b1, False, INTERPRET)
    L20 = _l_block(k2, k0, g2, g0, b2, False, INTERPRET)
    L21 = _l_block(k2, k1, g2, g1, b2, False, INTERPRET)
    L30 = _l_block(k3, k0, g3, g0, b3, False, INTERPRET)
    L31 = _l_block(k3, k1, g3, g1, b3, False, INTERPRET)
    L32 = _l_block(k3, k2, g3, g2, b3, False, INTERPRET)
    # a non-finite entry of L (row i: tokens <= i) would spread to earlier rows of A through the products' zeros
    # (`common._finite_rows`): A from L's finite rows, and A's rows from L's first non-finite row on are NaN
    f = tl.zeros([], dtype=tl.int32) + BT
    e3 = L30 * 0. + L31 * 0. + L32 * 0. + L33 * 0.  # 0 * NaN = 0 * inf = NaN: a sum is NaN iff a term holds one
    e2 = L20 * 0. + L21 * 0. + L22 * 0.
    e1 = L10 * 0. + L11 * 0.
    e0 = L00 * 0.
    if tl.sum(e0 + e1 + e2 + e3, axis=None) != 0.:
        bad0 = tl.sum(e0, 1) != 0.
        bad1 = tl.sum(e1, 1) != 0.
        bad2 = tl.sum(e2, 1) != 0.
        bad3 = tl.sum(e3, 1) != 0.
        o16 = tl.arange(0, 16)
        f = tl.min(tl.minimum(tl.minimum(tl.where(bad0, o16, BT), tl.where(bad1, o16 + 16, BT)),
                              tl.minimum(tl.where(bad2, o16 + 32, BT), tl.where(bad3, o16 + 48, BT))), 0)
        L00 = tl.where(bad0[:, None], 0., L00)
        L10 = tl.where(bad1[:, None], 0., L10)
        L11 = tl.where(bad1[:, None], 0., L11)
        L20 = tl.where(bad2[:, None], 0., L20)
        L21 = tl.where(bad2[:, None], 0., L21)
        L22 = tl.where(bad2[:, None], 0., L22)
        L30 = tl.where(bad3[:, None], 0., L30)
        L31 = tl.where(bad3[:, None], 0., L31)
        L32 = tl.where(bad3[:, None], 0., L32)
        L33 = tl.where(bad3[:, None], 0., L33)

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
    z0 = z
    z1 = z
    z2 = z
    if f < BT:
        A00 = _nan_rows(A00, f, 0)
        z0 = _nan_rows(z, f, 0)
        A10 = _nan_rows(A10, f, 16)
        A11 = _nan_rows(A11, f, 16)
        z1 = _nan_rows(z, f, 16)
        A20 = _nan_rows(A20, f, 32)
        A21 = _nan_rows(A21, f, 32)
        A22 = _nan_rows(A22, f, 32)
        z2 = _nan_rows(z, f, 32)
        A30 = _nan_rows(A30, f, 48)
        A31 = _nan_rows(A31, f, 48)
        A32 = _nan_rows(A32, f, 48)
        A33 = _nan_rows(A33, f, 48)
    _store_a(A, r0, m0, hv, HV, 0, A00, BT, INTERPRET)
    _store_a(A, r0, m0, hv, HV, 16, z0, BT, INTERPRET)
    _store_a(A, r0, m0, hv, HV, 32, z0, BT, INTERPRET)
    _store_a(A, r0, m0, hv, HV, 48, z0, BT, INTERPRET)
    _store_a(A, r1, m1, hv, HV, 0, A10, BT, INTERPRET)
    _store_a(A, r1, m1, hv, HV, 16, A11, BT, INTERPRET)
    _store_a(A, r1, m1, hv, HV, 32, z1, BT, INTERPRET)
    _store_a(A, r1, m1, hv, HV, 48, z1, BT, INTERPRET)
    _store_a(A, r2, m2, hv, HV, 0, A20, BT, INTERPRET)
    _store_a(A, r2, m2, hv, HV, 16, A21, BT, INTERPRET)
    _store_a(A, r2, m2, hv, HV, 32, A22, BT, INTERPRET)
    _store_a(A, r2, m2, hv, HV, 48, z2, BT, INTERPRET)
    _store_a(A, r3, m3, hv, HV, 0, A30, BT, INTERPRET)
    _store_a(A, r3, m3, hv, HV, 16, A31, BT, INTERPRET)
    _store_a(A, r3, m3, hv, HV, 32, A32, BT, INTERPRET)
    _store_a(A, r3, m3, hv, HV, 48, A33, BT, INTERPRET)


@triton.jit(do_not_specialize=["H", "HV"])
def fwd_wu_kernel(k, v, beta, gc, A, se, table, w, u, SK, SV, H, HV, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, INTERPRET: tl.constexpr):
    """w = A (beta exp(G) k), u = A (beta v) per chunk. SK, SV: k's and v's row strides (elements between
    tokens)."""
    p, ik, hv, n, ic, bos, eos = _chunk_of(table, se, 1)
    if n < 0:
        return
    hk, o_t, o_k, o_v, t0, rows, m = common._chunk_rows(hv, ik, ic, bos, eos, H, HV, K, V, BT)
    DT = k.dtype.element_ty
    b_A = tl.load(A + rows[:, None] * (HV * BT) + hv * BT + o_t[None, :], mask=m[:, None], other=0.)
    b_gc = tl.load(gc + rows * HV + hv, mask=m, other=0.)
    b_b = tl.load(beta + rows * HV + hv, mask=m, other=0.).to(tl.float32)
    b_k = tl.load(k + rows[:, None] * SK + hk * K + o_k[None, :], mask=m[:, None], other=0.).to(tl.float32)
    # A is lower triangular: a non-finite row of X or Y is zeroed for the product, and the rows of w / u from it on
    # are NaN (`_causal_store`)
    b_x = b_k * (b_b * tl.exp(b_gc))[:, None]
    _causal_store(b_A, b_x, w, rows, m, hv, HV, o_k, K, BT, DT, INTERPRET)
    b_v = tl.load(v + rows[:, None] * SV + hv * V + o_v[None, :], mask=m[:, None], other=0.).to(tl.float32)
    _causal_store(b_A, b_v * b_b[:, None], u, rows, m, hv, HV, o_v, V, BT, DT, INTERPRET)


@triton.jit(do_not_specialize=["H", "HV"])
def fwd_h_kernel(k, w, u, gc, se, h0, h, vn, ht, SK, H, HV, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                 BV: tl.constexpr, USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_H: tl.constexpr,
                 VU: tl.constexpr, INTERPRET: tl.constexpr):
    """The inter-chunk state recurrence of one sequence and value head (a BV-wide slice of V). STORE_H off: only
    the final state (context parallelism's extra pass). u holds the first VU of the V columns (the rest read 0)."""
    iv, n, hv, hk, bos, eos, nt, slot0 = _seq_program(se, H, HV, BT)
    DT = k.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = iv * BV + tl.arange(0, BV)
    st_off, b_h = _state_start(h0, n, hv, HV, o_k, o_v, K, V, BV, USE_H0, False)
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
        g_last = tl.load(gc + last * HV + hv)
        b_gc = tl.load(gc + rows * HV + hv, mask=m, other=0.)
        fac = tl.where(m, tl.exp(g_last - b_gc), 0.)
        b_kt = tl.load(k + rows[None, :] * SK + hk * K + o_k[:, None], mask=m[None, :], other=0.)
        b_kt = _rnd((b_kt.to(tl.float32) * fac[None, :]), DT, INTERPRET)
        b_h = b_h * tl.exp(g_last) + _dot(b_kt, b_vn, INTERPRET)
    if STORE_HT:
        tl.store(ht + st_off, b_h)


@triton.jit(do_not_specialize=["H", "HV"])
def fwd_o_kernel(q, k, vn, gc, h, se, table, o, scale, SQ, SK, H, HV, K: tl.constexpr, V: tl.constexpr,
                 BT: tl.constexpr, INTERPRET: tl.constexpr):
    """o = scale (exp(G) q) h + scale tril(q k^T * D) dlt per chunk."""
    p, ik, hv, n, ic, bos, eos = _chunk_of(table, se, 1)
    if n < 0:
        return
    hk, o_t, o_k, o_v, t0, rows, m = common._chunk_rows(hv, ik, ic, bos, eos, H, HV, K, V, BT)
    DT = q.dtype.element_ty
    b_q = tl.load(q + rows[:, None] * SQ + hk * K + o_k[None, :], mask=m[:, None], other=0.)
    b_kt = tl.load(k + rows[None, :] * SK + hk * K + o_k[:, None], mask=m[None, :], other=0.)
    b_gc = _chunk_gc(gc, rows, eos, hv, HV)
    b_h = tl.load(h + (p.to(tl.int64) * HV + hv) * (K * V) + o_k[:, None] * V + o_v[None, :])
    b_o = _dot(b_q, b_h, INTERPRET) * (tl.exp(b_gc) * scale)[:, None]
    b_s = _dot(b_q, b_kt, INTERPRET)
    msk = o_t[:, None] >= o_t[None, :]
    b_s = tl.where(msk, b_s * tl.exp(tl.where(msk, b_gc[:, None] - b_gc[None, :], 0.)), 0.) * scale
    b_vn = tl.load(vn + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None], other=0.)
    # the masked product: a non-finite row of dlt is zeroed for it, and o's rows from it on are NaN (`_finite_rows`)
    b_vn, fv = _finite_rows(b_vn, BT, 0)
    b_o += _dot(_rnd(b_s, DT, INTERPRET), b_vn, INTERPRET)
    if fv < BT:
        b_o = _nan_rows(b_o, fv, 0)
    tl.store(o + rows[:, None] * (HV * V) + hv * V + o_v[None, :], _rnd(b_o, o.dtype.element_ty, INTERPRET),
             mask=m[:, None])


# ----------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["H", "HV"])
def bwd_dvl_kernel(q, k, do, gc, se, table, dvl, scale, SQ, SK, H, HV, K: tl.constexpr, V: tl.constexpr,
                   BT: tl.constexpr, INTERPRET: tl.constexpr):
    """The in-chunk part of d(dlt): scale tril(q k^T * D)^T do (computed transposed, from k q^T)."""
    p, ik, hv, n, ic, bos, eos = _chunk_of(table, se, 1)
    if n < 0:
        return
    hk, o_t, o_k, o_v, t0, rows, m = common._chunk_rows(hv, ik, ic, bos, eos, H, HV, K, V, BT)
    DT = q.dtype.element_ty
    b_k = tl.load(k + rows[:, None] * SK + hk * K + o_k[None, :], mask=m[:, None], other=0.)
    b_qt = tl.load(q + rows[None, :] * SQ + hk * K + o_k[:, None], mask=m[None, :], other=0.)
    b_gc = _chunk_gc(gc, rows, eos, hv, HV)
    b_st = _dot(b_k, b_qt, INTERPRET)  # [j, i]
    msk = o_t[None, :] >= o_t[:, None]
    b_st = tl.where(msk, b_st * tl.exp(tl.where(msk, b_gc[None, :] - b_gc[:, None], 0.)), 0.) * scale
    b_do = tl.load(do + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None], other=0.)
    b_dv = _dot(_rnd(b_st, DT, INTERPRET), b_do, INTERPRET)
    tl.store(dvl + rows[:, None] * (HV * V) + hv * V + o_v[None, :], _rnd(b_dv, dvl.dtype.element_ty, INTERPRET),
             mask=m[:, None])


@triton.jit(do_not_specialize=["H", "HV"])
def bwd_dh_kernel(q, k, w, do, dvl, gc, se, dht, dh0, dhe, dd, scale, SQ, SK, H, HV, K: tl.constexpr, V: tl.constexpr,
                  BT: tl.constexpr, BV: tl.constexpr, USE_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
                  STORE_DHE: tl.constexpr, INTERPRET: tl.constexpr):
    """Reverse state recurrence: dhe[slot] = d(state at the chunk end); dd = full d(dlt) (dvl, its in-chunk part
    from bwd_dvl_kernel, plus the state's); dh0. STORE_DHE off: only dh0 (context parallelism's extra pass, whose
    dhe and dd the op's own pass would overwrite)."""
    iv, n, hv, hk, bos, eos, nt, slot0 = _seq_program(se, H, HV, BT)
    DT = q.dtype.element_ty
    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, K)
    o_v = iv * BV + tl.arange(0, BV)
    st_off, b_dh = _state_start(dht, n, hv, HV, o_k, o_v, K, V, BV, USE_DHT, False)
    for j in range(0, nt):
        ic = nt - 1 - j
        t0 = bos + ic * BT
        rows = t0 + o_t
        m = rows < eos
        if STORE_DHE:
            _store_slot(dhe, slot0 + ic, hv, HV, o_k, o_v, b_dh, K, V, DT, INTERPRET)
        last = tl.minimum(t0 + BT, eos) - 1
        g_last = tl.load(gc + last * HV + hv)
        b_gc = tl.load(gc + rows * HV + hv, mask=m, other=0.)
        fac = tl.where(m, tl.exp(g_last - b_gc), 0.)
        b_k = tl.load(k + rows[:, None] * SK + hk * K + o_k[None, :], mask=m[:, None], other=0.)
        b_kd = _rnd((b_k.to(tl.float32) * fac[:, None]), DT, INTERPRET)
        b_qr = tl.load(q + rows[None, :] * SQ + hk * K + o_k[:, None], mask=m[None, :], other=0.)  # q^T
        b_do = tl.load(do + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None], other=0.)
        b_dvl = tl.load(dvl + rows[:, None] * (HV * V) + hv * V + o_v[None, :], mask=m[:, None],
                        other=0.).to(tl.float32)
        b_dd = b_dvl + _dot(b_kd, _rnd(b_dh, DT, INTERPRET), INTERPRET)
        b_dd = _rnd(b_dd, DT, INTERPRET)
        if STORE_DHE:
            tl.store(dd + rows[:, None] * (HV * V) + hv * V + o_v[None, :], b_dd, mask=m[:, None])
        b_qt = _rnd((b_qr.to(tl.float32) * tl.where(m, tl.exp(b_gc) * scale, 0.)[None, :]), DT, INTERPRET)
        b_wt = tl.load(w + rows[None, :] * (HV * K) + hv * K + o_k[:, None], mask=m[None, :], other=0.)
        b_dh = b_dh * tl.exp(g_last) + _dot(b_qt, b_do, INTERPRET) - _dot(b_wt, b_dd, INTERPRET)
    if STORE_DH0:
        tl.store(dh0 + st_off, b_dh)


@triton.jit(do_not_specialize=["H", "HV"])
def bwd_dqkw_kernel(q, k, vn, do, dd, gc, h, dhe, se, table, dq, dk, dw, dgp, scale, SQ, SK, H, HV, K: tl.constexpr,
                    V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, PHASE: tl.constexpr, NPART: tl.constexpr,
                    SLOT0: tl.constexpr, DSLOT0: tl.constexpr, INTERPRET: tl.constexpr):
    """Per chunk and BK-wide slice of K: dq, dk (through o and the state update), dw = -dd h^T and the slice's part
    of dG (per value head). PHASE 0 does all; PHASE 1 only dq, dw; PHASE 2 only dk (two launches, fewer live
    tiles each; each launch may use its own BK). dgp [T, HV, NPART] holds the partial dG sums: this launch's slice ik
    writes slot SLOT0 + ik; the WY backward adds the slots in order. The dk part also writes slot DSLOT0 + ik: the
    state term of dg as it is (not a term of dG; below).

    dg without cancellation. dg_t = sum_{s >= t} dG_s, and two groups of dG terms cancel in that sum: each row's own
    (i = j) o term appears in q.dq and in k.dk, and the state term of dk (k_i . dks_i, of size exp(G_last - G_i))
    appears at row i and summed on the last row. Left in, their rounding residue (~1e-7 of O(1) terms) is all of a
    strongly decayed dg (true size exp(g) per step). So dq / dk take the diagonal as an elementwise term outside
    dG, and the state term k_i . dks_i goes to slot DSLOT0 + ik per row; the WY backward adds its exclusive prefix
    sum sum_{i < t} to dg (a scan of the rows shifted by one: no difference of large sums)."""
    p, ik, hv, n, ic, bos, eos = _chunk_of(table, se, K // BK)
    if n < 0:
        return
    hk, o_t, o_k, o_v, t0, rows, m = common._chunk_rows(hv, ik, ic, bos, eos, H, HV, BK, V, BT)
    DT = q.dtype.element_ty
    q_off = rows[:, None] * SQ + hk * K + o_k[None, :]
    k_off = rows[:, None] * SK + hk * K + o_k[None, :]
    v_off = rows[:, None] * (HV * V) + hv * V + o_v[None, :]
    vt_off = rows[None, :] * (HV * V) + hv * V + o_v[:, None]
    st_t = (p.to(tl.int64) * HV + hv) * (K * V) + o_k[None, :] * V + o_v[:, None]  # [V, BK] view of a state
    out_k = rows[:, None] * (HV * K) + hv * K + o_k[None, :]
    b_gc = _chunk_gc(gc, rows, eos, hv, HV)
    last = tl.minimum(t0 + BT, eos) - 1
    b_dg = tl.zeros([BT], dtype=tl.float32)
    # phases with short live ranges (fewer operand tiles live at once): dq and dw, then dk, then dg's last term
    if PHASE != 2:
        b_do = tl.load(do + v_off, mask=m[:, None], other=0.)
        b_ht = tl.load(h + st_t)
        b_dq = _dot(b_do, b_ht, INTERPRET) * (tl.exp(b_gc) * scale)[:, None]
        b_dd = tl.load(dd + v_off, mask=m[:, None], other=0.)
        b_dw = -_dot(b_dd, b_ht, INTERPRET)
        tl.store(dw + out_k, _rnd(b_dw, dw.dtype.element_ty, INTERPRET), mask=m[:, None])
        msk = o_t[:, None] > o_t[None, :]
        b_vnt = tl.load(vn + vt_off, mask=m[None, :], other=0.)
        b_dp = _dot(b_do, b_vnt, INTERPRET)
        diag = _rnd(tl.sum(tl.where(o_t[:, None] == o_t[None, :], b_dp, 0.), 1) * scale, DT, INTERPRET)
        b_dp = tl.where(msk, b_dp * tl.exp(tl.where(msk, b_gc[:, None] - b_gc[None, :], 0.)), 0.) * scale
        b_k = tl.load(k + k_off, mask=m[:, None], other=0.)
        b_dq += _dot(_rnd(b_dp, DT, INTERPRET), b_k, INTERPRET)
        b_q = tl.load(q + q_off, mask=m[:, None], other=0.)
        b_dg += tl.sum(b_dq * b_q.to(tl.float32), 1)
        b_dq += diag[:, None] * b_k.to(tl.float32)
        tl.store(dq + out_k, _rnd(b_dq, dq.dtype.element_ty, INTERPRET), mask=m[:, None])
    if PHASE != 1:
        if PHASE == 2:
            b_k = tl.load(k + k_off, mask=m[:, None], other=0.)
            b_q = tl.load(q + q_off, mask=m[:, None], other=0.)
        g_last = tl.load(gc + last * HV + hv)
        mskt = o_t[None, :] > o_t[:, None]
        b_vn = tl.load(vn + v_off, mask=m[:, None], other=0.)
        b_dot = tl.load(do + vt_off, mask=m[None, :], other=0.)
        b_dpt = _dot(b_vn, b_dot, INTERPRET)
        diagt = _rnd(tl.sum(tl.where(o_t[:, None] == o_t[None, :], b_dpt, 0.), 1) * scale, DT, INTERPRET)
        b_dpt = tl.where(mskt, b_dpt * tl.exp(tl.where(mskt, b_gc[None, :] - b_gc[:, None], 0.)), 0.) * scale
        b_dk = _dot(_rnd(b_dpt, DT, INTERPRET), b_q, INTERPRET)
        fac = tl.where(m, tl.exp(g_last - b_gc), 0.)
        b_dhet = tl.load(dhe + st_t)
        b_dks = _dot(b_vn, b_dhet, INTERPRET) * fac[:, None]
        b_kf = b_k.to(tl.float32)
        ks = tl.sum(b_dks * b_kf, 1)
        b_dg -= tl.sum(b_dk * b_kf, 1)
        b_dk += diagt[:, None] * b_q.to(tl.float32)
        tl.store(dk + out_k, _rnd(b_dk + b_dks, dk.dtype.element_ty, INTERPRET), mask=m[:, None])
        tl.store(dgp + (rows * HV + hv) * NPART + DSLOT0 + ik, ks, mask=m)

        # sum(h * dhe) over the slice, against the dhe tile in registers (measured 0.13 ms faster at 16 x 2048 than
        # 16-row pieces of both states)
        hd = tl.sum(tl.sum(tl.load(h + st_t).to(tl.float32) * b_dhet.to(tl.float32), 1), 0)
        b_dg += tl.where(o_t == (last - t0), tl.exp(g_last) * hd, 0.)
    tl.store(dgp + (rows * HV + hv) * NPART + SLOT0 + ik, b_dg, mask=m)


@triton.jit(do_not_specialize=["H", "HV"])
def bwd_wy_kernel(k, v, beta, gc, A, dw, dd, se, table, dk, dko, dgp, dv, dbeta, dg, SK, SV, H, HV, K: tl.constexpr,
                  V: tl.constexpr, BT: tl.constexpr, NK: tl.constexpr, ND: tl.constexpr, INTERPRET: tl.constexpr):
    """Backward through w = A X, u = A Y and A = (I + L)^-1; finishes dk, dv, dbeta and dg (reverse cumsum).
    dko = dk + this kernel's dk (dko may be dk). dgp holds NK partial dG sums per row (added in order), then ND
    state terms of dg itself (their exclusive prefix sum is added after the reverse cumsum; bwd_dqkw_kernel says
    why). The work is
    ordered for short live ranges: the v side (dv, its dbeta and dA terms), then dA's k term, the dL terms, and the
    A^T dw terms last (measured faster than the plain order: 1.34 vs 1.52 ms at 16 x 2048 on the H200)."""
    p, ik, hv, n, ic, bos, eos = _chunk_of(table, se, 1)
    if n < 0:
        return
    hk, o_t, o_k, o_v, t0, rows, m = common._chunk_rows(hv, ik, ic, bos, eos, H, HV, K, V, BT)
    DT = k.dtype.element_ty
    k_off = rows[:, None] * SK + hk * K + o_k[None, :]
    v_off = rows[:, None] * (HV * V) + hv * V + o_v[None, :]
    w_off = rows[:, None] * (HV * K) + hv * K + o_k[None, :]

    b_b = tl.load(beta + rows * HV + hv, mask=m, other=0.).to(tl.float32)
    b_gc = _chunk_gc(gc, rows, eos, hv, HV)
    eg = tl.exp(b_gc)
    bx = b_b * eg
    msk = o_t[:, None] > o_t[None, :]
    # A^T, Y^T, X^T, k^T are transposes of loaded (not matmul-produced) tiles: safe on triton 3.6 Hopper
    b_at = tl.trans(tl.load(A + rows[:, None] * (HV * BT) + hv * BT + o_t[None, :], mask=m[:, None], other=0.))
    b_v = tl.load(v + rows[:, None] * SV + hv * V + o_v[None, :], mask=m[:, None], other=0.).to(tl.float32)
    b_y = _rnd((b_v * b_b[:, None]), DT, INTERPRET)
    b_dd = tl.load(dd + v_off, mask=m[:, None], other=0.)
    b_dy = _dot(b_at, b_dd, INTERPRET)
    tl.store(dv + v_off, _rnd((b_dy * b_b[:, None]), dv.dtype.element_ty, INTERPRET), mask=m[:, None])
    b_db = tl.sum(b_dy * b_v, 1)
    b_da = _dot(b_dd, tl.trans(b_y), INTERPRET)  # dA [i, j], v term
    b_kd = tl.load(k + k_off, mask=m[:, None], other=0.)
    b_x = _rnd((b_kd.to(tl.float32) * bx[:, None]), DT, INTERPRET)
    b_dw = tl.load(dw + w_off, mask=m[:, None], other=0.)
    b_da += _dot(b_dw, tl.trans(b_x), INTERPRET)
    b_dl = -_dot(_rnd(_dot(b_at, _rnd(b_da, DT, INTERPRET), INTERPRET), DT, INTERPRET), b_at, INTERPRET)
    b_dec = tl.where(msk, tl.exp(tl.where(msk, b_gc[:, None] - b_gc[None, :], 0.)), 0.)
    b_kk = _dot(b_kd, tl.trans(b_kd), INTERPRET)
    b_dld = b_dl * b_dec
    b_db += tl.sum(b_dld * b_kk, 1)
    b_e = b_dld * b_kk * b_b[:, None]
    b_dg = tl.sum(b_e, 1) - tl.sum(b_e, 0)
    b_mm = _rnd((b_dld * b_b[:, None]), DT, INTERPRET)
    # M^T k = (k^T M)^T: the transposed product only feeds an add, never another matmul
    b_dk = _dot(b_mm, b_kd, INTERPRET) + tl.trans(_dot(tl.trans(b_kd), b_mm, INTERPRET))
    b_dx = _dot(b_at, b_dw, INTERPRET)
    b_kf = b_kd.to(tl.float32)
    b_db += tl.sum(b_dx * b_kf * eg[:, None], 1)
    b_dg += tl.sum(b_dx * b_kf * bx[:, None], 1)
    b_dk += b_dx * bx[:, None]

    out_k = rows[:, None] * (HV * K) + hv * K + o_k[None, :]
    b_dk += tl.load(dk + out_k, mask=m[:, None], other=0.).to(tl.float32)
    tl.store(dko + out_k, _rnd(b_dk, dko.dtype.element_ty, INTERPRET), mask=m[:, None])
    for ik in tl.static_range(NK):  # the dqkw launches. partial dG slots, in slot order (launch, then K slice)
        b_dg += tl.load(dgp + (rows * HV + hv) * (NK + ND) + ik, mask=m, other=0.)
    b_dg = tl.where(m, b_dg, 0.)
    # a reverse scan (total - cumsum + x would leave every row an error of eps times the chunk's total)
    b_dg = tl.cumsum(b_dg, axis=0, reverse=True)
    # + the dk launches' state terms, as their exclusive prefix sum: row t adds rows < t (the rows shifted by one)
    ks = tl.zeros([BT], dtype=tl.float32)
    for ik in tl.static_range(ND):
        ks += tl.load(dgp + ((rows - 1) * HV + hv) * (NK + ND) + NK + ik, mask=m & (o_t > 0), other=0.)
    b_dg += tl.cumsum(ks, axis=0)
    tl.store(dg + rows * HV + hv, b_dg, mask=m)
    tl.store(dbeta + rows * HV + hv, b_db, mask=m)


