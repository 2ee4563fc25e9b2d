"""Triton kernels of `gqa`: packed causal GQA attention, head dim 256, forward and backward.

Work decomposition (all kernels): a *tile* is a block of rows that starts at a segment start (tiles never straddle
segments, so a document's bits do not depend on where it sits in the pack). `_tile_prefix_kernel` clamps
`cu_seqlens` into safe boundaries (which every other kernel reads) and turns them into the running count of tiles
per segment; a program finds its segment by a binary search over that
prefix, and programs past the last tile zero the padding rows (tokens past `cu_seqlens[-1]`).

Causal alignment is bottom-right per segment: query i of a segment with L_q queries and L_k keys sees keys
j <= i + (L_k - L_q). Each kernel runs ONE loop over blocks and computes the causal mask only for blocks on the
diagonal (a scalar branch): on triton 3.6 a second, unmasked loop doubled the pipeline's shared memory or spilled.

Non-finite V: in a masked key block P is 0 on the keys a row must not see, but 0 * NaN = 0 * inf = NaN, so a NaN or
an inf in V's row of a later key would reach every row of the block through P V, earlier rows included. The forward
(`_fwd_kernel`, or the Gluon one) does not look at V for it (its loop is unchanged); it gives the rows that came out
non-finite LSE NaN, and `_fwd_fix_kernel` (a persistent grid over LSE, launched after it) runs their tiles again
with V's non-finite entries zeroed in the masked blocks and the rows that see one set to NaN, rewriting out and
LSE. Rows that do not see a non-finite V row then have the bits they have without it; K needs nothing (its scores
are masked with a select).

Backward: `_bwd_dq_kernel` (per query tile and head, key blocks in order; also writes delta = rowsum(dO * O)), then
`_bwd_dkdv_kernel` (per key tile and kv head, the group's query heads in a fixed order). With S_ROWS the dK/dV
kernel computes S = Q K^T with 128 query rows as M (both warpgroups busy; a 64-row M is replicated across them)
and transposes bf16 P and dS for the dV / dK products. With PAIR a dK/dV program takes key tiles i and n-1-i of its
segment (even work per program: the launcher picks it per call where a model of the schedule predicts a shorter
tail); each tile is computed the same way, so the bits do not change. No kernel uses atomics (an atomic-dQ fast
variant measured slower on sm_90a: bench/NOTES.md, gqa), so det and fast run the same kernels.

Interpreter (CPU tests): bf16 arithmetic is wrong there, so under `INTERPRET` operands are upcast to fp32 after
the bf16 rounding the GPU path does, and the dots run in fp32.

Triton 3.6 on Hopper can miscompile `tl.trans` of a `tl.dot` result fed to another `tl.dot` at some block sizes
(see TRITON.md). The S_ROWS dK/dV path does transpose bf16 P and dS; at the shipped sm_90a config (BM 128, BN 64,
8 warps, 1 stage) its dQ/dK/dV match the FP64 reference within FA2's error on the GPU tests
(tests/cake/gqa/test_gqa_gpu.py), which guard it. Changing that config needs those tests re-run on the GPU. The
S^T path (S_ROWS=False, `_dkdv_block`) transposes only loaded tiles.
"""
import triton
import triton.language as tl

from ..._runtime.constants import LN2, LOG2E

# runtime ints and floats: never specialized, so the set of compiled routes is finite
_RUNTIME = ["sm_scale", "T_q", "T_k", "n_seg", "n_iter", "H_q", "H_kv", "group"]


@triton.jit
def _last_le(A, x, n, n_iter):
    """The last s < n with A[s] <= x, for a nondecreasing A with A[0] <= x: a binary search of n_iter halvings
    (n_iter >= log2(n))."""
    lo = x * 0
    hi = lo + n
    for _ in range(n_iter):
        mid = (lo + hi) // 2
        go = tl.load(A + mid) <= x
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    return lo


