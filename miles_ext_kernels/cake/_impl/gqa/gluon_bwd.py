"""Gluon backward passes of `gqa` for sm_90a (Hopper): TMA operands and asynchronous wgmma.

Both replace a Triton kernel of `kernels.py` for operands whose heads are contiguous within a token row (`ops`
routes the rest, and CPU runs, to the Triton kernels; Gluon has no interpreter). `dq_kernel` runs first and also
writes delta = rowsum(dO * O), which `dkdv_kernel` reads.

`dkdv_kernel`: one program = one BN-key tile of one segment and one kv head; steps = the group's query heads in order,
then query blocks of BM rows in order from the first block that sees a key of the tile. Three partitions that talk
through mbarriers (the Triton kernel gets one pipeline stage on triton 3.6, so its Q/dO loads are not overlapped with
its matmuls, and it waits every matmul at once):
- a loader warp: K and V once, then the Q and dO tiles of each step by TMA, two stages each (a stage is refilled once
  both warpgroups have released it);
- warpgroup 0 (default partition): S^T = K Q^T with the keys as the 64-row M (P^T is then already the A operand of
  dV += P^T dO: no transposes), P^T = exp2(S^T * scale * log2e - lse2) published in fp32 for warpgroup 1, then
  dV += P^T dO with P^T from registers. S^T of step i+1 is issued before dV of step i, and P^T of step i+1 is computed
  while dV of step i runs;
- warpgroup 1: dP^T = V dO^T, dS^T = P^T * (dP^T - delta) with warpgroup 0's P^T, dK += dS^T Q. dP^T of step i+1 is
  issued before dK of step i; dK is waited within its step and its Q stage released at once. Two measured causes of
  a slow pass (H200, bench/NOTES.md): carrying dK across steps as an asynchronous accumulator made ptxas serialize
  every wgmma of the kernel (its C7515 warning), and releasing a Q stage one step late left the loader unable to
  refill it until warpgroup 1 had formed the next dS^T, so warpgroup 0's next S^T waited for the load (together
  3.39 -> 2.15 ms at 16 x 2048, same bits).
Each warpgroup holds one fp32 [BN, D] accumulator (128 registers a thread at BN 64, D 256; dK and dV together would
not fit one warpgroup). Shared memory: K, V 64 KB + Q, dO 2 x 2 x 32 KB + P^T 2 x 16 KB = 224 KB (232 448 B allowed).
Query rows past L_q in a segment's last, partial block are loaded by TMA (they belong to the next segment or are
padding): warpgroup 0 zeroes them in shared memory before it publishes that step's P^T (dK and dV contract over query
rows, and 0 * NaN would not be 0), and their P^T and dS^T columns are set to 0. Key rows past L_k of a partial key
tile give rows of dK and dV that are never stored (rows do not mix).
A variant with the roles split by operand (warpgroup 0: S^T and dK, warpgroup 1: dP^T and dV, exchanging bf16 P^T
and fp32 dP^T) was no faster (measured before the two fixes above), and one that forms dS^T of step i+1 while dK of
step i runs within a two-step loop body spilled and was slower (2.88 ms).

`dq_kernel`: one program = one BM-row query tile and query head (128 rows at 8 warps, or for short documents 64 rows of
one warpgroup at 32-key blocks: 115 KB, two programs per SM); Q and dO resident, K double- and V single-buffered (224 KB
at 128 rows, 64-key blocks); S = Q K^T and dP = dO V^T issued back to back, P computed while dP runs; dQ += dS K is an
asynchronous accumulator, waited at the next step (after S and dP of that step are issued), so the tensor cores are not
idle while dS is formed (5 % faster than waiting at once, same bits; K's stage is refilled one step later); K and V rows
past the segment zeroed in shared memory (dQ += dS K contracts over keys). A warp-specialized dQ pass (one partition per
64-row warpgroup, as the forward) was 16 % slower: at 240 registers a thread the second warpgroup spilled and the single
V stage, released by both warpgroups, kept them in step.

Bits: fixed tiles that start at segment starts and a fixed order of steps, so dQ, dK and dV repeat bit for bit and
do not depend on the pack or on the launch order. dK and dV equal the Triton dK/dV kernel's bits: its 128-row query
blocks are 64-row blocks here, but the products contract over the same query rows in the same 16-row chunks and
order, and the extra rows the Triton kernel covers before the first block seen here are causally masked to exact
zeros (GPU test). dQ differs from the Triton dQ only through delta, reduced here 64 columns at a time in a blocked
layout (`_row_delta`).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_init,
    warpgroup_mma_wait,
)

from . import gluon_util as U
from . import kernels as K

_RUNTIME = ["sm_scale", "T_q", "T_k", "n_seg", "n_iter", "H_kv", "group", "n_kt_max"]  # never specialized


@gluon.jit
def _step(steps, i, BM: gl.constexpr):
    """Step i of a program: query head h and query block start m. `steps`: (hk, group, m_lo, n_m), the kv head, its
    query heads, and the first of the n_m query blocks each of them runs (heads outer, blocks inner: the Triton
    kernel's order, hence its bits. Blocks from the last down with heads inner, so that the programs of a segment
    read the same tiles at the same time, measured 11 % slower on the H200)."""
    hk, group, m_lo, n_m = steps
    g = i // n_m
    return hk * group + g, m_lo + (i - g * n_m) * BM


@gluon.jit
def _dkdv_loader(descs, kv, q_ring, do_ring, tile, steps, D: gl.constexpr, BM: gl.constexpr):
    """One warp: K and V of the tile, then Q and dO of every step into their rings (a stage is refilled once both
    warpgroups have released it)."""
    q_desc, k_desc, v_desc, do_desc = descs
    k_smem, v_smem, kv_bar = kv
    q_smem, q_ready, q_empty = q_ring
    do_smem, do_ready, do_empty = do_ring
    q0, k0, n0, L_q, L_k, offset = tile
    hk, group, m_lo, n_m = steps
    mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [k0 + n0, hk * D], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [k0 + n0, hk * D], kv_bar, v_smem)
    for i in range(group * n_m):
        s, phase = U.ring_slot(q_empty, i)  # (the Q and dO rings advance together)
        h, m = _step(steps, i, BM)
        mbarrier.wait(q_empty.index(s), phase ^ 1)
        mbarrier.expect(q_ready.index(s), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q0 + m, h * D], q_ready.index(s), q_smem.index(s))
        mbarrier.wait(do_empty.index(s), phase ^ 1)
        mbarrier.expect(do_ready.index(s), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [q0 + m, h * D], do_ready.index(s), do_smem.index(s))


@gluon.jit
def _query_vec(PTR, h, T_q, q0, m, L_q, BM: gl.constexpr, s_layout: gl.constexpr):
    """PTR[h, q0 + m + j] for the BM query columns j of a step (0 past the segment), in the column layout of an
    S^T tile. Loaded with one element per thread and converted: direct loads in the MMA column layout need 16
    64-bit pointers per thread, which spilled."""
    flat: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    j = gl.arange(0, BM, layout=flat)
    x = gl.load(PTR + h.to(gl.int64) * T_q + q0 + m + j, mask=(m + j) < L_q, other=0.0)
    return gl.convert_layout(x, gl.SliceLayout(0, s_layout))


@gluon.jit
def _p_tile(st, LSE, T_q, q0, h, m, n0, offset, L_q, qk_scale, BM: gl.constexpr, BN: gl.constexpr,
            s_layout: gl.constexpr):
    """P^T [BN keys, BM queries] of one step (fp32), zero where masked (causal, or query rows past the segment)."""
    offs_q = gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout))
    lse2 = _query_vec(LSE, h, T_q, q0, m, L_q, BM, s_layout) * 1.4426950408889634
    lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)  # rows that see no key: P = 0
    p = gl.exp2(st * qk_scale - lse2[None, :])
    # a `where`, never a product: the S^T columns of query rows past the segment may be NaN (warpgroup 0 issues S^T
    # right after zeroing those Q rows, and the padding rows themselves may hold anything)
    if (n0 + BN > m + offset + 1) or (m + BM > L_q):  # diagonal block, or the segment's last, partial block
        offs_k = gl.arange(0, BN, layout=gl.SliceLayout(1, s_layout))
        keep = ((n0 + offs_k)[:, None] <= (m + offs_q)[None, :] + offset) & ((m + offs_q) < L_q)[None, :]
        p = gl.where(keep, p, 0.0)
    return p


@gluon.jit
def _wait_q_do(q_ring, do_ring, stage, phase, m, L_q, BM: gl.constexpr, D: gl.constexpr):
    """Warpgroup 0, before S^T of a step: wait for its Q tile; on a segment's last, partial query block also for its
    dO tile, and zero the rows past the segment in both (fenced for the asynchronous readers)."""
    q_smem, q_ready, q_empty = q_ring
    do_smem, do_ready, do_empty = do_ring
    mbarrier.wait(q_ready.index(stage), phase)
    if m + BM > L_q:
        mbarrier.wait(do_ready.index(stage), phase)
        U.zero_rows_from(q_smem.index(stage), L_q - m, BM, D, 4)
        U.zero_rows_from(do_smem.index(stage), L_q - m, BM, D, 4)
        fence_async_shared()


@gluon.jit
def _publish_p(p, p_ring, stage, phase):
    """Warpgroup 0: P^T (fp32) into `stage` once warpgroup 1 has released it, then signal it (`stage`, `phase`: the
    use's `U.ring_slot`)."""
    p_smem, p_full, p_empty = p_ring
    mbarrier.wait(p_empty.index(stage), phase ^ 1)
    p_smem.index(stage).store(p)
    mbarrier.arrive(p_full.index(stage), count=1)


@gluon.jit
def _acc_issue(x, acc_ring, s, phase, acc):
    """acc += x acc_ring[s] (a ring's stage as the B operand) issued once that stage has landed; its token."""
    acc_smem, acc_ready, _ = acc_ring
    mbarrier.wait(acc_ready.index(s), phase)
    return warpgroup_mma(x, acc_smem.index(s), acc, is_async=True)


@gluon.jit
def _acc_done(acc_tok, x, acc_ring, s):
    """The accumulator of `_acc_issue`'s product, waited for (no group left outstanding); releases its stage."""
    _, _, acc_empty = acc_ring
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, x))[0]
    mbarrier.arrive(acc_empty.index(s), count=1)
    return acc


