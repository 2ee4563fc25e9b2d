"""Gated RMSNorm RMSNorm(x) * w * SiLU(z): checks, launchers, torch.library custom ops (autograd + fake kernels).

Layers: kernels.py (@triton.jit) -> launchers here (`gated_fwd`, `gated_bwd`: allocate, pick the route, launch;
no autograd) -> custom ops `miles_ext_kernels::cake_gated_rmsnorm_fwd/bwd` with `register_autograd` (saves x, z and
the weight; rstd is recomputed in the backward) -> the public `rmsnorm_silu_gate`.

Operands are read in place as `[T, NH, D]` views (row = token x head) when their last stride is 1, their token and
head strides are multiples of 8 elements and they start 16-byte aligned; z is typically a column slice of the fused
`[q | k | v | z | b | a]` projection, whose token stride is the projection width. Anything else is copied first
(counted in `COPIES` by argument name, so tests can tell which path ran).

Weight gradient: one fp32 partial row per persistent backward program, summed in a fixed order (`_runtime.reduce`).
The kernel can add the rows atomically instead (`FAST_DW_ATOMIC`, for the fast variant); that measured no faster
on the H200, so the table keeps it off and fast runs the det path.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.autograd.function import once_differentiable
import triton

from miles_ext_kernels.cake import gated_rmsnorm as _decl
from miles_ext_kernels.cake._runtime import reduce as _reduce
from miles_ext_kernels.cake._runtime import build, checks, config

from . import kernels

OP = "gated_rmsnorm"
X_DTYPES = (torch.bfloat16,)
W_DTYPES = (torch.float32, torch.bfloat16)

# ------------------------------------------------------------------------------------------------------------------
# Fixed configuration table (no autotuning). Windows by row count N = tokens x heads.
SMALL_N = 4096
WINDOWS = ("small", "large")
# The fast variant may add the weight-gradient rows with atomics (no fixed order). On the H200 that was not faster
# than the fixed-order two-stage sum (bench/NOTES.md, norms, v1), and less accurate, so fast runs the det path.
FAST_DW_ATOMIC = False


# Forward, large window: (elements per tile, num_warps), from the H200 sweeps (bench/NOTES.md, norms): at 32 heads x
# 128 x 32k tokens 0.188 ms vs 0.201 for (4096, 4) and 0.224 for (8192, 8).
FWD_LARGE = (1024, 2)


def fwd_config(D: int, window: str):
    """(BLOCK_M, BLOCK_D, num_warps, num_stages) of the forward for head dim D."""
    bd = triton.next_power_of_2(D)
    if window == "small":
        return max(1, 2048 // bd), bd, 4, 1
    return max(1, FWD_LARGE[0] // bd), bd, FWD_LARGE[1], 1


# Backward (both windows): (elements per tile, num_warps, STAGES = row blocks of loads in flight + 1, programs per
# SM), from the H200 sweep (bench/NOTES.md, norms): 0.357 ms at 32 x 128 x 32k tokens vs 0.397 for the unpipelined
# (8192, 16, 1, 1).
BWD_TILE = (8192, 8, 3, 1)


def bwd_config(D: int, window: str):
    """(BLOCK_M, BLOCK_D, num_warps, STAGES, programs per SM) of the backward (both windows: same)."""
    bd = triton.next_power_of_2(D)
    el, nw, st, pps = BWD_TILE
    return max(1, el // bd), bd, nw, st, pps


_configs = _reduce.RowConfigs(fwd_config, bwd_config, SMALL_N)
window_of = _configs.window


# ------------------------------------------------------------------------------------------------------------------
COPIES: Counter = Counter()  # how often an operand had to be copied before a launch, by argument name


def _lead_shape(x: torch.Tensor) -> tuple[int, int]:
    """(T, NH): x is `[N, D]` (NH = 1), `[T, NH, D]`, or `[..., NH, D]` (leading dims flattened into T)."""
    if x.dim() == 2:
        return x.shape[0], 1
    T = 1
    for s in x.shape[:-2]:
        T *= s
    return T, x.shape[-2]


def in_place(t: torch.Tensor, T: int, NH: int, D: int):
    """The `[T, NH, D]` view the kernels read `t` through, or None when a copy is needed."""
    if t.stride(-1) != 1 and D > 1:
        return None
    try:
        v = t.view(T, NH, D)
    except RuntimeError:
        return None
    st = v.stride(0) if T > 1 else 0
    sh = v.stride(1) if NH > 1 else 0
    if st % 8 or sh % 8 or (t.numel() and v.data_ptr() % 16):
        return None
    return v


def _operand(t: torch.Tensor, T: int, NH: int, D: int, name: str):
    """(tensor, stride_t, stride_h) for the kernels: in place when the layout allows, a contiguous copy otherwise."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t, (NH * D if T > 1 else 0), (D if NH > 1 else 0)
    v = in_place(t, T, NH, D)
    if v is None:
        COPIES[name] += 1
        v = torch.empty((T, NH, D), dtype=t.dtype, device=t.device)
        v.copy_(t.reshape(T, NH, D))
    return v, (v.stride(0) if T > 1 else 0), (v.stride(1) if NH > 1 else 0)


