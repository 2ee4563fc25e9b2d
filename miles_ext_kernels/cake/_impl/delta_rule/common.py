"""The gate-independent kernels and helpers of the chunked delta rule, shared by gdn (a scalar gate per token and
head) and kda (a gate per key dimension): the interpreter-safe product and rounding helpers, the guard that keeps a
later token's NaN or inf out of earlier rows of a causal product (`_finite_rows`, `_nan_rows`), the L2 norm of q and
k, the inverse of a unit lower-triangular 16 x 16 block, the store of an A block, the prologue of the per-chunk
kernels, the prologue and per-chunk state store of the sequential state kernels, and the last backward kernel (the
sum of the per-value-head dq / dk over the value heads of each key head, in a fixed order, then back through the L2
norm).

Interpreter (CPU tests): bf16 arithmetic is broken there, so elementwise math runs on fp32 values, `_dot` converts its
(bf16-rounded) operands to fp32 under the INTERPRET flag, and `_rnd` rounds to nearest even where the interpreter's
own downcast truncates.
"""
import triton
import triton.language as tl

BT = 64  # chunk length
# Log-decays below G_FLOOR are read as G_FLOOR: exp(-128) is 0 in fp32, so a full forget (g = -inf) gives the exact
# result instead of -inf - -inf = NaN in the in-chunk differences G_i - G_j; NaN stays NaN (a compare, not a max).
G_FLOOR = tl.constexpr(-128.0)


@triton.jit
def _dot(a, b, INTERPRET: tl.constexpr):
    if INTERPRET:
        r = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        r = tl.dot(a, b)
    return r


@triton.jit
def _rnd(x, DT: tl.constexpr, INTERPRET: tl.constexpr):
    """x.to(DT), rounding to nearest even also in the interpreter (whose float downcast truncates)."""
    if INTERPRET:
        if DT == tl.bfloat16:
            b = x.to(tl.float32).to(tl.uint32, bitcast=True)
            b = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16
            r = b.to(tl.float32, bitcast=True).to(DT)
        else:
            r = x.to(DT)
    else:
        r = x.to(DT)
    return r


@triton.jit
def _dot32(a, b, TC: tl.constexpr = False):
    """a @ b of fp32 operands: exact fp32 on the FMA units, or with TC 3xTF32 on the tensor cores (about fp32
    accuracy, other bits)."""
    if TC:
        r = tl.dot(a, b, input_precision="tf32x3")
    else:
        r = tl.dot(a, b, input_precision="ieee")
    return r


@triton.jit
def _finite_rows(x, first, row0, xc=None):
    """The right operand x of a product C = M x with M lower triangular (causal), its rows that hold a NaN or an inf
    zeroed; and `first` lowered to the first such row (x's rows numbered from row0). Unzeroed, such a row j would
    reach every row of C through M's zeros above the diagonal (0 * NaN = 0 * inf = NaN), rows i < j included. Row i
    of C depends on x's rows <= i only, so C's rows before `first` are exact; `_nan_rows` marks the rest. The common
    case costs one sum (0 * x is 0 for a finite x: the sum is NaN iff x holds a NaN or an inf), of xc where given:
    the fp32 values x was rounded from (they die at the rounding; a value within 0.2 % of fp32's max that the
    rounding takes to inf is then not seen)."""
    if xc is None:
        xc = x
    first = tl.zeros([], dtype=tl.int32) + first
    if tl.sum(xc.to(tl.float32) * 0., axis=None) != 0.:
        bad = tl.sum(x.to(tl.float32) * 0., 1) != 0.
        rows = row0 + tl.arange(0, x.shape[0])
        first = tl.minimum(first, tl.min(tl.where(bad, rows, 2 ** 30), 0))
        x = tl.where(bad[:, None], tl.zeros_like(x), x)
    return x, first


@triton.jit
def _nan_rows(x, first, row0):
    """x with its rows (numbered from row0) from `first` on set to NaN (`_finite_rows`)."""
    rows = row0 + tl.arange(0, x.shape[0])
    return tl.where((rows >= first)[:, None], float("nan"), x)


@triton.jit
def _inv_unit_lower(L, TC: tl.constexpr = False):
    """(I + L)^-1 for a strictly lower-triangular 16 x 16 fp32 L: L is nilpotent (L^16 = 0), so
    (I + L)^-1 = (I - L)(I + L^2)(I + L^4)(I + L^8), six 16 x 16 matmuls (exact fp32, or 3xTF32 with TC:
    `_dot32`) instead of 14 dependent forward-substitution steps."""
    o = tl.arange(0, 16)
    eye = tl.where(o[:, None] == o[None, :], 1., 0.)
    L2 = _dot32(L, L, TC)
    L4 = _dot32(L2, L2, TC)
    L8 = _dot32(L4, L4, TC)
    Ai = _dot32(eye - L, eye + L2, TC)
    Ai = _dot32(Ai, eye + L4, TC)
    return _dot32(Ai, eye + L8, TC)


