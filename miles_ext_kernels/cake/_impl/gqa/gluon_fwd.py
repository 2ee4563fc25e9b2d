"""Gluon forward of `gqa` for sm_90a (Hopper): the same tiles, order of operations and bits as `kernels._fwd_kernel`,
with the data movement and the matmul waits under explicit control, which the Triton kernel cannot get on triton 3.6.

One program = one 128-row query tile of one segment and one query head (tiles start at segment starts, heaviest
first: `kernels._tile_prefix_kernel` numbers them), 8 warps = 2 warpgroups of 64 rows:
- Q, K and V tiles arrive by TMA into shared memory (K and V in two stages each, with one mbarrier per stage and per
  operand: S_{j+1} = Q K_{j+1}^T waits only for K; K_{j+3} is requested as soon as S_{j+1} has read its stage, two
  blocks ahead of use; V_{j+2} as soon as P_j V_j has read its stage, about one block ahead).
- Each iteration issues S_{j+1} and O += P_j V_j as asynchronous wgmma, waits for S_{j+1} only, runs the softmax of
  block j+1 while P_j V_j is still on the tensor cores, then waits for it and rescales O.
- The output tile is staged in Q's shared memory (free after the last S) and written by one TMA store; a segment's
  last, partial tile uses masked 16-byte row stores instead (a TMA store would write the next segment's rows).
- Rows past a segment's keys are loaded by TMA (they belong to the next segment, or are padding past the end):
  the causal / length mask sets their scores to -inf, and V rows past the segment are zeroed in shared memory
  before P V, since 0 * (NaN or inf padding) would not be 0.
Requires at least one query and one key, heads contiguous within a token row (head stride = head dim) and rows that do
not overlap (`ops._gluon_fwd_fits`); other operands take the Triton kernel (16-byte alignment is ensured for both
routes by `ops._ready`, which copies misaligned operands). Gluon has no interpreter: CPU tests run the Triton kernel.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from . import gluon_util as U

_RUNTIME = ["sm_scale", "T_q", "n_seg", "n_iter", "H_q", "group"]  # never specialized (a finite set of routes)


@gluon.jit
def _softmax(s, n, m0, offset, L_k, m_i, l_i, qk_scale, BM: gl.constexpr, BN: gl.constexpr,
             s_layout: gl.constexpr):
    """Online softmax of the key block at n (base-2 exponent): p, the rescale factor of O, and the new l, m."""
    s = s * qk_scale
    if n + BN > m0 + offset + 1:  # only blocks on the diagonal (or past the keys) need the mask
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))
        keep = ((n + offs_n)[None, :] <= (m0 + offs_m)[:, None] + offset) & ((n + offs_n)[None, :] < L_k)
        s = gl.where(keep, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, 1))
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon.jit(do_not_specialize=_RUNTIME)
def fwd_kernel(q_desc, k_desc, v_desc, o_desc, O, LSE, CU_Q, CU_K, TS, sm_scale, T_q, n_seg, n_iter, H_q, group,
               sot, soh, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, num_warps: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])  # 16-byte row stores
    pid = gl.program_id(0)
    h = pid % H_q
    t = pid // H_q
    hk = h // group
    total = gl.load(TS + n_seg)
    if t >= total:
        # padding rows past cu_seqlens_q[-1]: out 0, LSE -inf
        row0 = gl.load(CU_Q + n_seg) + (t - total) * BM
        U.zero_rows(O, row0, T_q, sot, soh, h, BM, D, num_warps)
        z_rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, row_layout))
        gl.store(LSE + h.to(gl.int64) * T_q + z_rows, gl.full([BM], float("-inf"), gl.float32,
                                                              gl.SliceLayout(1, row_layout)), mask=z_rows < T_q)
    else:
        q0, L_q, k0, L_k, m0, offset, n_blocks = U.query_tile(TS, CU_Q, CU_K, t, n_seg, n_iter, BM, BN)
        qk_scale = sm_scale * 1.4426950408889634
        col_q = h * D
        col_k = hk * D

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [BM, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [2, BN, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [2, BN, D], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(2):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)

        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q0 + m0, col_q], q_bar, q_smem)
        for i in gl.static_range(2):
            if n_blocks > i:
                U.request(k_desc, k_smem.index(i), k_bars.index(i), k0 + i * BN, col_k)
                U.request(v_desc, v_smem.index(i), v_bars.index(i), k0 + i * BN, col_k)

        acc = gl.zeros([BM, D], gl.float32, o_layout)
        m_i = gl.full([BM], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BM], gl.float32, gl.SliceLayout(1, s_layout))
        s_zero = gl.zeros([BM, BN], gl.float32, s_layout)
        p = gl.zeros([BM, BN], gl.float32, s_layout)
        mbarrier.wait(q_bar, 0)
        if n_blocks > 0:
            mbarrier.wait(k_bars.index(0), 0)
            s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            if n_blocks > 2:  # S_0 has read K's stage 0
                U.request(k_desc, k_smem.index(0), k_bars.index(0), k0 + 2 * BN, col_k)
            p, alpha, l_i, m_i = _softmax(s, 0, m0, offset, L_k, m_i, l_i, qk_scale, BM, BN, s_layout)
        for j in range(0, n_blocks):
            stage = j % 2
            n = j * BN
            mbarrier.wait(v_bars.index(stage), (j // 2) & 1)
            if n + BN > L_k:  # zero V rows past the segment's keys (see the module docstring)
                v_tile = v_smem.index(stage).load(o_layout)
                v_rows = n + gl.arange(0, BN, layout=gl.SliceLayout(1, o_layout))
                v_smem.index(stage).store(gl.where((v_rows < L_k)[:, None], v_tile, 0.0))
                fence_async_shared()
                gl.thread_barrier()  # every warp's rows are in shared memory before the warpgroups' MMAs
            pb = gl.convert_layout(p.to(gl.bfloat16), p_layout)
            if j + 1 < n_blocks:
                nstage = (j + 1) % 2
                mbarrier.wait(k_bars.index(nstage), ((j + 1) // 2) & 1)
                s_tok = warpgroup_mma(q_smem, k_smem.index(nstage).permute((1, 0)), s_zero, use_acc=False,
                                      is_async=True)
                acc_tok = warpgroup_mma(pb, v_smem.index(stage), acc, is_async=True)
                # wgmma groups complete in order: one outstanding = S_{j+1} done, P_j V_j may still run
                s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
                if j + 3 < n_blocks:  # S_{j+1} has read K's stage nstage
                    U.request(k_desc, k_smem.index(nstage), k_bars.index(nstage), k0 + n + 3 * BN, col_k)
                p, alpha, l_i, m_i = _softmax(s, n + BN, m0, offset, L_k, m_i, l_i, qk_scale, BM, BN, s_layout)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, pb))[0]
                if j + 2 < n_blocks:  # P_j V_j has read V's stage
                    U.request(v_desc, v_smem.index(stage), v_bars.index(stage), k0 + n + 2 * BN, col_k)
                acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
            else:
                acc_tok = warpgroup_mma(pb, v_smem.index(stage), acc, is_async=True)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok, pb))[0]
        mbarrier.invalidate(q_bar)
        for i in gl.static_range(2):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))

        empty = l_i == 0.0  # rows that see no key: out 0, LSE -inf
        l_safe = gl.where(empty, 1.0, l_i)
        lse = gl.where(empty, float("-inf"), (m_i + gl.log2(l_safe)) * 0.6931471805599453)
        out = (acc / gl.convert_layout(l_safe, gl.SliceLayout(1, o_layout))[:, None]).to(O.dtype.element_ty)
        q_smem.store(out)
        fence_async_shared()
        gl.thread_barrier()
        if m0 + BM <= L_q:
            tma.async_copy_shared_to_global(o_desc, [q0 + m0, col_q], q_smem)
            tma.store_wait(pendings=0)
        else:
            o_tile = q_smem.load(row_layout)
            offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, row_layout))
            offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, row_layout))
            o_ptrs = O + (q0 + m0).to(gl.int64) * sot + h * soh + (offs_m[:, None] * sot + offs_d[None, :])
            gl.store(o_ptrs, o_tile, mask=((m0 + offs_m) < L_q)[:, None])
        offs_l = gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        gl.store(LSE + h.to(gl.int64) * T_q + q0 + m0 + offs_l, lse, mask=(m0 + offs_l) < L_q)
