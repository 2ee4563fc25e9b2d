"""Triton kernels of the gated RMSNorm: y = x * rsqrt(mean(x^2) + eps) * w * silu(z), fp32 math, per row of D.

Rows are (token, head) pairs: row r = t * NH + h sits at `t * stride_t + h * stride_h` in each operand, so x, z and
dy are read in place from `[T, NH, D]` views whose head stride is not T-contiguous (z as a column slice of the fused
projection). The head dim `D` is a constexpr (routes per head dim); the rest are runtime values whose multiples of 8
elements the launcher guarantees (`tl.multiple_of` hints keep 16-byte vector loads). Values go to fp32 right after
the load (bf16 arithmetic is also wrong in Triton's interpreter) and are cast once on store.
"""
import triton
import triton.language as tl


@triton.jit
def _row_offsets(rows, NH, stride_t, stride_h):
    t = rows // NH
    h = rows - t * NH
    return tl.multiple_of(t.to(tl.int64) * stride_t + h.to(tl.int64) * stride_h, 8)


@triton.jit(do_not_specialize=["N", "NH", "sxt", "sxh", "szt", "szh", "eps"])
def _gated_fwd_kernel(x_ptr, z_ptr, w_ptr, y_ptr, N, NH, sxt, sxh, szt, szh, eps,
                      D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    mask = (rows < N)[:, None] & cmask[None, :]
    xo = _row_offsets(rows, NH, sxt, sxh)
    zo = _row_offsets(rows, NH, szt, szh)
    yo = tl.multiple_of(rows.to(tl.int64) * D, 8)
    x = tl.load(x_ptr + xo[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + zo[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    gate = z * tl.sigmoid(z)
    y = x * rstd[:, None] * w[None, :] * gate
    tl.store(y_ptr + yo[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["N", "NH", "sxt", "sxh", "szt", "szh", "sgt", "sgh", "rows_per_prog", "eps"])
def _gated_bwd_kernel(x_ptr, z_ptr, w_ptr, dy_ptr, dx_ptr, dz_ptr, dw_ptr, N, NH, sxt, sxh, szt, szh, sgt, sgh,
                      rows_per_prog, eps, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
                      STAGES: tl.constexpr):
    """Persistent: program p owns rows [p * rows_per_prog, (p + 1) * rows_per_prog); dx and dz ([N, D]
    contiguous) row by row (with STAGES > 1 the loads of the next STAGES - 1 row blocks are in flight, through
    shared memory, while this block is reduced), and the weight gradient of its rows as partial row p of `dw_ptr`
    ([P, D] fp32), which the launcher sums in a fixed order."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    cmask = cols < D
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    start = pid * rows_per_prog
    end = tl.minimum(start + rows_per_prog, N)
    for r0 in tl.range(start, end, BLOCK_M, num_stages=STAGES):
        rows = r0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & cmask[None, :]
        xo = _row_offsets(rows, NH, sxt, sxh)
        zo = _row_offsets(rows, NH, szt, szh)
        go = _row_offsets(rows, NH, sgt, sgh)
        oo = tl.multiple_of(rows.to(tl.int64) * D, 8)
        x = tl.load(x_ptr + xo[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        z = tl.load(z_ptr + zo[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + go[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
        xhat = x * rstd[:, None]
        sig = tl.sigmoid(z)
        gate = z * sig
        dyg = dy * gate
        # dz = dy * xhat * w * silu'(z),  silu'(z) = sig * (1 + z * (1 - sig))
        dz = dy * xhat * w[None, :] * (sig * (1.0 + z * (1.0 - sig)))
        dn = dyg * w[None, :]
        c = tl.sum(dn * xhat, axis=1) / D
        dx = (dn - xhat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + oo[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        tl.store(dz_ptr + oo[:, None] + cols[None, :], dz.to(dz_ptr.dtype.element_ty), mask=mask)
        acc += dyg * xhat
    dw = tl.sum(acc, axis=0)
    tl.store(dw_ptr + pid.to(tl.int64) * D + cols, dw, mask=cmask)