@triton.jit
def _store_a(A, rows, m, hv, HV, col: tl.constexpr, blk, BT: tl.constexpr, INTERPRET: tl.constexpr):
    o = tl.arange(0, 16)
    tl.store(A + rows[:, None] * (HV * BT) + hv * BT + col + o[None, :], _rnd(blk, A.dtype.element_ty, INTERPRET),
             mask=m[:, None])




@triton.jit
def _causal_store(b_A, b_x, out, rows, m, hv, HV, o, D: tl.constexpr, BT: tl.constexpr, DT: tl.constexpr,
                  INTERPRET: tl.constexpr):
    """out = A x on a chunk's rows ([T, HV, D] layout), A lower triangular and x fp32: x rounded to DT, its
    non-finite rows zeroed for the product and out's rows from the first of them on NaN (`_finite_rows`)."""
    b_xr, f = _finite_rows(_rnd(b_x, DT, INTERPRET), BT, 0, b_x)
    b_o = _dot(b_A, b_xr, INTERPRET)
    if f < BT:
        b_o = _nan_rows(b_o, f, 0)
    tl.store(out + rows[:, None] * (HV * D) + hv * D + o[None, :], _rnd(b_o, DT, INTERPRET), mask=m[:, None])

# ----------------------------------------------------------------------------------------------------------------
# The per-chunk kernels: one program per chunk slot (times SPLIT slices of K) on grid axis 0 and value head on axis 1.
# `table` maps a slot to (sequence, or -1 for an unused slot, where the kernel returns; chunk index). gdn's kernels
# read the slot's chunk index and document bounds before that check (through a clamped sequence index), kda's after.
@triton.jit
def _chunk_program(table, SPLIT: tl.constexpr):
    """A chunk kernel's program: (chunk slot p, its slice ik of SPLIT along K, value head hv, the slot's sequence n,
    -1 for an unused slot)."""
    pid = tl.program_id(0)
    hv = tl.program_id(1)
    p = pid // SPLIT
    ik = pid % SPLIT
    return p, ik, hv, tl.load(table + 2 * p)


@triton.jit
def _chunk_doc(table, se, p, n):
    """(chunk index of slot p, bos and eos of sequence n)."""
    ic = tl.load(table + 2 * p + 1).to(tl.int64)
    return ic, tl.load(se + 2 * n).to(tl.int64), tl.load(se + 2 * n + 1).to(tl.int64)