@triton.jit
def _find_tile(TS, CU_A, CU_B, t, n_seg, n_iter, REVERSE: tl.constexpr):
    """Segment s with TS[s] <= t < TS[s+1]; the tile's index within it (REVERSE: last tile first, which is the
    heaviest causal query tile), and the segment's start and length in CU_A and CU_B."""
    seg = _last_le(TS, t, n_seg, n_iter)
    first = tl.load(TS + seg)
    n_tiles = tl.load(TS + seg + 1) - first
    if REVERSE:
        local = n_tiles - 1 - (t - first)
    else:
        local = t - first
    a0 = tl.load(CU_A + seg)
    la = tl.load(CU_A + seg + 1) - a0
    b0 = tl.load(CU_B + seg)
    lb = tl.load(CU_B + seg + 1) - b0
    return local, a0, la, b0, lb


# ------------------------------------------------------------------------------------------------------------------
# forward
@triton.jit
def _finite_v(v, keep, nan_i):
    """V of a masked key block with its non-finite entries zeroed, and nan_i (0, or NaN for a row that must be NaN)
    with the rows that see such a V row (`keep` [BM, BN]) set to NaN. A non-finite V row in P V would otherwise reach
    every row of the block, the rows that mask its key out too (P = 0 there, and 0 * NaN = 0 * inf = NaN)."""
    fin = tl.abs(v.to(tl.float32)) < float("inf")
    bad_n = tl.max(tl.where(fin, 0, 1), 1)  # [BN]: the key's V row holds a NaN or an inf
    hit = tl.max(tl.where(keep, bad_n[None, :], 0), 1)  # [BM]: the row sees such a key
    return tl.where(fin, v, 0.0), tl.where(hit > 0, float("nan"), nan_i)