def _weight(w: torch.Tensor) -> torch.Tensor:
    if w.stride(0) == 1 and w.data_ptr() % 16 == 0:
        return w
    COPIES["weight"] += 1
    return w.clone(memory_format=torch.contiguous_format) if w.stride(0) == 1 else w.contiguous()


def check_args(x, z, weight, eps) -> int:
    """Host-side checks (ValueError/TypeError naming the argument); returns the head dim D."""
    checks.check_tensor("x", x, dtype=X_DTYPES)
    if x.dim() < 2:
        raise ValueError(f"x must be [N, D] or [..., H_v, D], got shape {tuple(x.shape)}")
    checks.check_tensor("z", z, dtype=X_DTYPES)
    if z.shape != x.shape:
        raise ValueError(f"z has shape {tuple(z.shape)} but x has {tuple(x.shape)}")
    checks.check_tensor("weight", weight, dtype=W_DTYPES, ndim=1)
    D = x.shape[-1]
    if weight.shape[0] != D:
        raise ValueError(f"weight has {weight.shape[0]} elements but x's head dim is {D}")
    checks.check_same_device([("x", x), ("z", z), ("weight", weight)])
    checks.check_eps(eps)
    try:
        _decl.check_supported(D)
    except ValueError as e:
        raise ValueError(f"x's last dimension: {e}") from None
    return D


# ------------------------------------------------------------------------------------------------------------------
# launchers: `_fwd` / `_bwd` assume checked arguments (the hot path); `gated_fwd` / `gated_bwd` check first.
@build.on_input_device
def _fwd(x, z, weight, eps: float, D: int, cfg=None):
    arch = _reduce.table_arch(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    T, NH = _lead_shape(x)
    N = T * NH
    if N == 0:
        return y
    xv, sxt, sxh = _operand(x, T, NH, D, "x")
    zv, szt, szh = _operand(z, T, NH, D, "z")
    w = _weight(weight)
    bm, bd, nw, ns = cfg or _configs(D, N, arch)[0]
    kernels._gated_fwd_kernel[(build.cdiv(N, bm),)](
        xv, zv, w, y, N, NH, sxt, sxh, szt, szh, eps, D=D, BLOCK_M=bm, BLOCK_D=bd, num_warps=nw, num_stages=ns)
    return y


@build.on_input_device
def _bwd(dy, x, z, weight, eps: float, deterministic: bool, D: int, cfg=None, programs=None, atomic=None):
    arch = _reduce.table_arch(x)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    T, NH = _lead_shape(x)
    N = T * NH
    if N == 0:
        return dx, dz, torch.zeros_like(weight, memory_format=torch.contiguous_format)
    xv, sxt, sxh = _operand(x, T, NH, D, "x")
    zv, szt, szh = _operand(z, T, NH, D, "z")
    gv, sgt, sgh = _operand(dy, T, NH, D, "dy")
    w = _weight(weight)
    _, bcfg, P = _configs(D, N, arch)
    bm, bd, nw, ns = cfg or bcfg
    P = programs or P
    rows_per_prog, grid = _reduce.row_split(N, P, bm)
    atomic = (not deterministic and FAST_DW_ATOMIC) if atomic is None else atomic
    dw, target = _reduce.weight_grad_buffers(OP, grid, D, weight, atomic)
    kernels._gated_bwd_kernel[(grid,)](
        xv, zv, w, gv, dx, dz, target, N, NH, sxt, sxh, szt, szh, sgt, sgh, rows_per_prog, eps,
        D=D, BLOCK_M=bm, BLOCK_D=bd, STAGES=ns, ATOMIC=atomic, num_warps=nw, num_stages=ns)
    return dx, dz, _reduce.finish_weight_grad(dw, target, grid, D, atomic)


def gated_fwd(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *, cfg=None) -> torch.Tensor:
    """y (x's dtype and shape, contiguous). `cfg` overrides the table (benchmarks only)."""
    D = check_args(x, z, weight, eps)
    return _fwd(x, z, weight, float(eps), D, cfg)


def gated_bwd(dy, x, z, weight, eps: float, deterministic: bool, *, cfg=None, programs=None, atomic=None):
    """(dx, dz in x's dtype and shape; dw in weight's dtype). `cfg` / `programs` / `atomic` override the table
    (benchmarks)."""
    D = check_args(x, z, weight, eps)
    checks.check_tensor("dy", dy, dtype=X_DTYPES)
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but x has {tuple(x.shape)}")
    return _bwd(dy, x, z, weight, float(eps), deterministic, D, cfg, programs, atomic)


# ------------------------------------------------------------------------------------------------------------------
# eager autograd: a plain autograd.Function (a torch.library custom op costs ~100 us of host time per call in
# eager mode); under torch.compile the custom op below is traced instead.
class _GatedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, z, weight, eps, deterministic, D):
        ctx.save_for_backward(x, z, weight)
        ctx.eps, ctx.deterministic, ctx.D = eps, deterministic, D
        return _fwd(x, z, weight, eps, D)

    @staticmethod
    @once_differentiable  # a second derivative raises instead of silently carrying no history
    def backward(ctx, dy):
        x, z, weight = ctx.saved_tensors
        dx, dz, dw = _bwd(dy, x, z, weight, ctx.eps, ctx.deterministic, ctx.D)
        return dx, dz, dw, None, None, None


