"""Triton kernels of the zero-centred RMSNorm: y = x * rsqrt(mean(x^2) + eps) * (1 + w), fp32 math.

The width `H` is a constexpr (routes are per hidden size, see `ops.routes`); row counts and strides are runtime
values (`do_not_specialize`), with `tl.multiple_of` hints that the launcher guarantees (row strides are multiples
of 8 elements, pointers 16-byte aligned) so loads stay 16-byte vectors. Every value is converted to fp32 right
after its load (bf16 arithmetic is also wrong in Triton's interpreter), and cast once on store.

A row is held as two register tiles: columns [0, BLOCK_A) with BLOCK_A the largest power of two <= H (no column
mask), and, when H is not a power of two, columns [BLOCK_A, H) in a tile of BLOCK_B = next_pow2(H - BLOCK_A)
(masked). H 5120 is 4096 + 1024: no padded lanes, where one 8192-wide tile would waste 37.5 % of the registers and
issue slots.
"""
import triton
import triton.language as tl

from miles_ext_kernels.cake._runtime.reduce import fixed_order_finish


@triton.jit(do_not_specialize=["T", "stride_x", "stride_y", "eps"])
def _rmsnorm_fwd_kernel(x_ptr, w_ptr, y_ptr, T, stride_x, stride_y, eps,
                        H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T
    rows64 = rows.to(tl.int64)
    xo = tl.multiple_of(rows64 * stride_x, 8)
    yo = tl.multiple_of(rows64 * stride_y, 8)
    ca = tl.arange(0, BLOCK_A)
    x = tl.load(x_ptr + xo[:, None] + ca[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    ss = tl.sum(x * x, axis=1)
    if BLOCK_B > 0:
        cb = BLOCK_A + tl.arange(0, BLOCK_B)
        mb = rmask[:, None] & (cb < H)[None, :]
        xb = tl.load(x_ptr + xo[:, None] + cb[None, :], mask=mb, other=0.0).to(tl.float32)
        ss += tl.sum(xb * xb, axis=1)
    rstd = tl.rsqrt(ss / H + eps)
    w = tl.load(w_ptr + ca).to(tl.float32) + 1.0
    y = x * rstd[:, None] * w[None, :]
    tl.store(y_ptr + yo[:, None] + ca[None, :], y.to(y_ptr.dtype.element_ty), mask=rmask[:, None])
    if BLOCK_B > 0:
        wb = tl.load(w_ptr + cb, mask=cb < H, other=0.0).to(tl.float32) + 1.0
        yb = xb * rstd[:, None] * wb[None, :]
        tl.store(y_ptr + yo[:, None] + cb[None, :], yb.to(y_ptr.dtype.element_ty), mask=mb)


@triton.jit(do_not_specialize=["T", "stride_x", "stride_dy", "stride_dx", "rows_per_prog", "eps"])
def _rmsnorm_bwd_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, part_ptr, cnt_ptr, dw_ptr, T, stride_x, stride_dy, stride_dx,
                        rows_per_prog, eps, H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_A: tl.constexpr,
                        BLOCK_B: tl.constexpr, STAGES: tl.constexpr, GROUP: tl.constexpr, RED_C: tl.constexpr,
                        KAHAN: tl.constexpr):
    """Persistent: program p owns rows [p * rows_per_prog, (p + 1) * rows_per_prog). dx row by row (the loads of
    the next STAGES - 1 row blocks in flight, through shared memory); the weight gradient of its rows is summed in
    registers (Kahan-compensated when KAHAN; a plain fp32 sum otherwise, for tables with more programs, so fewer rows
    per program, where the compensation's registers (~20 per thread at H 5120, plus temporaries) buy a second CTA per
    SM).

    The program writes its sum as partial row p of `part_ptr` ([P + cdiv(P, GROUP), H] fp32) and
    `fixed_order_finish` reduces the partial rows in a fixed order inside this launch (the last program of each
    group of GROUP programs sums its group, the last group sums the groups into `dw_ptr`, in the weight's dtype;
    `cnt_ptr` holds zeroed int32 counters that the kernel leaves zeroed)."""
    pid = tl.program_id(0)
    ca = tl.arange(0, BLOCK_A)
    w = tl.load(w_ptr + ca).to(tl.float32) + 1.0
    acc = tl.zeros([BLOCK_M, BLOCK_A], dtype=tl.float32)
    comp = tl.zeros([BLOCK_M, BLOCK_A], dtype=tl.float32)  # Kahan compensation of acc (unused without KAHAN)
    if BLOCK_B > 0:
        cb = BLOCK_A + tl.arange(0, BLOCK_B)
        cbm = cb < H
        wb = tl.load(w_ptr + cb, mask=cbm, other=0.0).to(tl.float32) + 1.0
        acc_b = tl.zeros([BLOCK_M, BLOCK_B], dtype=tl.float32)
        comp_b = tl.zeros([BLOCK_M, BLOCK_B], dtype=tl.float32)
    start = pid * rows_per_prog
    end = tl.minimum(start + rows_per_prog, T)
    for r0 in tl.range(start, end, BLOCK_M, num_stages=STAGES):
        rows = r0 + tl.arange(0, BLOCK_M)
        rmask = (rows < end)[:, None]
        rows64 = rows.to(tl.int64)
        xo = tl.multiple_of(rows64 * stride_x, 8)
        go = tl.multiple_of(rows64 * stride_dy, 8)
        do = tl.multiple_of(rows64 * stride_dx, 8)
        x = tl.load(x_ptr + xo[:, None] + ca[None, :], mask=rmask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + go[:, None] + ca[None, :], mask=rmask, other=0.0).to(tl.float32)
        ss = tl.sum(x * x, axis=1)
        if BLOCK_B > 0:
            mb = rmask & cbm[None, :]
            xb = tl.load(x_ptr + xo[:, None] + cb[None, :], mask=mb, other=0.0).to(tl.float32)
            dyb = tl.load(dy_ptr + go[:, None] + cb[None, :], mask=mb, other=0.0).to(tl.float32)
            ss += tl.sum(xb * xb, axis=1)
        rstd = tl.rsqrt(ss / H + eps)
        xhat = x * rstd[:, None]
        wdy = dy * w[None, :]
        cs = tl.sum(wdy * xhat, axis=1)
        if BLOCK_B > 0:
            xhat_b = xb * rstd[:, None]
            wdy_b = dyb * wb[None, :]
            cs += tl.sum(wdy_b * xhat_b, axis=1)
        c = cs / H
        # the A tile, then the B tile if any, through the same code in the kernel's own scope (a @triton.jit
        # helper's inlined debug scope moves ptxas's scheduling boundaries: different SASS at H 4096)
        for t in tl.static_range(2 if BLOCK_B > 0 else 1):
            if t == 0:
                cols, mask, wdy_t, xhat_t, dy_t, acc_t, comp_t = ca, rmask, wdy, xhat, dy, acc, comp
            else:
                cols, mask, wdy_t, xhat_t, dy_t, acc_t, comp_t = cb, mb, wdy_b, xhat_b, dyb, acc_b, comp_b
            dx = (wdy_t - xhat_t * c[:, None]) * rstd[:, None]
            tl.store(dx_ptr + do[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=mask)
            # compensated sum over this program's rows: a program walks ~T / P rows (hundreds), and a plain fp32
            # running sum would lose ~sqrt(rows) ulps; Kahan keeps the weight gradient within a few ulps
            if KAHAN:
                term = dy_t * xhat_t - comp_t
                total = acc_t + term
                comp_t = (total - acc_t) - term
                acc_t = total
            else:
                acc_t += dy_t * xhat_t
            if t == 0:
                acc, comp = acc_t, comp_t
            else:
                acc_b, comp_b = acc_t, comp_t
    dw = tl.sum(acc, axis=0)
    prow = part_ptr + pid.to(tl.int64) * H
    tl.store(prow + ca, dw)
    if BLOCK_B > 0:
        tl.store(prow + cb, tl.sum(acc_b, axis=0), mask=cbm)
    fixed_order_finish(part_ptr, cnt_ptr, dw_ptr, pid, tl.num_programs(0), H, GROUP, RED_C)
