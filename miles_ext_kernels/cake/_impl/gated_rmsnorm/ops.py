"""Gated RMSNorm RMSNorm(x) * w * SiLU(z): checks, launchers, autograd.

Launchers (`gated_forward`, `gated_backward`: allocate, pick the config, launch through `_runtime.launch`; no
autograd) -> `KernelOp` (custom ops `miles_ext_kernels::gated_rmsnorm_fwd/bwd`, one autograd.Function that saves x,
z and the weight; rstd is recomputed in the backward) -> the public `rmsnorm_silu_gate`. `routes()` runs the
launchers on meta tensors, so prebuild compiles exactly what they launch.

Operands are read in place as `[T, NH, D]` views (row = token x head) when their last stride is 1, their token and
head strides are multiples of 8 elements and they start 16-byte aligned; z is typically a column slice of the fused
`[q | k | v | z | b | a]` projection, whose token stride is the projection width. Anything else is copied first
(counted by `_runtime.operands.copies(OP)`, so tests can tell which path ran).

Weight gradient: one fp32 partial row per persistent backward program, summed in a fixed order by a second launch
(`_norms.reduce_columns`). Both variants launch these kernels (an atomic sum measured no faster on the H200:
bench/NOTES.md, norms), so `fast` is `det`. Launch configs: configs.py.
"""
from __future__ import annotations

import torch

from miles_ext_kernels.cake import gated_rmsnorm as _decl
from miles_ext_kernels.cake._runtime import build, checks
from miles_ext_kernels.cake._runtime import reduce as _reduce
from miles_ext_kernels.cake._runtime.autograd import KernelOp
from miles_ext_kernels.cake._runtime.launch import arch_of, launch
from miles_ext_kernels.cake._runtime.operands import operand

from .. import _norms
from . import configs
from . import kernels as kn

OP = _decl.OP.name
X_DTYPES = _norms.X_DTYPES
W_DTYPES = _norms.W_DTYPES


def _lead_shape(x: torch.Tensor) -> tuple[int, int]:
    """(T, NH): x is `[N, D]` (NH = 1), `[T, NH, D]`, or `[..., NH, D]` (leading dims flattened into T)."""
    if x.dim() == 2:
        return x.shape[0], 1
    T = 1
    for s in x.shape[:-2]:
        T *= s
    return T, x.shape[-2]


def _rows(t: torch.Tensor, name: str, T: int, NH: int, D: int) -> tuple:
    """(tensor, stride_t, stride_h) for the kernels: `t` as a `[T, NH, D]` view in place when the layout allows, a
    counted contiguous copy otherwise (strides of length-1 dims passed as 0)."""
    if _norms.aligned_contiguous(t):
        return t, (NH * D if T > 1 else 0), (D if NH > 1 else 0)
    v = operand(t, OP, name, view=(T, NH, D), stride_multiple=8)
    return v, (v.stride(0) if T > 1 else 0), (v.stride(1) if NH > 1 else 0)


def check_args(x, z, weight, eps) -> int:
    """Host-side checks (ValueError/TypeError naming the argument); returns the head dim D."""
    checks.check_tensor("x", x, dtype=X_DTYPES)
    if x.dim() < 2:
        raise ValueError(f"x must be [N, D] or [..., H_v, D], got shape {tuple(x.shape)}")
    checks.check_tensor("z", z, dtype=X_DTYPES)
    if z.shape != x.shape:
        raise ValueError(f"z has shape {tuple(z.shape)} but x has {tuple(x.shape)}")
    D = x.shape[-1]
    _norms.check_weight_and_eps([("x", x), ("z", z)], weight, eps, D, "x's head dim", _decl.check_supported)
    return D


# ------------------------------------------------------------------------------------------------------------------
# launchers (checked operands; no autograd). `cfg` / `programs` override the table (benchmarks, tests).
def _fwd(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, cfg=None) -> torch.Tensor:
    arch = arch_of(x, "x")
    D = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    T, NH = _lead_shape(x)
    N = T * NH
    if N == 0:
        return y
    xv, sxt, sxh = _rows(x, "x", T, NH, D)
    zv, szt, szh = _rows(z, "z", T, NH, D)
    w = _norms.weight_operand(weight, OP)
    bm, bd, nw, ns = cfg or _norms.table_configs(configs.ROWS, D, N, arch)[0]
    launch(kn._gated_fwd_kernel, (build.cdiv(N, bm),), x_ptr=xv, z_ptr=zv, w_ptr=w, y_ptr=y, N=N, NH=NH, sxt=sxt,
           sxh=sxh, szt=szt, szh=szh, eps=eps, D=D, BLOCK_M=bm, BLOCK_D=bd, num_warps=nw, num_stages=ns)
    return y