@gluon.jit
def _next_t_behind(a_smem, t_ring, ns, s_zero, x, acc_ring, s, phase, acc):
    """Step i + 1's transposed product T = A t_ring[ns]^T issued, then step i's accumulation acc += x acc_ring[s]
    (`_acc_issue`); waits for T alone (groups complete in order: the accumulation may still run) and releases
    t_ring's stage ns. Returns T and the accumulation's token."""
    t_smem, _, t_empty = t_ring
    t_tok = warpgroup_mma(a_smem, t_smem.index(ns).permute((1, 0)), s_zero, use_acc=False, is_async=True)
    acc_tok = _acc_issue(x, acc_ring, s, phase, acc)
    t = warpgroup_mma_wait(num_outstanding=1, deps=(t_tok, ))
    mbarrier.arrive(t_empty.index(ns), count=1)
    return t, acc_tok


@gluon.jit
def _s_dv_steps(kv, q_ring, do_ring, p_ring, tile, steps, LSE, T_q, qk_scale, dv, s_zero, n_steps, D: gl.constexpr,
                BM: gl.constexpr, BN: gl.constexpr, s_layout: gl.constexpr, a_layout: gl.constexpr):
    """Warpgroup 0's steps: S^T = K Q^T, P^T (fp32, published for warpgroup 1), dV += P^T dO. Also zeroes the Q and
    dO rows past the segment of a partial query block, before it publishes that step's P^T."""
    k_smem, v_smem, kv_bar = kv
    q_smem, q_ready, q_empty = q_ring
    q0, k0, n0, L_q, L_k, offset = tile
    mbarrier.wait(kv_bar, 0)
    if n_steps > 0:
        h, m = _step(steps, 0, BM)
        _wait_q_do(q_ring, do_ring, 0, 0, m, L_q, BM, D)  # use 0 of the rings: stage 0, phase 0
        st = warpgroup_mma(k_smem, q_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
        mbarrier.arrive(q_empty.index(0), count=1)
        p = _p_tile(st, LSE, T_q, q0, h, m, n0, offset, L_q, qk_scale, BM, BN, s_layout)
        _publish_p(p, p_ring, 0, 0)
        pa = gl.convert_layout(p.to(gl.bfloat16), a_layout)
        for i in range(n_steps):
            s, phase = U.ring_slot(q_ready, i)  # (all three rings advance together, one use a step)
            ns, nphase = U.ring_slot(q_ready, i + 1)
            if i + 1 < n_steps:
                h, m = _step(steps, i + 1, BM)
                _wait_q_do(q_ring, do_ring, ns, nphase, m, L_q, BM, D)
                # S^T_{i+1} done, dV_i may still run (P^T_{i+1} is computed meanwhile)
                st, dv_tok = _next_t_behind(k_smem, q_ring, ns, s_zero, pa, do_ring, s, phase, dv)
                p = _p_tile(st, LSE, T_q, q0, h, m, n0, offset, L_q, qk_scale, BM, BN, s_layout)
                _publish_p(p, p_ring, ns, nphase)
                dv = _acc_done(dv_tok, pa, do_ring, s)
                pa = gl.convert_layout(p.to(gl.bfloat16), a_layout)
            else:
                dv = _acc_done(_acc_issue(pa, do_ring, s, phase, dv), pa, do_ring, s)
    return dv


@gluon.jit
def _dp_dk_steps(kv, q_ring, do_ring, p_ring, tile, steps, DELTA, T_q, dk, s_zero, n_steps, BM: gl.constexpr,
                 s_layout: gl.constexpr, a_layout: gl.constexpr):
    """Warpgroup 1's steps: dP^T = V dO^T, dS^T = P^T * (dP^T - delta) with warpgroup 0's fp32 P^T, dK += dS^T Q.
    dK is waited within its step: an asynchronous accumulator carried across steps (warpgroup_mma_init) made ptxas
    serialize every wgmma of the kernel (C7515: "non wgmma instructions defining accumulator registers")."""
    k_smem, v_smem, kv_bar = kv
    do_smem, do_ready, do_empty = do_ring
    p_smem, p_full, p_empty = p_ring
    q0, k0, n0, L_q, L_k, offset = tile
    offs_q = gl.arange(0, BM, layout=gl.SliceLayout(0, s_layout))
    mbarrier.wait(kv_bar, 0)
    if n_steps > 0:
        mbarrier.wait(do_ready.index(0), 0)  # use 0 of the ring: stage 0, phase 0
        dpt = warpgroup_mma(v_smem, do_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt, ))
        mbarrier.arrive(do_empty.index(0), count=1)
        for i in range(n_steps):
            s, phase = U.ring_slot(do_ready, i)  # (all three rings advance together, one use a step)
            ns, nphase = U.ring_slot(do_ready, i + 1)
            h, m = _step(steps, i, BM)
            qvalid = (m + offs_q) < L_q
            delta = _query_vec(DELTA, h, T_q, q0, m, L_q, BM, s_layout)
            mbarrier.wait(p_full.index(s), phase)
            p = p_smem.index(s).load(s_layout)
            mbarrier.arrive(p_empty.index(s), count=1)
            # where, not a product: dP^T columns of query rows past the segment may come from rows warpgroup 0 is
            # zeroing (their P^T is 0, but 0 * NaN would not be)
            ds = gl.where(qvalid[None, :], p * (dpt - delta[None, :]), 0.0)
            dsa = gl.convert_layout(ds.to(gl.bfloat16), a_layout)
            if i + 1 < n_steps:
                mbarrier.wait(do_ready.index(ns), nphase)
                # dP^T_{i+1} done (its dO stage released), dK_i may still run
                dpt, dk_tok = _next_t_behind(v_smem, do_ring, ns, s_zero, dsa, q_ring, s, phase, dk)
            else:
                dk_tok = _acc_issue(dsa, q_ring, s, phase, dk)
            dk = _acc_done(dk_tok, dsa, q_ring, s)
    return dk


