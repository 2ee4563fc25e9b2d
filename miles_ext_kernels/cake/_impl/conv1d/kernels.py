"""Triton kernels of conv1d: causal depthwise conv (width W <= 4) over packed documents, + SiLU.

Layout of the work: a program owns BLOCK_D channels and CHUNK consecutive tokens and walks its tokens one row at
a time, carrying the last W-1 input rows in registers (a sliding window), so every input byte is read once from
memory. Rows are loaded ROWS (4 or 8) at a time ahead of the arithmetic, to keep loads in flight.

Documents: a program finds the document of its first token with a binary search over cu_seqlens (scalar loads, no
host sync), then tracks the next document start as it walks; at a start it clears the window (and, in the
backward, finishes the rows of the previous document). HAS_CU=False (one document) drops all of that.

Tap names: c_k multiplies x[t - k], i.e. c_k = weight[d, W - 1 - k].

Initial state (HALO=True): each document n has W-1 rows before its start, h[n, d, W - k] = x[start - k] for k in
1..W-1 (fla's [N, D, W] layout; entry 0 is not read). The window reads them instead of zeros: when a program starts
within W-1 rows of its document's start, and at every document start it crosses. Rows past the last document
(padding) have none. HALO=False compiles none of it.

Backward, per row u (ascending): g[u] = dy[u] * act'(pre[u]) with pre[u] recomputed from the x window;
dw_k += g[u] * x[u - k]; row u - k of dx receives c_k * g[u]; the W-1 open dx rows are carried as partial sums and
row u - W + 1 is complete (stored) after row u. Programs walk W-1 rows past their chunk (lookahead) to complete
their last rows. dw partials are per (token block, tap, channel), reduced in a fixed order by `dw_reduce_kernel` (both
variants: fp32 atomics into [D, W] measured slower on the H200, 256-way contention per address).
With HALO the same open rows, run back before a document's start, are the initial state's gradient: the program
whose chunk holds the start stores them into dh (zeroed by the launcher, so documents no program enters, the empty
ones, keep 0), each entry once, summed in row order: no atomics, the same bits every run.

Runtime sizes are `do_not_specialize` so the set of compiled specializations is finite. D and the row strides are
passed divided by ALIGN (8 when they allow it) so the compiler sees 16-byte aligned rows and vectorizes.
"""
import triton
import triton.language as tl

from ..._runtime.build import INTERPRET

# Device helpers. Under the interpreter they stay plain Python functions: it re-patches triton.language on every
# call of a jitted helper (milliseconds each), which would dominate the CPU tests' time.
_helper = (lambda fn: fn) if INTERPRET else triton.jit


# On the GPU: sigmoid from the approximate MUFU ops (ex2.approx.ftz, rcp.approx.ftz; ~2 ulp, a few instructions
# instead of ~14 for expf + IEEE division). The interpreter cannot run inline PTX: exact formula there.
_FAST_SIGMOID = tl.constexpr(not INTERPRET)


@_helper
def _sigmoid(x, FAST: tl.constexpr):
    if FAST:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * -1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + e],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / (1.0 + tl.exp(-x))


@_helper
def _seg_init(cu_ptr, t0, n_seq, n_iter):
    """Document of token t0: (start, next start, index j), j the largest index with cu[j] <= t0. The start is clamped
    into [0, t0] (valid boundaries already are), so whatever cu holds no row before 0 is read and every row of the
    program's chunk is written."""
    lo = n_seq * 0
    hi = n_seq
    for _ in range(n_iter):
        mid = (lo + hi + 1) // 2
        v = tl.load(cu_ptr + mid)
        take = v <= t0
        lo = tl.where(take, mid, lo)
        hi = tl.where(take, hi, mid - 1)
    ss = tl.minimum(tl.maximum(tl.load(cu_ptr + lo).to(tl.int64), 0), t0)
    nb = tl.load(cu_ptr + lo + 1, mask=lo < n_seq, other=2147483647).to(tl.int64)
    return ss, nb, lo