def _bwd(dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, cfg=None,
         programs=None) -> tuple:
    arch = arch_of(x, "x")
    D = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    dz = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    T, NH = _lead_shape(x)
    N = T * NH
    if N == 0:
        return dx, dz, _norms.zero_weight_grad(weight)
    xv, sxt, sxh = _rows(x, "x", T, NH, D)
    zv, szt, szh = _rows(z, "z", T, NH, D)
    gv, sgt, sgh = _rows(dy, "dy", T, NH, D)
    w = _norms.weight_operand(weight, OP)
    _, bcfg, P = _norms.table_configs(configs.ROWS, D, N, arch)
    bm, bd, nw, ns = cfg or bcfg
    rows_per_prog, grid = _reduce.row_split(N, programs or P, bm)
    dw = torch.empty(D, dtype=weight.dtype, device=weight.device)
    part = _norms.partial_rows(OP, grid * D, weight)
    launch(kn._gated_bwd_kernel, (grid,), x_ptr=xv, z_ptr=zv, w_ptr=w, dy_ptr=gv, dx_ptr=dx, dz_ptr=dz, dw_ptr=part,
           N=N, NH=NH, sxt=sxt, sxh=sxh, szt=szt, szh=szh, sgt=sgt, sgh=sgh, rows_per_prog=rows_per_prog, eps=eps,
           D=D, BLOCK_M=bm, BLOCK_D=bd, STAGES=ns, num_warps=nw, num_stages=ns)
    return dx, dz, _norms.reduce_columns(part, grid, D, dw)


def gated_forward(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                  variant: str) -> tuple[torch.Tensor]:
    """(y,): y in x's dtype and shape, contiguous. Both variants launch the same kernel."""
    return (_fwd(x, z, weight, eps),)


def gated_backward(dy: torch.Tensor, x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                   variant: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dz in x's dtype and shape, contiguous; dw `[D]` in the weight's dtype); `variant` is the forward's."""
    return _bwd(dy, x, z, weight, eps)


def _forward_fake(x, z, weight, eps, variant):
    return (x.new_empty(x.shape),)


def _backward_fake(dy, x, z, weight, eps, variant):
    return x.new_empty(x.shape), x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup(inputs, res):
    x, z, weight, eps, variant = inputs
    return (x, z, weight), (eps, variant)


GATED = KernelOp(OP, forward=gated_forward, forward_fake=_forward_fake, setup=_setup, backward=gated_backward,
                 backward_fake=_backward_fake, grad_inputs=(0, 1, 2))


def gated_fwd(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float, *, cfg=None) -> torch.Tensor:
    """The forward launcher with checks, outside autograd (benchmarks, tests): y. `cfg` = (BLOCK_M, BLOCK_D,
    num_warps, num_stages) overrides the table."""
    check_args(x, z, weight, eps)
    with build.device_guard(x):
        return _fwd(x, z, weight, float(eps), cfg)


def gated_bwd(dy, x, z, weight, eps: float, *, cfg=None, programs=None):
    """The backward launcher with checks, outside autograd (benchmarks, tests): (dx, dz, dw). `cfg` = (BLOCK_M,
    BLOCK_D, num_warps, STAGES) and `programs` override the table."""
    check_args(x, z, weight, eps)
    _norms.check_dy(dy, x)
    with build.device_guard(dy):
        return _bwd(dy, x, z, weight, float(eps), cfg, programs)


def rmsnorm_silu_gate(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * weight * silu(z); see `cake.gated_rmsnorm.rmsnorm_silu_gate`."""
    check_args(x, z, weight, eps)
    return GATED(x, z, weight, float(eps))


# ------------------------------------------------------------------------------------------------------------------
def routes(*, head_dim: int):
    """Every kernel specialization a call with head dim `head_dim` can launch: the launchers above run on meta tensors
    for both weight dtypes, both row-count windows (SMALL_N and SMALL_N + 32 rows: 32 heads) and both variants, and
    record their launches, the weight gradient's fixed-order sum included (the persistent backward's program count is
    the table arch's, 132 SMs on sm_90a, for meta tensors as for real ones; no specialized argument depends on
    it)."""
    _decl.check_supported(head_dim)
    D, NH = head_dim, 32

    def run(wdt, N, variant):
        x = torch.empty(N // NH, NH, D, dtype=torch.bfloat16, device="meta")
        w = torch.empty(D, dtype=wdt, device="meta")
        gated_forward(x, x, w, 1e-6, variant)
        gated_backward(x, x, x, w, 1e-6, variant)

    return _norms.routes({"small": configs.SMALL_N, "large": configs.SMALL_N + NH}, run)
