"""CANDIDATE, NOT GPU-TESTED: a Gluon dQ pass for `gqa` on sm_90a (compiled offline for sm_90 with triton 3.6 only).

Meant as `_impl/gqa/gluon_dq.py`, a drop-in for `kernels._bwd_dq_kernel` with the same tiles (BM 128 query rows,
BN 64 keys, 8 warps), the same arithmetic order (so, if it holds on the GPU, the same dQ and delta bits) and:
- Q and dO tiles resident in shared memory (TMA, 2 x 64 KB); K double-buffered (2 x 32 KB), V single-buffered
  (32 KB): 224 KB in all (the H200 allows 232 448 B per block).
- Per key block: S = Q K^T and dP = dO V^T issued as asynchronous wgmma back to back; P from S while dP runs;
  V_{j+1} requested once dP_j has read V; dQ += dS K_j, then K_{j+2} requested once it has read K_j's stage.
- K and V rows past a segment's keys are zeroed in shared memory: dQ += dS K contracts over keys, so a NaN or inf
  in padding rows would reach real rows through 0 * NaN (the forward only needs V zeroed).
To land it: move it to `_impl/gqa/`; share its padding-rows block with `gluon_fwd.fwd_kernel` (a helper); route to
it from `ops.gqa_backward` under the forward's `_gluon_fwd_fits` condition (plus dO and O); add a prebuild route and
a GPU test that it gives the Triton dQ kernel's dQ and delta bits (padding with NaN, empty segments, L_k < L_q,
partial tiles); then time it in bench/gqa.py against the 2.0 ms of the Triton dQ pass at 16 x 2048 Hq16/Hkv2
(H200, session 4).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from miles_ext_kernels.cake._impl.gqa import kernels as K

_RUNTIME = ["sm_scale", "T_q", "n_seg", "n_iter", "H_q", "group"]


@gluon.jit
def _request(desc, smem, bar, row, col):
    mbarrier.expect(bar, desc.block_type.nbytes)
    tma.async_copy_global_to_shared(desc, [row, col], bar, smem)


@gluon.jit
def _zero_rows_past(smem, n, L_k, BN: gl.constexpr, layout: gl.constexpr):
    """Zero the rows of a [BN, D] key tile at key offset n that lie past the segment's L_k keys."""
    tile = smem.load(layout)
    rows = n + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    smem.store(gl.where((rows < L_k)[:, None], tile, 0.0))


