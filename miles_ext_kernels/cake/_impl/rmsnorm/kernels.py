"""Triton kernels of the zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w), fp32 math.

The width `H` is a constexpr (routes are per hidden size, see `ops.routes`); row counts and strides are runtime
values (`do_not_specialize`), with `tl.multiple_of` hints that the launcher guarantees (row strides are multiples
of 8 elements, pointers 16-byte aligned) so loads stay 16-byte vectors. Every value is converted to fp32 right
after its load (bf16 arithmetic is also wrong in Triton's interpreter), and cast once on store.
"""
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["T", "stride_x", "stride_y", "eps"])
def _rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, T, stride_x, stride_y, eps,
                        H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    rmask = rows < T
    cmask = cols < H
    mask = rmask[:, None] & cmask[None, :]
    rows64 = rows.to(tl.int64)
    xo = tl.multiple_of(rows64 * stride_x, 8)
    yo = tl.multiple_of(rows64 * stride_y, 8)
    x = tl.load(x_ptr + xo[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + 1.0
    rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + yo[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["T", "stride_x", "stride_dy", "stride_dx", "rows_per_prog", "eps"])
def _rmsnorm_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dw_ptr, T, stride_x, stride_dy, stride_dx, rows_per_prog,
                        eps, H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr):
    """Persistent: program p owns rows [p * rows_per_prog, (p + 1) * rows_per_prog). dx row by row; the weight
    gradient of its rows is summed in registers (Kahan-compensated), then written as partial row p of `dw_ptr` ([P, H] fp32; the
    deterministic path) or atomically added into `dw_ptr` ([H] fp32, zeroed; the fast path)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < H
    w = tl.load(w_ptr + cols, mask=cmask, other=0.0).to(tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    comp = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)  # Kahan compensation of acc
    start = pid * rows_per_prog
    end = tl.minimum(start + rows_per_prog, T)
    for r0 in range(start, end, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        mask = (rows < end)[:, None] & cmask[None, :]
        rows64 = rows.to(tl.int64)
        xo = tl.multiple_of(rows64 * stride_x, 8)
        go = tl.multiple_of(rows64 * stride_dy, 8)
        do = tl.multiple_of(rows64 * stride_dx, 8)
        x = tl.load(x_ptr + xo[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + go[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / H + eps)
        xhat = x * rstd[:, None]
        wdy = dy * w[None, :]
        c = tl.sum(wdy * xhat, axis=1) / H
        dx = (wdy - xhat * c[:, None]) * rstd[:, None]
        tl.store(dx_ptr + do[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
        # compensated sum over this program's rows: a program walks ~T / P rows (hundreds), and a plain fp32
        # running sum would lose ~sqrt(rows) ulps; Kahan keeps the weight gradient within a few ulps
        term = dy * xhat - comp
        total = acc + term
        comp = (total - acc) - term
        acc = total
    dw = tl.sum(acc, axis=0)
    if ATOMIC:
        tl.atomic_add(dw_ptr + cols, dw, mask=cmask, sem="relaxed")
    else:
        tl.store(dw_ptr + pid.to(tl.int64) * H + cols, dw, mask=cmask)