@_helper
def _next_start(cu_ptr, u, j, n_seq):
    """After crossing a document start at row u: the index of u's document and the next start (skips empties)."""
    j = j + 1
    nb = tl.load(cu_ptr + j + 1, mask=j < n_seq, other=2147483647).to(tl.int64)
    while nb <= u:
        j = j + 1
        nb = tl.load(cu_ptr + j + 1, mask=j < n_seq, other=2147483647).to(tl.int64)
    return nb, j


@_helper
def _m(dm, cond):
    """Channel mask `dm` and a scalar condition (a select: the interpreter mistypes bool-vector & bool-scalar)."""
    return tl.where(cond, dm, False)


@_helper
def _row(ptr, u, stride, d, mask):
    return tl.load(ptr + u * stride + d, mask=mask, other=0.0).to(tl.float32)


@_helper
def _halo(h_ptr, j, i, d, dm, D, W: tl.constexpr, ok):
    """Entry i (1..W-1: row i - W before the start) of document j's initial state, channels d; 0 unless `ok`."""
    return tl.load(h_ptr + (j.to(tl.int64) * D + d) * W + i, mask=_m(dm, ok), other=0.0).to(tl.float32)


@_helper
def _put_halo(dh_ptr, j, i, val, d, dm, D, W: tl.constexpr, ok):
    """Store `val` as entry i of document j's initial-state gradient where `ok` and 1 <= i <= W-1."""
    tl.store(dh_ptr + (j.to(tl.int64) * D + d) * W + i, val.to(dh_ptr.dtype.element_ty),
             mask=_m(dm, ok & (i >= 1) & (i < W)))


@_helper
def _win(x_ptr, h_ptr, t, ss, j, sx, d, dm, D, n_seq, W: tl.constexpr, HALO: tl.constexpr):
    """Row t of the window of the document that starts at ss (index j): x from ss on; before it the document's
    initial state (HALO) or zeros. t >= ss - W + 1, as the programs start at or after their document's start."""
    xr = _row(x_ptr, t, sx, d, _m(dm, t >= ss))
    if HALO:
        hr = _halo(h_ptr, j, t - ss + W, d, dm, D, W, (t < ss) & (t - ss + W >= 1) & (j < n_seq))
        xr = tl.where(t >= ss, xr, hr)
    return xr


@_helper
def _raw(ptr, u, stride, d, mask):
    """A row in its storage dtype (converted where used: half the registers while the load is in flight)."""
    return tl.load(ptr + u * stride + d, mask=mask, other=0.0)


@_helper
def _halo_window(h_ptr, j, xm2, xm3, d, dm, D, n_seq, W: tl.constexpr):
    """(xm1, xm2, xm3) at the start of document j: its initial state's rows -1, -2, -3 (xm2 / xm3 kept, i.e. 0,
    where W leaves them unused)."""
    ok = j < n_seq
    xm1 = _halo(h_ptr, j, W - 1, d, dm, D, W, ok)
    if W >= 3:
        xm2 = _halo(h_ptr, j, W - 2, d, dm, D, W, ok)
    if W >= 4:
        xm3 = _halo(h_ptr, j, W - 3, d, dm, D, W, ok)
    return xm1, xm2, xm3


@_helper
def _preact(xu, xm1, xm2, xm3, c0, c1, c2, c3, W: tl.constexpr):
    """The pre-activation c0 x[u] + c1 x[u-1] (+ c2 x[u-2] + c3 x[u-3]) as a fixed chain of fmas. Written as a sum
    of products, the compiler chose per specialization which product each fma absorbed (with and without an initial
    state it chose differently), so the two rounded 1 ulp apart where a value lay at a bf16 rounding midpoint, and
    the backward's SiLU' at the bf16-rounded pre-activation moved a whole bf16 step (bench/NOTES.md, conv1d)."""
    acc = tl.fma(c1, xm1, c0 * xu)
    if W >= 3:
        acc = tl.fma(c2, xm2, acc)
    if W >= 4:
        acc = tl.fma(c3, xm3, acc)
    return acc