# ------------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("miles_ext_kernels::cake_gated_rmsnorm_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, deterministic: bool) -> torch.Tensor:
    return gated_fwd(x, z, weight, eps)


@_fwd_op.register_fake
def _fwd_fake(x, z, weight, eps, deterministic):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("miles_ext_kernels::cake_gated_rmsnorm_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
            deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return gated_bwd(dy, x, z, weight, eps, deterministic)


@_bwd_op.register_fake
def _bwd_fake(dy, x, z, weight, eps, deterministic):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(weight.shape, dtype=weight.dtype, device=weight.device))


def _setup_context(ctx, inputs, output):
    x, z, weight, eps, deterministic = inputs
    ctx.save_for_backward(x, z, weight)
    ctx.eps = eps
    ctx.deterministic = deterministic


def _backward(ctx, dy):
    x, z, weight = ctx.saved_tensors
    dx, dz, dw = _bwd_op(dy, x, z, weight, ctx.eps, ctx.deterministic)
    return dx, dz, dw, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def rmsnorm_silu_gate(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * weight * silu(z); see `cake.gated_rmsnorm.rmsnorm_silu_gate`."""
    D = check_args(x, z, weight, eps)
    deterministic = config.variant(OP) == "det"
    if torch.compiler.is_compiling():
        return _fwd_op(x, z, weight, float(eps), deterministic)
    return _GatedFn.apply(x, z, weight, float(eps), deterministic, D)


# ------------------------------------------------------------------------------------------------------------------
def routes(*, head_dim: int):
    """Every kernel specialization a call with head dim `head_dim` can launch: both variants, both weight dtypes,
    every row-count window."""
    _decl.check_supported(head_dim)
    D = head_dim
    rs = build.RouteSet()
    add = rs.add

    bf = torch.bfloat16
    for wdt in W_DTYPES:
        wn = str(wdt).replace("torch.", "")
        for window in WINDOWS:
            bm, bd, nw, ns = fwd_config(D, window)
            add(kernels._gated_fwd_kernel, (bf, bf, wdt, bf, 4096, 32, 32 * D, D, 32 * D, D, 1e-6),
                dict(D=D, BLOCK_M=bm, BLOCK_D=bd, num_warps=nw, num_stages=ns),
                f"gated_rmsnorm.fwd[D={D},w={wn},{'+'.join(v for v in WINDOWS if fwd_config(D, v) == fwd_config(D, window))}]")
            for variant in (("det", "fast") if FAST_DW_ATOMIC else ("det+fast",)):
                bm, bd, nw, ns, _ = bwd_config(D, window)
                add(kernels._gated_bwd_kernel,
                    (bf, bf, wdt, bf, bf, bf, torch.float32, 4096, 32, 32 * D, D, 32 * D, D, 32 * D, D, 16, 1e-6),
                    dict(D=D, BLOCK_M=bm, BLOCK_D=bd, STAGES=ns, ATOMIC=variant == "fast", num_warps=nw,
                         num_stages=ns),
                    f"gated_rmsnorm.bwd[D={D},w={wn},{variant},{'+'.join(v for v in WINDOWS if bwd_config(D, v) == bwd_config(D, window))}]")
    return rs.routes + _reduce.routes("gated_rmsnorm.")