@triton.jit
def _chunk_rows(hv, ik, ic, bos, eos, H, HV, BK: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """A chunk program's tile: (key head hk, o_t, its slice ik of K (o_k, BK wide), o_v, the chunk's first row t0,
    its rows and their mask m)."""
    hk = hv // (HV // H)
    o_t = tl.arange(0, BT)
    o_k = ik * BK + tl.arange(0, BK)
    o_v = tl.arange(0, V)
    t0 = bos + ic * BT
    rows = t0 + o_t
    m = rows < eos
    return hk, o_t, o_k, o_v, t0, rows, m


# ----------------------------------------------------------------------------------------------------------------
# The sequential state kernels (forward h, reverse dh): one program per (sequence, value head) on grid axis 0 (the
# unbounded one) and BV-wide slice of V on axis 1, looping over the sequence's chunks. gdn's and kda's differ in the
# decay (a scalar or a [K] vector per token), not in their program ids, document bounds, state offsets, starting
# state and per-chunk state store, which these helpers hold.
@triton.jit
def _seq_program(se, H, HV, BT: tl.constexpr):
    """A state kernel's program: (its slice iv of V, sequence n, value head hv, key head hk, the document's bos and
    eos, its chunk count, its first chunk slot). The aranges stay in the kernels: built here, they compile to other
    code (the line info of an inlined helper's range splits ptxas's scheduling regions)."""
    iv = tl.program_id(1)
    pid = tl.program_id(0)
    n = pid // HV
    hv = pid % HV
    hk = hv // (HV // H)
    bos = tl.load(se + 2 * n).to(tl.int64)
    eos = tl.load(se + 2 * n + 1).to(tl.int64)
    nt = tl.cdiv(eos - bos, BT)
    slot0 = bos // BT + n
    return iv, n, hv, hk, bos, eos, nt, slot0


@triton.jit
def _state_offsets(n, hv, HV, o_k, o_v, K: tl.constexpr, V: tl.constexpr, TRANS_STATE: tl.constexpr):
    """[K, BV] offsets of an initial / final state: [N, HV, K, V], or [N, HV, V, K] with TRANS_STATE."""
    base = (n.to(tl.int64) * HV + hv) * (K * V)
    if TRANS_STATE:
        off = base + o_v[None, :] * K + o_k[:, None]
    else:
        off = base + o_k[:, None] * V + o_v[None, :]
    return off


@triton.jit
def _state_start(s0, n, hv, HV, o_k, o_v, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, USE_S0: tl.constexpr,
                 TRANS_STATE: tl.constexpr):
    """The offsets of the program's state slice in an initial / final state (`_state_offsets`) and the slice's
    starting value in fp32: s0's with USE_S0, else 0."""
    st_off = _state_offsets(n, hv, HV, o_k, o_v, K, V, TRANS_STATE)
    if USE_S0:
        b_s = tl.load(s0 + st_off).to(tl.float32)
    else:
        b_s = tl.zeros([K, BV], dtype=tl.float32)
    return st_off, b_s


@triton.jit
def _store_slot(h, slot, hv, HV, o_k, o_v, b_s, K: tl.constexpr, V: tl.constexpr, DT: tl.constexpr,
                INTERPRET: tl.constexpr):
    """A state slice, rounded to DT, into chunk slot `slot` of a per-chunk state array [P, HV, K, V]."""
    tl.store(h + (slot * HV + hv) * (K * V) + o_k[:, None] * V + o_v[None, :], _rnd(b_s, DT, INTERPRET))


# ----------------------------------------------------------------------------------------------------------------
@triton.jit
def _l2norm_rows(x, y, rows, SX, H, m, K: tl.constexpr, INTERPRET: tl.constexpr):
    o_k = tl.arange(0, K)
    b = tl.load(x + ((rows // H) * SX + (rows % H) * K)[:, None] + o_k[None, :], mask=m[:, None], other=0.)
    b = b.to(tl.float32)
    rstd = 1. / tl.sqrt(tl.sum(b * b, 1) + 1e-6)
    tl.store(y + rows[:, None] * K + o_k[None, :], _rnd((b * rstd[:, None]), y.dtype.element_ty, INTERPRET),
             mask=m[:, None])


@triton.jit(do_not_specialize=["R", "H"])
def l2norm_fwd_kernel(x, y, x2, y2, R, SX, SX2, H, K: tl.constexpr, BR: tl.constexpr, INTERPRET: tl.constexpr):
    """y = x / sqrt(sum(x^2) + 1e-6) per head (R rows of K: tokens x H heads); program axis 1 picks (x, y) or
    (x2, y2) (q and k in one launch). x's tokens are SX elements apart (SX2 for x2: views of a wider projection are
    read in place), y is contiguous."""
    rows = (tl.program_id(0) * BR + tl.arange(0, BR)).to(tl.int64)
    m = rows < R
    if tl.program_id(1) == 0:
        _l2norm_rows(x, y, rows, SX, H, m, K, INTERPRET)
    else:
        _l2norm_rows(x2, y2, rows, SX2, H, m, K, INTERPRET)


# ----------------------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=["R", "H", "HV"])
def bwd_final_kernel(x, dxv, dx, R, SX, H, HV, K: tl.constexpr, BR: tl.constexpr, L2: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """dx[t, h] = sum over the value heads of key head h (fixed order), then back through the L2 norm of x (its
    tokens SX elements apart; dx contiguous)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    hh = tl.program_id(1)
    m = rows < R
    o_k = tl.arange(0, K)
    grp = HV // H
    rows64 = rows.to(tl.int64)
    acc = tl.zeros([BR, K], dtype=tl.float32)
    for r in range(0, grp):
        acc += tl.load(dxv + rows64[:, None] * (HV * K) + (hh * grp + r) * K + o_k[None, :], mask=m[:, None],
                       other=0.).to(tl.float32)
    if L2:
        b_x = tl.load(x + rows64[:, None] * SX + hh * K + o_k[None, :], mask=m[:, None], other=0.).to(tl.float32)
        rstd = 1. / tl.sqrt(tl.sum(b_x * b_x, 1) + 1e-6)
        b_y = b_x * rstd[:, None]
        acc = (acc - b_y * tl.sum(b_y * acc, 1)[:, None]) * rstd[:, None]
    tl.store(dx + rows64[:, None] * (H * K) + hh * K + o_k[None, :], _rnd(acc, dx.dtype.element_ty, INTERPRET),
             mask=m[:, None])