@_helper
def _fwd_step(u, xu, xm1, xm2, xm3, c0, c1, c2, c3, nb, j, cu_ptr, n_seq, y_ptr, sy, d, dm, T, h_ptr, D,
              W: tl.constexpr, ACT: tl.constexpr, HAS_CU: tl.constexpr, HALO: tl.constexpr):
    xu = xu.to(tl.float32)
    if HAS_CU:
        if u >= nb:  # u starts a document: rows before it do not count (or are its initial state)
            xm1 = tl.zeros_like(xm1)
            xm2 = tl.zeros_like(xm2)
            xm3 = tl.zeros_like(xm3)
            nb, j = _next_start(cu_ptr, u, j, n_seq)
            if HALO:
                xm1, xm2, xm3 = _halo_window(h_ptr, j, xm2, xm3, d, dm, D, n_seq, W)
    acc = _preact(xu, xm1, xm2, xm3, c0, c1, c2, c3, W)
    if ACT:
        acc = acc * _sigmoid(acc, _FAST_SIGMOID)
    tl.store(y_ptr + u * sy + d, acc.to(y_ptr.dtype.element_ty), mask=_m(dm, u < T))
    return xu, xm1, xm2, nb, j


@triton.jit(do_not_specialize=["T", "D_a", "sx_a", "sy_a", "n_seq", "n_iter"])
def conv1d_fwd_kernel(x_ptr, w_ptr, y_ptr, cu_ptr, h_ptr, T, D_a, sx_a, sy_a, n_seq, n_iter,
                      W: tl.constexpr, ACT: tl.constexpr, HAS_CU: tl.constexpr, HALO: tl.constexpr,
                      ALIGN: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """h_ptr: the initial state [n_seq, D, W] (HALO; n_seq 1 without cu_seqlens)."""
    t0 = tl.program_id(0).to(tl.int64) * CHUNK
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    D = D_a * ALIGN
    sx = sx_a * ALIGN
    sy = sy_a * ALIGN
    dm = d < D
    c0 = tl.load(w_ptr + d * W + (W - 1), mask=dm, other=0.0).to(tl.float32)
    c1 = tl.load(w_ptr + d * W + (W - 2), mask=dm, other=0.0).to(tl.float32)
    c2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    c3 = tl.zeros([BLOCK_D], dtype=tl.float32)
    if W >= 3:
        c2 = tl.load(w_ptr + d * W + (W - 3), mask=dm, other=0.0).to(tl.float32)
    if W >= 4:
        c3 = tl.load(w_ptr + d * W + (W - 4), mask=dm, other=0.0).to(tl.float32)
    if HAS_CU:
        ss, nb, j = _seg_init(cu_ptr, t0, n_seq, n_iter)
    else:
        ss = t0 * 0
        nb = t0 * 0
        j = tl.program_id(1) * 0
    xm1 = _win(x_ptr, h_ptr, t0 - 1, ss, j, sx, d, dm, D, n_seq, W, HALO)
    xm2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    xm3 = tl.zeros([BLOCK_D], dtype=tl.float32)
    if W >= 3:
        xm2 = _win(x_ptr, h_ptr, t0 - 2, ss, j, sx, d, dm, D, n_seq, W, HALO)
    if W >= 4:
        xm3 = _win(x_ptr, h_ptr, t0 - 3, ss, j, sx, d, dm, D, n_seq, W, HALO)
    for r in range(0, CHUNK, ROWS):
        u = t0 + r
        xa = _raw(x_ptr, u, sx, d, _m(dm, u < T))
        xb = _raw(x_ptr, u + 1, sx, d, _m(dm, u + 1 < T))
        xc = _raw(x_ptr, u + 2, sx, d, _m(dm, u + 2 < T))
        xd = _raw(x_ptr, u + 3, sx, d, _m(dm, u + 3 < T))
        if ROWS == 8:
            xe = _raw(x_ptr, u + 4, sx, d, _m(dm, u + 4 < T))
            xf = _raw(x_ptr, u + 5, sx, d, _m(dm, u + 5 < T))
            xg = _raw(x_ptr, u + 6, sx, d, _m(dm, u + 6 < T))
            xh = _raw(x_ptr, u + 7, sx, d, _m(dm, u + 7 < T))
        xm1, xm2, xm3, nb, j = _fwd_step(u, xa, xm1, xm2, xm3, c0, c1, c2, c3, nb, j, cu_ptr, n_seq,
                                         y_ptr, sy, d, dm, T, h_ptr, D, W, ACT, HAS_CU, HALO)
        xm1, xm2, xm3, nb, j = _fwd_step(u + 1, xb, xm1, xm2, xm3, c0, c1, c2, c3, nb, j, cu_ptr, n_seq,
                                         y_ptr, sy, d, dm, T, h_ptr, D, W, ACT, HAS_CU, HALO)
        xm1, xm2, xm3, nb, j = _fwd_step(u + 2, xc, xm1, xm2, xm3, c0, c1, c2, c3, nb, j, cu_ptr, n_seq,
                                         y_ptr, sy, d, dm, T, h_ptr, D, W, ACT, HAS_CU, HALO)
        xm1, xm2, xm3, nb, j = _fwd_step(u + 3, xd, xm1, xm2, xm3, c0, c1, c2, c3, nb, j, cu_ptr, n_seq,
                                         y_ptr, sy, d, dm, T, h_ptr, D, W, ACT, HAS_CU, HALO)
        if ROWS == 8:
            xm1, xm2, xm3, nb, j = _fwd_step(u + 4, xe, xm1, xm2, xm3, c0, c1, c2, c3, nb, j, cu_ptr, n_seq,
                                             y_ptr, sy, d, dm, T, h_ptr, D, W, ACT, HAS_CU, HALO)
            xm1, xm2, xm3, nb, j = _fwd_step(u + 5, xf, xm1, xm2, xm3, c0, c1, c2, c3, nb, j, cu_ptr, n_seq,
                                             y_ptr, sy, d, dm, T, h_ptr, D, W, ACT, HAS_CU, HALO)
            xm1, xm2, xm3, nb, j = _fwd_step(u + 6, xg, xm1, xm2, xm3, c0, c1, c2, c3, nb, j, cu_ptr, n_seq,
                                             y_ptr, sy, d, dm, T, h_ptr, D, W, ACT, HAS_CU, HALO)
            xm1, xm2, xm3, nb, j = _fwd_step(u + 7, xh, xm1, xm2, xm3, c0, c1, c2, c3, nb, j, cu_ptr, n_seq,
                                             y_ptr, sy, d, dm, T, h_ptr, D, W, ACT, HAS_CU, HALO)


@_helper
def _bwd_step(u, xu, dyu, xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, c0, c1, c2, c3, ss, nb, j,
              cu_ptr, n_seq, dx_ptr, sdx, d, dm, t0, hi, h_ptr, dh_ptr, D,
              W: tl.constexpr, ACT: tl.constexpr, HAS_CU: tl.constexpr, HALO: tl.constexpr, ACC_DW: tl.constexpr):
    xu = xu.to(tl.float32)
    dyu = dyu.to(tl.float32)
    if HALO:  # this program stores the initial-state gradient of the document that starts at ss
        own = (ss >= t0) & (ss < hi) & (j < n_seq)
    if HAS_CU:
        if u >= nb:  # u starts a document: the open dx rows of the previous one are complete
            if HALO:  # those before its start are its initial state's (a document shorter than W-1 rows)
                _put_halo(dh_ptr, j, u - 1 - ss + W, pa1, d, dm, D, W, own & (u - 1 < ss))
                if W >= 3:
                    _put_halo(dh_ptr, j, u - 2 - ss + W, pa2, d, dm, D, W, own & (u - 2 < ss))
                if W >= 4:
                    _put_halo(dh_ptr, j, u - 3 - ss + W, pa3, d, dm, D, W, own & (u - 3 < ss))
            lo = tl.maximum(ss, t0)
            tl.store(dx_ptr + (u - 1) * sdx + d, pa1.to(dx_ptr.dtype.element_ty),
                     mask=_m(dm, (u - 1 >= lo) & (u - 1 < hi)))
            if W >= 3:
                tl.store(dx_ptr + (u - 2) * sdx + d, pa2.to(dx_ptr.dtype.element_ty),
                         mask=_m(dm, (u - 2 >= lo) & (u - 2 < hi)))
            if W >= 4:
                tl.store(dx_ptr + (u - 3) * sdx + d, pa3.to(dx_ptr.dtype.element_ty),
                         mask=_m(dm, (u - 3 >= lo) & (u - 3 < hi)))
            pa1 = tl.zeros_like(pa1)
            pa2 = tl.zeros_like(pa2)
            pa3 = tl.zeros_like(pa3)
            xm1 = tl.zeros_like(xm1)
            xm2 = tl.zeros_like(xm2)
            xm3 = tl.zeros_like(xm3)
            ss = u
            nb, j = _next_start(cu_ptr, u, j, n_seq)
            if HALO:
                xm1, xm2, xm3 = _halo_window(h_ptr, j, xm2, xm3, d, dm, D, n_seq, W)
                own = (ss < hi) & (j < n_seq)
    if ACT == 0:
        g = dyu
    else:
        pre = _preact(xu, xm1, xm2, xm3, c0, c1, c2, c3, W)
        if ACT == 1:  # SiLU' at the pre-activation rounded to bf16
            pre = pre.to(tl.bfloat16).to(tl.float32)
        s = _sigmoid(pre, _FAST_SIGMOID)
        g = dyu * (s * (1.0 + pre * (1.0 - s)))
    if ACC_DW:
        dw0 += g * xu
        dw1 += g * xm1
        if W >= 3:
            dw2 += g * xm2
        if W >= 4:
            dw3 += g * xm3
    if W == 4:
        fin = pa3 + c3 * g
        pa3 = pa2 + c2 * g
        pa2 = pa1 + c1 * g
    elif W == 3:
        fin = pa2 + c2 * g
        pa2 = pa1 + c1 * g
    else:
        fin = pa1 + c1 * g
    pa1 = c0 * g
    r = u - (W - 1)
    if HAS_CU:
        lo = tl.maximum(ss, t0)
    else:
        lo = t0
    tl.store(dx_ptr + r * sdx + d, fin.to(dx_ptr.dtype.element_ty), mask=_m(dm, (r >= lo) & (r < hi)))
    if HALO:
        _put_halo(dh_ptr, j, r - ss + W, fin, d, dm, D, W, own & (r < ss))
    return xu, xm1, xm2, pa1, pa2, pa3, dw0, dw1, dw2, dw3, ss, nb, j


@triton.jit(do_not_specialize=["T", "D_a", "sx_a", "sdy_a", "sdx_a", "Dp_a", "n_seq", "n_iter"])
def conv1d_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, cu_ptr, h_ptr, dh_ptr, T, D_a, sx_a, sdy_a, sdx_a, Dp_a,
                      n_seq, n_iter, W: tl.constexpr, ACT: tl.constexpr, HAS_CU: tl.constexpr, HALO: tl.constexpr,
                      ALIGN: tl.constexpr, BLOCK_D: tl.constexpr, CHUNK: tl.constexpr, ROWS: tl.constexpr):
    """ACT: 0 none, 1 SiLU (SiLU' at the bf16-rounded pre-activation), 2 SiLU (exact fp32 pre-activation).
    dw_ptr: fp32 partials [n_blocks, W, Dp] (one row of W x Dp per token block), reduced by dw_reduce_kernel.
    h_ptr / dh_ptr (HALO): the initial state and its gradient, [n_seq, D, W] (n_seq 1 without cu_seqlens); dh_ptr
    zeroed."""
    pid_t = tl.program_id(0)
    t0 = pid_t.to(tl.int64) * CHUNK
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    D = D_a * ALIGN
    sx = sx_a * ALIGN
    sdy = sdy_a * ALIGN
    sdx = sdx_a * ALIGN
    dm = d < D
    hi = tl.minimum(t0 + CHUNK, T)
    c0 = tl.load(w_ptr + d * W + (W - 1), mask=dm, other=0.0).to(tl.float32)
    c1 = tl.load(w_ptr + d * W + (W - 2), mask=dm, other=0.0).to(tl.float32)
    c2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    c3 = tl.zeros([BLOCK_D], dtype=tl.float32)
    if W >= 3:
        c2 = tl.load(w_ptr + d * W + (W - 3), mask=dm, other=0.0).to(tl.float32)
    if W >= 4:
        c3 = tl.load(w_ptr + d * W + (W - 4), mask=dm, other=0.0).to(tl.float32)
    if HAS_CU:
        ss, nb, j = _seg_init(cu_ptr, t0, n_seq, n_iter)
    else:
        ss = t0 * 0
        nb = t0 * 0
        j = tl.program_id(1) * 0
    xm1 = _win(x_ptr, h_ptr, t0 - 1, ss, j, sx, d, dm, D, n_seq, W, HALO)
    xm2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    xm3 = tl.zeros([BLOCK_D], dtype=tl.float32)
    if W >= 3:
        xm2 = _win(x_ptr, h_ptr, t0 - 2, ss, j, sx, d, dm, D, n_seq, W, HALO)
    if W >= 4:
        xm3 = _win(x_ptr, h_ptr, t0 - 3, ss, j, sx, d, dm, D, n_seq, W, HALO)
    pa1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    pa2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    pa3 = tl.zeros([BLOCK_D], dtype=tl.float32)
    dw0 = tl.zeros([BLOCK_D], dtype=tl.float32)
    dw1 = tl.zeros([BLOCK_D], dtype=tl.float32)
    dw2 = tl.zeros([BLOCK_D], dtype=tl.float32)
    dw3 = tl.zeros([BLOCK_D], dtype=tl.float32)
    for r in range(0, CHUNK, ROWS):
        u = t0 + r
        xa = _raw(x_ptr, u, sx, d, _m(dm, u < T))
        xb = _raw(x_ptr, u + 1, sx, d, _m(dm, u + 1 < T))
        xc = _raw(x_ptr, u + 2, sx, d, _m(dm, u + 2 < T))
        xd = _raw(x_ptr, u + 3, sx, d, _m(dm, u + 3 < T))
        ga = _raw(dy_ptr, u, sdy, d, _m(dm, u < T))
        gb = _raw(dy_ptr, u + 1, sdy, d, _m(dm, u + 1 < T))
        gc = _raw(dy_ptr, u + 2, sdy, d, _m(dm, u + 2 < T))
        gd = _raw(dy_ptr, u + 3, sdy, d, _m(dm, u + 3 < T))
        if ROWS == 8:
            xe = _raw(x_ptr, u + 4, sx, d, _m(dm, u + 4 < T))
            xf = _raw(x_ptr, u + 5, sx, d, _m(dm, u + 5 < T))
            xg = _raw(x_ptr, u + 6, sx, d, _m(dm, u + 6 < T))
            xh = _raw(x_ptr, u + 7, sx, d, _m(dm, u + 7 < T))
            ge = _raw(dy_ptr, u + 4, sdy, d, _m(dm, u + 4 < T))
            gf = _raw(dy_ptr, u + 5, sdy, d, _m(dm, u + 5 < T))
            gg = _raw(dy_ptr, u + 6, sdy, d, _m(dm, u + 6 < T))
            gh = _raw(dy_ptr, u + 7, sdy, d, _m(dm, u + 7 < T))
        xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, ss, nb, j = _bwd_step(
            u, xa, ga, xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, c0, c1, c2, c3, ss, nb, j,
            cu_ptr, n_seq, dx_ptr, sdx, d, dm, t0, hi, h_ptr, dh_ptr, D, W, ACT, HAS_CU, HALO, True)
        xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, ss, nb, j = _bwd_step(
            u + 1, xb, gb, xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, c0, c1, c2, c3, ss, nb, j,
            cu_ptr, n_seq, dx_ptr, sdx, d, dm, t0, hi, h_ptr, dh_ptr, D, W, ACT, HAS_CU, HALO, True)
        xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, ss, nb, j = _bwd_step(
            u + 2, xc, gc, xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, c0, c1, c2, c3, ss, nb, j,
            cu_ptr, n_seq, dx_ptr, sdx, d, dm, t0, hi, h_ptr, dh_ptr, D, W, ACT, HAS_CU, HALO, True)
        xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, ss, nb, j = _bwd_step(
            u + 3, xd, gd, xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, c0, c1, c2, c3, ss, nb, j,
            cu_ptr, n_seq, dx_ptr, sdx, d, dm, t0, hi, h_ptr, dh_ptr, D, W, ACT, HAS_CU, HALO, True)
        if ROWS == 8:
            xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, ss, nb, j = _bwd_step(
                u + 4, xe, ge, xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, c0, c1, c2, c3, ss, nb, j,
                cu_ptr, n_seq, dx_ptr, sdx, d, dm, t0, hi, h_ptr, dh_ptr, D, W, ACT, HAS_CU, HALO, True)
            xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, ss, nb, j = _bwd_step(
                u + 5, xf, gf, xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, c0, c1, c2, c3, ss, nb, j,
                cu_ptr, n_seq, dx_ptr, sdx, d, dm, t0, hi, h_ptr, dh_ptr, D, W, ACT, HAS_CU, HALO, True)
            xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, ss, nb, j = _bwd_step(
                u + 6, xg, gg, xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, c0, c1, c2, c3, ss, nb, j,
                cu_ptr, n_seq, dx_ptr, sdx, d, dm, t0, hi, h_ptr, dh_ptr, D, W, ACT, HAS_CU, HALO, True)
            xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, ss, nb, j = _bwd_step(
                u + 7, xh, gh, xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, c0, c1, c2, c3, ss, nb, j,
                cu_ptr, n_seq, dx_ptr, sdx, d, dm, t0, hi, h_ptr, dh_ptr, D, W, ACT, HAS_CU, HALO, True)
    # lookahead: W-1 rows past the chunk complete its last dx rows (no dw: those rows belong to the next block)
    for k in tl.static_range(W - 1):
        u = t0 + CHUNK + k
        xa = _raw(x_ptr, u, sx, d, _m(dm, u < T))
        ga = _raw(dy_ptr, u, sdy, d, _m(dm, u < T))
        xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, ss, nb, j = _bwd_step(
            u, xa, ga, xm1, xm2, xm3, pa1, pa2, pa3, dw0, dw1, dw2, dw3, c0, c1, c2, c3, ss, nb, j,
            cu_ptr, n_seq, dx_ptr, sdx, d, dm, t0, hi, h_ptr, dh_ptr, D, W, ACT, HAS_CU, HALO, False)
    Dp = Dp_a * 8
    base = dw_ptr + pid_t.to(tl.int64) * (W * Dp) + d
    tl.store(base + (W - 1) * Dp, dw0, mask=dm)
    tl.store(base + (W - 2) * Dp, dw1, mask=dm)
    if W >= 3:
        tl.store(base + (W - 3) * Dp, dw2, mask=dm)
    if W >= 4:
        tl.store(base + (W - 4) * Dp, dw3, mask=dm)


@triton.jit(do_not_specialize=["n_part", "D", "Dp_a"])
def dw_reduce_kernel(part_ptr, dw_ptr, n_part, D, Dp_a, W: tl.constexpr, BLOCK_P: tl.constexpr,
                     BLOCK_D: tl.constexpr):
    """dw[d, i] = sum over token blocks p of part[p, i, d], in a fixed order (a fixed-shape tile sum)."""
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    i = tl.program_id(1)
    Dp = Dp_a * 8
    dm = d < D
    p = tl.arange(0, BLOCK_P)
    acc = tl.zeros([BLOCK_P, BLOCK_D], dtype=tl.float32)
    for p0 in range(0, n_part, BLOCK_P):
        rows = (p0 + p).to(tl.int64)
        ptrs = part_ptr + (rows[:, None] * W + i) * Dp + d[None, :]
        acc += tl.load(ptrs, mask=(rows[:, None] < n_part) & dm[None, :], other=0.0)
    s = tl.sum(acc, axis=0)
    tl.store(dw_ptr + d * W + i, s.to(dw_ptr.dtype.element_ty), mask=dm)