@gluon.jit
def _dkdv_wg(kv, q_ring, do_ring, p_ring, tile, steps, VEC, T_q, scale, out, D: gl.constexpr, BM: gl.constexpr,
             BN: gl.constexpr, DV_WG: gl.constexpr):
    """A compute warpgroup of the dK/dV pass and its fp32 [BN, D] accumulator: DV_WG, warpgroup 0 (`_s_dv_steps`, dV;
    VEC = LSE, scale = qk_scale), else warpgroup 1 (`_dp_dk_steps`, dK; VEC = DELTA, scale = sm_scale, dK's factor).
    `out`: (DV or DK, token stride, head stride); the result is staged for 16-byte row stores in the shared memory of
    the operand the warpgroup reads no more once its last product has completed (K for dV, V for dK)."""
    k_smem, v_smem, kv_bar = kv
    q0, k0, n0, L_q, L_k, offset = tile
    OUT, sot, soh = out
    hk, group, m_lo, n_m = steps
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    n_steps = group * n_m
    s_zero = gl.zeros([BN, BM], gl.float32, s_layout)
    acc = gl.zeros([BN, D], gl.float32, acc_layout)
    if DV_WG:
        acc = _s_dv_steps(kv, q_ring, do_ring, p_ring, tile, steps, VEC, T_q, scale, acc, s_zero, n_steps, D, BM, BN,
                          s_layout, a_layout)
        stage = k_smem
    else:
        acc = _dp_dk_steps(kv, q_ring, do_ring, p_ring, tile, steps, VEC, T_q, acc, s_zero, n_steps, BM, s_layout,
                           a_layout)
        stage = v_smem
        acc = acc * scale
    stage.store(acc.to(OUT.dtype.element_ty))
    gl.thread_barrier()
    U.store_rows(stage, OUT, k0 + n0, hk, sot, soh, L_k - n0, BN, D, 4)