@triton.jit
def _kv_scores(q, k_ptrs, v_ptrs, n, offs_n, L_k, qk_scale, MASK: tl.constexpr, INTERPRET: tl.constexpr):
    """K and V of the key block at n (MASK: rows past L_k loaded as 0) and the scaled scores S = Q K^T [BM, BN]."""
    if MASK:
        kvalid = (n + offs_n) < L_k
        k = tl.load(k_ptrs, mask=kvalid[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=kvalid[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if INTERPRET:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v, tl.dot(q, tl.trans(k)) * qk_scale


@triton.jit
def _fwd_block(acc, l_i, m_i, nan_i, q, k_ptrs, v_ptrs, n, offs_m, offs_n, m0, offset, L_k, qk_scale,
               BN: tl.constexpr, MASK: tl.constexpr, DIAG_ONLY: tl.constexpr, SAFE: tl.constexpr,
               INTERPRET: tl.constexpr):
    k, v, s = _kv_scores(q, k_ptrs, v_ptrs, n, offs_n, L_k, qk_scale, MASK, INTERPRET)
    if MASK:
        if (n + BN > m0 + offset + 1) or (not DIAG_ONLY):  # DIAG_ONLY: mask only blocks on the diagonal
            keep = ((n + offs_n)[None, :] <= (m0 + offs_m)[:, None] + offset) & ((n + offs_n)[None, :] < L_k)
            s = tl.where(keep, s, float("-inf"))
            if SAFE:
                v, nan_i = _finite_v(v, keep, nan_i)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = m_new
    p = tl.math.exp2(s - m_use[:, None])
    alpha = tl.math.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, 1)
    pc = p.to(tl.bfloat16)
    if INTERPRET:
        pc = pc.to(tl.float32)
    acc = tl.dot(pc, v, acc * alpha[:, None])
    return acc, l_i, m_new, nan_i


@triton.jit
def _fwd_tile(Q, K, V, O, LSE, CU_Q, CU_K, TS, sm_scale, T_q, n_seg, n_iter, pid, H_q, group,
              sqt, sqh, skt, skh, svt, svh, sot, soh, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              DIAG_ONLY: tl.constexpr, SAFE: tl.constexpr, INTERPRET: tl.constexpr):
    """Out and LSE of program pid's query tile and head (pid < the tile count times H_q). Not SAFE: a row that came
    out non-finite gets LSE NaN, the mark `_fwd_fix_kernel` looks for (it runs the tile again and rewrites its LSE).
    SAFE: V's non-finite entries are zeroed in the masked key blocks and the rows that see one are NaN
    (`_finite_v`)."""
    h = pid % H_q
    t = pid // H_q
    hk = h // group
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    local, q0, L_q, k0, L_k = _find_tile(TS, CU_Q, CU_K, t, n_seg, n_iter, True)
    m0 = local * BM
    offset = L_k - L_q
    qk_scale = sm_scale * LOG2E
    rvalid = (m0 + offs_m) < L_q
    q_ptrs = Q + (q0 + m0).to(tl.int64) * sqt + h * sqh + (offs_m[:, None] * sqt + offs_d[None, :])
    q = tl.load(q_ptrs, mask=rvalid[:, None], other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    kbase = K + k0.to(tl.int64) * skt + hk * skh
    vbase = V + k0.to(tl.int64) * svt + hk * svh
    kT_ptrs = kbase + (offs_n[:, None] * skt + offs_d[None, :])
    v_ptrs = vbase + (offs_n[:, None] * svt + offs_d[None, :])
    acc = tl.zeros([BM, D], dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    nan_i = tl.zeros([BM], dtype=tl.float32)  # SAFE: NaN where the row sees a key whose V row is not finite
    hi = tl.maximum(tl.minimum(L_k, m0 + BM + offset), 0)
    # one masked loop: on triton 3.6 a second (unmasked) loop doubles the shared memory or spills registers
    for n in range(0, hi, BN):
        acc, l_i, m_i, nan_i = _fwd_block(acc, l_i, m_i, nan_i, q, kT_ptrs, v_ptrs, n, offs_m, offs_n, m0, offset,
                                          L_k, qk_scale, BN, True, DIAG_ONLY, SAFE, INTERPRET)
        kT_ptrs += BN * skt
        v_ptrs += BN * svt
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    if SAFE:
        out = acc / (l_safe + nan_i)[:, None]
    else:
        out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    if not SAFE:
        # a row sum is non-finite iff a term is (or finite terms overflow it: a needless second pass, same result)
        lse = tl.where(tl.abs(tl.sum(out, 1)) < float("inf"), lse, float("nan"))
    o_ptrs = O + (q0 + m0).to(tl.int64) * sot + h * soh + (offs_m[:, None] * sot + offs_d[None, :])
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=rvalid[:, None])
    tl.store(LSE + h.to(tl.int64) * T_q + q0 + m0 + offs_m, lse, mask=rvalid)


@triton.jit
def _program_tile(TS, n_seg, H):
    """This program's head and tile (a grid of tiles times H heads, heads inner), and the tile count TS[n_seg]:
    programs whose tile is past it zero the padding rows."""
    pid = tl.program_id(0)
    return pid % H, pid // H, tl.load(TS + n_seg)


@triton.jit(do_not_specialize=_RUNTIME)
def _fwd_kernel(Q, K, V, O, LSE, CU_Q, CU_K, TS,
                sm_scale, T_q, n_seg, n_iter, H_q, group,
                sqt, sqh, skt, skh, svt, svh, sot, soh,
                D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DIAG_ONLY: tl.constexpr,
                INTERPRET: tl.constexpr):
    """Out and LSE of one query tile and head; LSE NaN marks a row that came out non-finite (`_fwd_tile`)."""
    h, t, total = _program_tile(TS, n_seg, H_q)
    if t >= total:
        # padding rows past cu_seqlens_q[-1]: out 0, LSE -inf
        offs_m = tl.arange(0, BM)
        offs_d = tl.arange(0, D)
        rows = tl.load(CU_Q + n_seg) + (t - total) * BM + offs_m
        rmask = rows < T_q
        o_ptrs = O + rows.to(tl.int64)[:, None] * sot + h * soh + offs_d[None, :]
        tl.store(o_ptrs, tl.zeros([BM, D], dtype=O.dtype.element_ty), mask=rmask[:, None])
        tl.store(LSE + h.to(tl.int64) * T_q + rows, tl.full([BM], float("-inf"), tl.float32), mask=rmask)
    else:
        _fwd_tile(Q, K, V, O, LSE, CU_Q, CU_K, TS, sm_scale, T_q, n_seg, n_iter, tl.program_id(0), H_q, group, sqt,
                  sqh, skt, skh, svt, svh, sot, soh, D, BM, BN, DIAG_ONLY, False, INTERPRET)


@triton.jit(do_not_specialize=_RUNTIME)
def _fwd_fix_kernel(Q, K, V, O, LSE, CU_Q, CU_K, TS,
                    sm_scale, T_q, n_seg, n_iter, H_q, group,
                    sqt, sqh, skt, skh, svt, svh, sot, soh,
                    D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, DIAG_ONLY: tl.constexpr,
                    CH: tl.constexpr, INTERPRET: tl.constexpr):
    """The forward's tiles that came out with a non-finite row (LSE NaN, from `_fwd_kernel` or the Gluon forward)
    again, with non-finite V rows contained (`_fwd_tile` SAFE). In masked key blocks P is 0 on a key a row must not
    see, but 0 * NaN = NaN: a later token's NaN or inf in V would reach every row of its block, earlier ones too. The
    first pass does not look at V (no cost in its loop); its non-finite rows send their tiles here, and the rows that
    do not see a non-finite V row come out with the bits they have without it. A persistent grid reads LSE [H_q, T_q]
    in chunks of CH rows; a clean chunk costs one load."""
    offs = tl.arange(0, CH)
    n = H_q * T_q
    for c in range(tl.program_id(0) * CH, n, tl.num_programs(0) * CH):
        lse = tl.load(LSE + c + offs, mask=c + offs < n, other=0.0)
        if tl.max(tl.where(lse == lse, 0, 1), 0) > 0:
            done = -1  # the last tile run again (a tile's rows of one head are contiguous in LSE)
            for i in range(CH):
                r = c + i
                if r < n:
                    if tl.load(LSE + r) != tl.load(LSE + r):
                        h = r // T_q
                        row = r - h * T_q
                        # the segment holding the row: the last one whose start is <= row (empty ones share starts)
                        lo = _last_le(CU_Q, row, n_seg, n_iter)
                        first = tl.load(TS + lo)
                        n_tiles = tl.load(TS + lo + 1) - first
                        pid = (first + n_tiles - 1 - (row - tl.load(CU_Q + lo)) // BM) * H_q + h  # heaviest first
                        if pid != done:
                            _fwd_tile(Q, K, V, O, LSE, CU_Q, CU_K, TS, sm_scale, T_q, n_seg, n_iter, pid, H_q, group,
                                      sqt, sqh, skt, skh, svt, svh, sot, soh, D, BM, BN, DIAG_ONLY, True, INTERPRET)
                            done = pid


# ------------------------------------------------------------------------------------------------------------------
# backward: dQ per (query tile, query head), looping key blocks in order (no atomics)
@triton.jit
def _dq_block(dq, q, do, lse2, delta, k_ptrs, v_ptrs, n, offs_m, offs_n, m0, offset, L_k, qk_scale,
              BN: tl.constexpr, MASK: tl.constexpr, INTERPRET: tl.constexpr):
    k, v, s = _kv_scores(q, k_ptrs, v_ptrs, n, offs_n, L_k, qk_scale, MASK, INTERPRET)
    p = tl.math.exp2(s - lse2[:, None])
    if MASK:
        if n + BN > m0 + offset + 1:  # only blocks on the causal diagonal need the mask
            keep = ((n + offs_n)[None, :] <= (m0 + offs_m)[:, None] + offset) & ((n + offs_n)[None, :] < L_k)
            p = tl.where(keep, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    dsc = ds.to(tl.bfloat16)
    if INTERPRET:
        dsc = dsc.to(tl.float32)
    dq = tl.dot(dsc, k, dq)
    return dq


@triton.jit(do_not_specialize=_RUNTIME)
def _bwd_dq_kernel(Q, K, V, DO, O, LSE, DELTA, DQ, CU_Q, CU_K, TS,
                   sm_scale, T_q, n_seg, n_iter, H_q, group,
                   sqt, sqh, skt, skh, svt, svh, sdt, sdh, sot, soh, sdqt, sdqh,
                   D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, INTERPRET: tl.constexpr):
    """dQ of one query tile and head; also computes delta = rowsum(dO * O) of the tile and stores it for the dK/dV
    kernel, which runs after this one."""
    h, t, total = _program_tile(TS, n_seg, H_q)
    hk = h // group
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    if t >= total:
        rows = tl.load(CU_Q + n_seg) + (t - total) * BM + offs_m
        rmask = rows < T_q
        tl.store(DQ + rows.to(tl.int64)[:, None] * sdqt + h * sdqh + offs_d[None, :],
                 tl.zeros([BM, D], dtype=DQ.dtype.element_ty), mask=rmask[:, None])
    else:
        local, q0, L_q, k0, L_k = _find_tile(TS, CU_Q, CU_K, t, n_seg, n_iter, True)
        m0 = local * BM
        offset = L_k - L_q
        qk_scale = sm_scale * LOG2E
        rvalid = (m0 + offs_m) < L_q
        row0 = (q0 + m0).to(tl.int64)
        q = tl.load(Q + row0 * sqt + h * sqh + (offs_m[:, None] * sqt + offs_d[None, :]),
                    mask=rvalid[:, None], other=0.0)
        do = tl.load(DO + row0 * sdt + h * sdh + (offs_m[:, None] * sdt + offs_d[None, :]),
                     mask=rvalid[:, None], other=0.0)
        if INTERPRET:
            q = q.to(tl.float32)
            do = do.to(tl.float32)
        lse = tl.load(LSE + h.to(tl.int64) * T_q + q0 + m0 + offs_m, mask=rvalid, other=0.0)
        lse2 = lse * LOG2E
        lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # rows that see no key: P = 0
        o = tl.load(O + row0 * sot + h * soh + (offs_m[:, None] * sot + offs_d[None, :]), mask=rvalid[:, None],
                    other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + h.to(tl.int64) * T_q + q0 + m0 + offs_m, delta, mask=rvalid)
        k_ptrs = K + k0.to(tl.int64) * skt + hk * skh + (offs_n[:, None] * skt + offs_d[None, :])
        v_ptrs = V + k0.to(tl.int64) * svt + hk * svh + (offs_n[:, None] * svt + offs_d[None, :])
        dq = tl.zeros([BM, D], dtype=tl.float32)
        hi = tl.maximum(tl.minimum(L_k, m0 + BM + offset), 0)
        for n in range(0, hi, BN):
            dq = _dq_block(dq, q, do, lse2, delta, k_ptrs, v_ptrs, n, offs_m, offs_n, m0, offset, L_k, qk_scale,
                           BN, True, INTERPRET)
            k_ptrs += BN * skt
            v_ptrs += BN * svt
        dq = dq * sm_scale
        tl.store(DQ + row0 * sdqt + h * sdqh + (offs_m[:, None] * sdqt + offs_d[None, :]),
                 dq.to(DQ.dtype.element_ty), mask=rvalid[:, None])


# ------------------------------------------------------------------------------------------------------------------
# backward: dK, dV per (key tile, kv head), looping the group's query heads in a fixed order (no atomics)
@triton.jit
def _dkdv_block(dk, dv, k, v, Q, DO, LSE, DELTA, q_row0, h, m, offs_m, offs_n, offs_d, n0, offset, L_q,
                T_q, qk_scale, sqt, sqh, sdt, sdh, MASK: tl.constexpr, INTERPRET: tl.constexpr):
    rows = m + offs_m
    rel = (q_row0 + m).to(tl.int64)
    q_ptrs = Q + rel * sqt + h * sqh + (offs_m[:, None] * sqt + offs_d[None, :])
    do_ptrs = DO + rel * sdt + h * sdh + (offs_m[:, None] * sdt + offs_d[None, :])
    lse_ptrs = LSE + h.to(tl.int64) * T_q + q_row0 + rows
    dl_ptrs = DELTA + h.to(tl.int64) * T_q + q_row0 + rows
    if MASK:
        rvalid = rows < L_q
        q = tl.load(q_ptrs, mask=rvalid[:, None], other=0.0)
        do = tl.load(do_ptrs, mask=rvalid[:, None], other=0.0)
        lse = tl.load(lse_ptrs, mask=rvalid, other=0.0)
        delta = tl.load(dl_ptrs, mask=rvalid, other=0.0)
    else:
        q = tl.load(q_ptrs)
        do = tl.load(do_ptrs)
        lse = tl.load(lse_ptrs)
        delta = tl.load(dl_ptrs)
    if INTERPRET:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    lse2 = lse * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    sT = tl.dot(k, tl.trans(q)) * qk_scale  # [BN, BM]
    pT = tl.math.exp2(sT - lse2[None, :])
    if MASK:
        keep = (n0 + offs_n)[:, None] <= rows[None, :] + offset
        pT = tl.where(keep, pT, 0.0)
    pc = pT.to(tl.bfloat16)
    if INTERPRET:
        pc = pc.to(tl.float32)
    dv = tl.dot(pc, do, dv)
    dpT = tl.dot(v, tl.trans(do))
    dsT = pT * (dpT - delta[None, :])
    dsc = dsT.to(tl.bfloat16)
    if INTERPRET:
        dsc = dsc.to(tl.float32)
    dk = tl.dot(dsc, q, dk)
    return dk, dv


@triton.jit
def _dkdv_block_s(dk, dv, k, v, Q, DO, LSE, DELTA, q_row0, h, m, offs_m, offs_n, offs_d, n0, offset, L_q,
                  T_q, qk_scale, sqt, sqh, sdt, sdh, BN: tl.constexpr, INTERPRET: tl.constexpr):
    """Same as `_dkdv_block`, computing S = Q K^T with the query rows as the M dimension (a 128-row M fills both
    warpgroups) and transposing P and dS (bf16) for the dV / dK products."""
    rows = m + offs_m
    rel = (q_row0 + m).to(tl.int64)
    rvalid = rows < L_q
    q = tl.load(Q + rel * sqt + h * sqh + (offs_m[:, None] * sqt + offs_d[None, :]), mask=rvalid[:, None], other=0.0)
    lse = tl.load(LSE + h.to(tl.int64) * T_q + q_row0 + rows, mask=rvalid, other=0.0)
    if INTERPRET:
        q = q.to(tl.float32)
    s = tl.dot(q, tl.trans(k)) * qk_scale  # [BM, BN]
    # dO is loaded after S (the loop has one stage, so loads pass through registers): with both tiles loaded first,
    # 128 registers of them were live at once and the loop spilled more (dK/dV kernel -4 % on the H200)
    do = tl.load(DO + rel * sdt + h * sdh + (offs_m[:, None] * sdt + offs_d[None, :]), mask=rvalid[:, None],
                 other=0.0)
    delta = tl.load(DELTA + h.to(tl.int64) * T_q + q_row0 + rows, mask=rvalid, other=0.0)
    if INTERPRET:
        do = do.to(tl.float32)
    lse2 = lse * LOG2E
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    p = tl.math.exp2(s - lse2[:, None])
    if n0 + BN > m + offset + 1:  # only blocks on the causal diagonal need the mask
        keep = (n0 + offs_n)[None, :] <= rows[:, None] + offset
        p = tl.where(keep, p, 0.0)
    pc = p.to(tl.bfloat16)
    if INTERPRET:
        pc = pc.to(tl.float32)
    dv = tl.dot(tl.trans(pc), do, dv)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    dsc = ds.to(tl.bfloat16)
    if INTERPRET:
        dsc = dsc.to(tl.float32)
    dk = tl.dot(tl.trans(dsc), q, dk)
    return dk, dv


@triton.jit(do_not_specialize=_RUNTIME)
def _bwd_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, CU_Q, CU_K, TS,
                     sm_scale, T_q, T_k, n_seg, n_iter, H_kv, group,
                     sqt, sqh, skt, skh, svt, svh, sdt, sdh, sdkt, sdkh, sdvt, sdvh,
                     D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     S_ROWS: tl.constexpr, INTERPRET: tl.constexpr, PAIR: tl.constexpr = False):
    """dK, dV of key tiles of BN rows. PAIR: TS counts pairs of tiles (2 * BN rows) and a program computes key tiles
    i and n - 1 - i of its segment (n tiles): the first tiles see the most query blocks, the last the fewest, so
    programs of one segment get even work and no heavy tile starts last. A tile is computed the same way either way
    (same bits)."""
    pid = tl.program_id(0)
    hk = pid % H_kv
    t = pid // H_kv
    total = tl.load(TS + n_seg)
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    if t >= total:
        # padding rows past cu_seqlens_k[-1]: dK, dV 0 (PAIR: 2 * BN rows per program)
        for half in range(2 if PAIR else 1):
            rows = tl.load(CU_K + n_seg) + ((t - total) * (2 if PAIR else 1) + half) * BN + offs_n
            rmask = rows < T_k
            r64 = rows.to(tl.int64)
            tl.store(DK + r64[:, None] * sdkt + hk * sdkh + offs_d[None, :],
                     tl.zeros([BN, D], dtype=DK.dtype.element_ty), mask=rmask[:, None])
            tl.store(DV + r64[:, None] * sdvt + hk * sdvh + offs_d[None, :],
                     tl.zeros([BN, D], dtype=DV.dtype.element_ty), mask=rmask[:, None])
    else:
        # TS counts key tiles (PAIR: pairs): _find_tile's "a" is the key side here
        local, k0, L_k, q0, L_q = _find_tile(TS, CU_K, CU_Q, t, n_seg, n_iter, False)
        offset = L_k - L_q
        qk_scale = sm_scale * LOG2E
        if PAIR:
            n_kt = (L_k + BN - 1) // BN
            for which in range(tl.minimum(n_kt - 2 * local, 2)):  # 1 when the pair is the middle tile alone
                j = tl.where(which == 0, local, n_kt - 1 - local)
                _dkdv_tile(Q, K, V, DO, LSE, DELTA, DK, DV, j, k0, L_k, q0, L_q, hk, group, offset, qk_scale,
                           sm_scale, T_q, sqt, sqh, skt, skh, svt, svh, sdt, sdh, sdkt, sdkh, sdvt, sdvh,
                           offs_m, offs_n, offs_d, D, BM, BN, S_ROWS, INTERPRET)
        else:
            _dkdv_tile(Q, K, V, DO, LSE, DELTA, DK, DV, local, k0, L_k, q0, L_q, hk, group, offset, qk_scale,
                       sm_scale, T_q, sqt, sqh, skt, skh, svt, svh, sdt, sdh, sdkt, sdkh, sdvt, sdvh,
                       offs_m, offs_n, offs_d, D, BM, BN, S_ROWS, INTERPRET)


@triton.jit
def _dkdv_tile(Q, K, V, DO, LSE, DELTA, DK, DV, j, k0, L_k, q0, L_q, hk, group, offset, qk_scale, sm_scale, T_q,
               sqt, sqh, skt, skh, svt, svh, sdt, sdh, sdkt, sdkh, sdvt, sdvh, offs_m, offs_n, offs_d,
               D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, S_ROWS: tl.constexpr, INTERPRET: tl.constexpr):
    """dK, dV of key tile j (rows j * BN ...) of a segment: the group's query heads in order, query blocks in order."""
    n0 = j * BN
    kvalid = (n0 + offs_n) < L_k
    krow0 = (k0 + n0).to(tl.int64)
    k = tl.load(K + krow0 * skt + hk * skh + (offs_n[:, None] * skt + offs_d[None, :]), mask=kvalid[:, None],
                other=0.0)
    v = tl.load(V + krow0 * svt + hk * svh + (offs_n[:, None] * svt + offs_d[None, :]), mask=kvalid[:, None],
                other=0.0)
    if INTERPRET:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    dk = tl.zeros([BN, D], dtype=tl.float32)
    dv = tl.zeros([BN, D], dtype=tl.float32)
    # query blocks (aligned to the segment start) that see some key of the tile: [m_lo, L_q)
    m_lo = (tl.maximum(n0 - offset, 0) // BM) * BM
    for g in range(group):
        h = hk * group + g
        for m in range(m_lo, L_q, BM):
            if S_ROWS:
                dk, dv = _dkdv_block_s(dk, dv, k, v, Q, DO, LSE, DELTA, q0, h, m, offs_m, offs_n, offs_d,
                                       n0, offset, L_q, T_q, qk_scale, sqt, sqh, sdt, sdh, BN, INTERPRET)
            else:
                dk, dv = _dkdv_block(dk, dv, k, v, Q, DO, LSE, DELTA, q0, h, m, offs_m, offs_n, offs_d, n0,
                                     offset, L_q, T_q, qk_scale, sqt, sqh, sdt, sdh, True, INTERPRET)
    dk = dk * sm_scale
    tl.store(DK + krow0 * sdkt + hk * sdkh + (offs_n[:, None] * sdkt + offs_d[None, :]),
             dk.to(DK.dtype.element_ty), mask=kvalid[:, None])
    tl.store(DV + krow0 * sdvt + hk * sdvh + (offs_n[:, None] * sdvt + offs_d[None, :]),
             dv.to(DV.dtype.element_ty), mask=kvalid[:, None])