@gluon.jit(do_not_specialize=_RUNTIME)
def dq_kernel(q_desc, k_desc, v_desc, do_desc, O, LSE, DELTA, DQ, CU_Q, CU_K, TS, sm_scale, T_q, n_seg, n_iter, H_q,
              group, sot, soh, sdqt, sdqh, D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
              num_warps: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BN, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                         instr_shape=[16, D, 16])
    ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    row_layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [num_warps, 1], [1, 0])
    pid = gl.program_id(0)
    h = pid % H_q
    t = pid // H_q
    hk = h // group
    total = gl.load(TS + n_seg)
    if t >= total:
        z_m = gl.arange(0, BM, layout=gl.SliceLayout(1, row_layout))
        z_d = gl.arange(0, D, layout=gl.SliceLayout(0, row_layout))
        z_rows = gl.load(CU_Q + n_seg) + (t - total) * BM + z_m
        gl.store(DQ + z_rows.to(gl.int64)[:, None] * sdqt + h * sdqh + z_d[None, :],
                 gl.zeros([BM, D], DQ.dtype.element_ty, row_layout), mask=(z_rows < T_q)[:, None])
    else:
        local, q0, L_q, k0, L_k = K._find_tile(TS, CU_Q, CU_K, t, n_seg, n_iter, True)
        m0 = local * BM
        offset = L_k - L_q
        qk_scale = sm_scale * 1.4426950408889634
        hi = gl.maximum(gl.minimum(L_k, m0 + BM + offset), 0)
        n_blocks = (hi + BN - 1) // BN
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
                _request(k_desc, k_smem.index(i), k_bars.index(i), k0 + i * BN, col_k)
        if n_blocks > 0:
            _request(v_desc, v_smem, v_bar, k0, col_k)

        # delta = rowsum(dO * O) of the tile (as the Triton kernel: fp32 products of the bf16 values), stored for
        # the dK/dV kernel; lse in base 2, rows that see no key get +inf (P = 0)
        offs_m = gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
        rvalid = (m0 + offs_m) < L_q
        row0 = (q0 + m0).to(gl.int64)
        o = gl.load(O + row0 * sot + h * soh + (offs_m[:, None] * sot + offs_d[None, :]), mask=rvalid[:, None],
                    other=0.0)
        mbarrier.wait(qd_bar, 0)
        do_reg = do_smem.load(acc_layout)
        delta = gl.sum(o.to(gl.float32) * gl.where(rvalid[:, None], do_reg, 0.0).to(gl.float32), 1)
        gl.store(DELTA + h.to(gl.int64) * T_q + q0 + m0 + offs_m, delta, mask=rvalid)
        offs_s = gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
        lse = gl.load(LSE + h.to(gl.int64) * T_q + q0 + m0 + offs_s, mask=(m0 + offs_s) < L_q, other=0.0)
        lse2 = lse * 1.4426950408889634
        lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)
        delta_s = gl.convert_layout(delta, gl.SliceLayout(1, s_layout))
        offs_n = gl.arange(0, BN, layout=gl.SliceLayout(0, s_layout))

        dq = gl.zeros([BM, D], gl.float32, acc_layout)
        s_zero = gl.zeros([BM, BN], gl.float32, s_layout)
        for j in range(0, n_blocks):
            stage = j % 2
            n = j * BN
            mbarrier.wait(k_bars.index(stage), (j // 2) & 1)
            mbarrier.wait(v_bar, j & 1)
            if n + BN > L_k:  # rows past the segment's keys: zero K and V (see the module docstring)
                _zero_rows_past(k_smem.index(stage), n, L_k, BN, acc_layout)
                _zero_rows_past(v_smem, n, L_k, BN, acc_layout)
                fence_async_shared()
                gl.thread_barrier()
            s_tok = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_tok = warpgroup_mma(do_smem, v_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok, ))
            p = gl.exp2(s * qk_scale - lse2[:, None])
            if n + BN > m0 + offset + 1:  # only blocks on the causal diagonal need the mask
                keep = ((n + offs_n)[None, :] <= (m0 + offs_s)[:, None] + offset) & ((n + offs_n)[None, :] < L_k)
                p = gl.where(keep, p, 0.0)
            dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok, ))
            if j + 1 < n_blocks:  # dP_j has read V
                _request(v_desc, v_smem, v_bar, k0 + n + BN, col_k)
            ds = gl.convert_layout((p * (dp - delta_s[:, None])).to(gl.bfloat16), ds_layout)
            dq_tok = warpgroup_mma(ds, k_smem.index(stage), dq, is_async=True)
            dq = warpgroup_mma_wait(num_outstanding=0, deps=(dq_tok, ds))[0]
            if j + 2 < n_blocks:  # dQ += dS K_j has read K's stage
                _request(k_desc, k_smem.index(stage), k_bars.index(stage), k0 + n + 2 * BN, col_k)
        mbarrier.invalidate(qd_bar)
        mbarrier.invalidate(k_bars.index(0))
        mbarrier.invalidate(k_bars.index(1))
        mbarrier.invalidate(v_bar)
        dq = dq * sm_scale
        gl.store(DQ + row0 * sdqt + h * sdqh + (offs_m[:, None] * sdqt + offs_d[None, :]),
                 dq.to(DQ.dtype.element_ty), mask=rvalid[:, None])