@gluon.jit(do_not_specialize=_RUNTIME)
def dkdv_kernel(q_desc, k_desc, v_desc, do_desc, LSE, DELTA, DK, DV, CU_Q, CU_K, TS, sm_scale, T_q, T_k, n_seg,
                n_iter, H_kv, group, n_kt_max, sdkt, sdkh, sdvt, sdvh, D: gl.constexpr, BM: gl.constexpr,
                BN: gl.constexpr, num_warps: gl.constexpr):
    """dK, dV of one BN-key tile of one segment and one kv head. `num_warps` = 4 is the default partition; the CTA
    has 12 warps (4 + 4 + the loader warp, which takes a warpgroup of its own: registers are allotted per warpgroup).

    Programs, in launch order (the order never changes the bits):
    - n_kt_max * n_seg "round" programs (ROUND; n_kt_max = 0 otherwise): tile j of every segment before tile j + 1 of
      any, so that on equal documents the heaviest tiles of the last segments do not start last; a round past a
      segment's last tile does nothing;
    - one program per key tile, segment by segment (TS: tiles before each segment): with ROUND only the tiles no
      round covered do work (none, unless max_seqlen_k understated a segment: the result never depends on it);
    - programs past those zero the padding rows (tokens past cu_seqlens_k[-1])."""
    pid = gl.program_id(0)
    hk = pid % H_kv
    t = pid // H_kv
    n_round = n_kt_max * n_seg
    u = t - n_round
    total = gl.load(TS + n_seg)
    if u >= total:  # padding rows past cu_seqlens_k[-1]: dK, dV 0
        row0 = gl.load(CU_K + n_seg) + (u - total) * BN
        U.zero_rows(DK, row0, T_k, sdkt, sdkh, hk, BN, D, num_warps)
        U.zero_rows(DV, row0, T_k, sdvt, sdvh, hk, BN, D, num_warps)
    else:
        if t < n_round:
            seg = t % n_seg
            local = t // n_seg
            k0 = gl.load(CU_K + seg)
            L_k = gl.load(CU_K + seg + 1) - k0
            q0 = gl.load(CU_Q + seg)
            L_q = gl.load(CU_Q + seg + 1) - q0
        else:
            local, k0, L_k, q0, L_q = K._find_tile(TS, CU_K, CU_Q, u, n_seg, n_iter, False)
        n0 = local * BN
        offset = L_k - L_q
        # no work: a round past the segment's last tile, or a tile a round has computed
        idle = (n0 >= L_k) | ((t >= n_round) & (local < n_kt_max))
        L_k_out = gl.where(idle, n0, L_k)  # rows [n0, L_k_out) are stored: none when idle
        # query blocks (aligned to the segment start) that see some key of the tile: [m_lo, L_q)
        m_lo = (gl.maximum(n0 - offset, 0) // BM) * BM
        n_m = gl.maximum((L_q - m_lo + BM - 1) // BM, 0)
        n_m = gl.where(idle, 0, n_m)
        qk_scale = sm_scale * 1.4426950408889634

        k_smem = gl.allocate_shared_memory(k_desc.dtype, [BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [BN, D], v_desc.layout)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [2, BM, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [2, BM, D], do_desc.layout)
        p_smem = gl.allocate_shared_memory(gl.float32, [2, BN, BM],
                                           gl.SwizzledSharedLayout(vec=2, per_phase=1, max_phase=8, order=[1, 0]))
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        do_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        do_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        p_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(do_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # released by both warpgroups
            mbarrier.init(do_empty.index(i), count=2)
            mbarrier.init(p_full.index(i), count=1)
            mbarrier.init(p_empty.index(i), count=1)
        kv = (k_smem, v_smem, kv_bar)  # resident for the whole program, one barrier
        q_ring = (q_smem, q_ready, q_empty)
        do_ring = (do_smem, do_ready, do_empty)
        p_ring = (p_smem, p_full, p_empty)
        # the segment's first query and key, the tile's first key, the lengths (rows [n0, L_k_out) are stored)
        tile = (q0, k0, n0, L_q, L_k_out, offset)
        steps = (hk, group, m_lo, n_m)  # `_step`
        gl.warp_specialize([
            (_dkdv_wg, (kv, q_ring, do_ring, p_ring, tile, steps, LSE, T_q, qk_scale, (DV, sdvt, sdvh), D, BM, BN,
                        True)),
            (_dkdv_wg, (kv, q_ring, do_ring, p_ring, tile, steps, DELTA, T_q, sm_scale, (DK, sdkt, sdkh), D, BM, BN,
                        False)),
            (_dkdv_loader, ((q_desc, k_desc, v_desc, do_desc), kv, q_ring, do_ring, tile, steps, D, BM)),
        ], [4, 1], [240, 24])


# ------------------------------------------------------------------------------------------------------------------
@gluon.jit
def _row_delta(O, do_smem, row0, h, sot, soh, n_valid, ROWS: gl.constexpr, D: gl.constexpr, num_warps: gl.constexpr,
               out_layout: gl.constexpr):
    """rowsum(O * dO) (fp32 products of the bf16 values) of rows [0, n_valid) of a [ROWS, D] dO tile in shared memory
    and the rows O[row0 + r, h, :], 0 past n_valid; 64 columns at a time with 16-byte loads (loads of O in the MMA
    layout took one 2-byte load per element)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    d = gl.arange(0, 64, layout=gl.SliceLayout(0, layout))
    base = O + row0.to(gl.int64) * sot + h * soh + (r[:, None] * sot + d[None, :])
    valid = (r < n_valid)[:, None]
    acc = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, layout))
    for c in gl.static_range(D // 64):
        o = gl.load(base + c * 64, mask=valid, other=0.0)
        do = do_smem.slice(c * 64, 64, dim=1).load(layout)
        acc += gl.sum(o.to(gl.float32) * gl.where(valid, do, 0.0).to(gl.float32), 1)
    return gl.convert_layout(acc, out_layout)


# ------------------------------------------------------------------------------------------------------------------
# dQ pass: one program = one BM-row query tile of one segment and one query head (8 warps, no warp specialization)
_RUNTIME_DQ = ["sm_scale", "T_q", "n_seg", "n_iter", "H_q", "group"]


@gluon.jit(do_not_specialize=_RUNTIME_DQ)
def dq_kernel(q_desc, k_desc, v_desc, do_desc, O, LSE, DELTA, DQ, CU_Q, CU_K, TS, sm_scale, T_q, n_seg, n_iter, H_q,
              group, sot, soh, sdqt, sdqh, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
              num_warps: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, D, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    pid = gl.program_id(0)
    h = pid % H_q
    t = pid // H_q
    hk = h // group
    total = gl.load(TS + n_seg)
    if t >= total:  # padding rows past cu_seqlens_q[-1]: dQ 0
        U.zero_rows(DQ, gl.load(CU_Q + n_seg) + (t - total) * BM, T_q, sdqt, sdqh, h, BM, D, num_warps)
    else:
        q0, L_q, k0, L_k, m0, offset, n_blocks = U.query_tile(TS, CU_Q, CU_K, t, n_seg, n_iter, BM, BN)
        qk_scale = sm_scale * 1.4426950408889634
        col_q = h * D
        col_k = hk * D

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [BM, D], q_desc.layout)
        do_smem = gl.allocate_shared_memory(do_desc.dtype, [BM, D], do_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [BN, D], v_desc.layout)
        qd_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(qd_bar, count=1)
        mbarrier.init(k_bars.index(0), count=1)
        mbarrier.init(k_bars.index(1), count=1)
        mbarrier.init(v_bar, count=1)

        mbarrier.expect(qd_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q0 + m0, col_q], qd_bar, q_smem)
        tma.async_copy_global_to_shared(do_desc, [q0 + m0, col_q], qd_bar, do_smem)
        for i in gl.static_range(2):
            if n_blocks > i:
                U.request(k_desc, k_smem.index(i), k_bars.index(i), k0 + i * BN, col_k)
        if n_blocks > 0:
            U.request(v_desc, v_smem, v_bar, k0, col_k)

        # delta = rowsum(dO * O) of the tile (fp32 products of the bf16 values), stored for the dK/dV kernel; lse in
        # base 2, rows that see no key get +inf (P = 0)
        offs_s = gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        mbarrier.wait(qd_bar, 0)
        delta_s = _row_delta(O, do_smem, q0 + m0, h, sot, soh, L_q - m0, BM, D, num_warps,
                             gl.SliceLayout(1, s_layout))
        gl.store(DELTA + h.to(gl.int64) * T_q + q0 + m0 + offs_s, delta_s, mask=(m0 + offs_s) < L_q)
        lse = gl.load(LSE + h.to(gl.int64) * T_q + q0 + m0 + offs_s, mask=(m0 + offs_s) < L_q, other=0.0)
        lse2 = lse * 1.4426950408889634
        lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)
        offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))

        # dQ stays an asynchronous accumulator: dQ_j runs while S_{j+1} and dP_{j+1} are issued and P_{j+1} computed
        dq = warpgroup_mma_init(gl.zeros([BM, D], gl.float32, acc_layout))
        ds = gl.zeros([BM, BN], gl.bfloat16, ds_layout)
        s_zero = gl.zeros([BM, BN], gl.float32, s_layout)
        for j in range(0, n_blocks):
            stage, phase = U.ring_slot(k_bars, j)
            n = j * BN
            mbarrier.wait(k_bars.index(stage), phase)
            _, v_phase = U.ring_slot(v_bar, j)  # (V: a ring of one stage)
            mbarrier.wait(v_bar, v_phase)
            if n + BN > L_k:  # rows past the segment's keys: zero K and V (see the module docstring)
                U.zero_rows_from(k_smem.index(stage), L_k - n, BN, D, num_warps)
                U.zero_rows_from(v_smem, L_k - n, BN, D, num_warps)
                fence_async_shared()
                gl.thread_barrier()
            s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(do_smem, v_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # groups complete in order: one outstanding = dQ_{j-1} and S_j done, dP_j may still run
            s, dq, ds = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, dq, ds))
            dq = warpgroup_mma_init(dq)
            if (j >= 1) & (j + 1 < n_blocks):  # dQ_{j-1} has read K's other stage
                U.request(k_desc, k_smem.index(1 - stage), k_bars.index(1 - stage), k0 + n + BN, col_k)
            p = gl.exp2(s * qk_scale - lse2[:, None])
            if n + BN > m0 + offset + 1:  # only blocks on the causal diagonal need the mask
                keep = ((n + offs_n)[None, :] <= (m0 + offs_s)[:, None] + offset) & ((n + offs_n)[None, :] < L_k)
                p = gl.where(keep, p, 0.0)
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
            if j + 1 < n_blocks:  # dP_j has read V
                U.request(v_desc, v_smem, v_bar, k0 + n + BN, col_k)
            ds = gl.convert_layout((p * (dp - delta_s[:, None])).to(gl.bfloat16), ds_layout)
            dq = warpgroup_mma(ds, k_smem.index(stage), dq, is_async=True)
        dq, ds = warpgroup_mma_wait(num_outstanding=0, deps=(dq, ds))
        mbarrier.invalidate(qd_bar)
        mbarrier.invalidate(k_bars.index(0))
        mbarrier.invalidate(k_bars.index(1))
        mbarrier.invalidate(v_bar)
        # Q is no longer read (the last S has completed): stage dQ there for 16-byte row stores
        q_smem.store((dq * sm_scale).to(DQ.dtype.element_ty))
        gl.thread_barrier()
        U.store_rows(q_smem, DQ, q0 + m0, h, sdqt, sdqh, L_q - m0, BM, D, num_warps)
