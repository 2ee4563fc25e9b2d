"""Zero-centred RMSNorm: checks, launchers, autograd, the module.

Launchers (`rmsnorm_forward`, `rmsnorm_backward`: allocate, pick the config, launch through `_runtime.launch`; no
autograd) -> `KernelOp` (custom ops `miles_ext_kernels::rmsnorm_fwd/bwd`, one autograd.Function that saves x and
the weight: rstd is recomputed in the backward, which costs no extra bytes) -> the public `zero_centered_rmsnorm` /
`ZeroCenteredRMSNorm`. `routes()` runs the launchers on meta tensors, so prebuild compiles exactly what they launch.

Weight gradient: each persistent backward program writes its fp32 partial row into a workspace, and the same launch
sums those rows in a fixed order (`_runtime.reduce.fixed_order_finish`: the last program of each group of GROUP
sums its group, the last group sums the groups; counters per device and stream, reset by the kernel), so a
backward is one launch and its bits depend only on the token count. Both variants launch these kernels (an atomic
weight-gradient sum measured no faster on the H200: bench/NOTES.md, norms), so `fast` is `det`. y and dx are
computed one row at a time and always repeat bit for bit. Launch configs: configs.py.
"""
from __future__ import annotations

import torch

from miles_ext_kernels.cake import rmsnorm as _decl
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


def check_args(x, weight, eps) -> int:
    """Host-side checks (ValueError/TypeError naming the argument); returns the width H."""
    checks.check_tensor("x", x, dtype=X_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dimension [..., hidden_size], got shape {tuple(x.shape)}")
    H = x.shape[-1]
    _norms.check_weight_and_eps([("x", x)], weight, eps, H, "x's last dimension", _decl.check_supported)
    return H


def _rows(t: torch.Tensor, name: str, H: int) -> tuple:
    """(tensor, row stride): `t` read as `[T, H]` rows in place when its rows have unit column stride, a row stride
    that is a multiple of 8 elements and a 16-byte aligned start (what the kernels' vector loads assume); a counted
    contiguous copy otherwise."""
    if _norms.aligned_contiguous(t):
        return t, H
    v = operand(t, OP, name, view=(-1, H), stride_multiple=8)
    return v, (v.stride(0) if v.shape[0] > 1 else H)


# ------------------------------------------------------------------------------------------------------------------
# launchers (checked operands; no autograd). `cfg` / `programs` override the table (benchmarks, tests).
def _fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, cfg=None) -> torch.Tensor:
    arch = arch_of(x, "x")
    H = x.shape[-1]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    T = x.numel() // H
    if T == 0:
        return y
    x2, sx = _rows(x, "x", H)
    w = _norms.weight_operand(weight, OP)
    bm, nw, ns = cfg or _norms.table_configs(configs.ROWS, H, T, arch)[0]
    ba, bb = configs.split(H)
    launch(kn._rmsnorm_fwd_kernel, (build.cdiv(T, bm),), x_ptr=x2, w_ptr=w, y_ptr=y, T=T, stride_x=sx, stride_y=H,
           eps=eps, H=H, BLOCK_M=bm, BLOCK_A=ba, BLOCK_B=bb, num_warps=nw, num_stages=ns)
    return y


def _bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, cfg=None, programs=None) -> tuple:
    arch = arch_of(x, "x")
    H = x.shape[-1]
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    T = x.numel() // H
    if T == 0:
        return dx, _norms.zero_weight_grad(weight)
    x2, sx = _rows(x, "x", H)
    dy2, sdy = _rows(dy, "dy", H)
    w = _norms.weight_operand(weight, OP)
    _, bcfg, P = _norms.table_configs(configs.ROWS, H, T, arch)
    bm, nw, st, kahan = cfg or bcfg
    rows_per_prog, grid = _reduce.row_split(T, programs or P, bm)
    ba, bb = configs.split(H)
    dw = torch.empty(H, dtype=weight.dtype, device=weight.device)
    part = _norms.partial_rows(OP, _reduce.finish_rows(grid, configs.GROUP) * H, weight)
    launch(kn._rmsnorm_bwd_kernel, (grid,), x_ptr=x2, w_ptr=w, dy_ptr=dy2, dx_ptr=dx, part_ptr=part,
           cnt_ptr=_norms.counters(x), dw_ptr=dw, T=T, stride_x=sx, stride_dy=sdy, stride_dx=H,
           rows_per_prog=rows_per_prog, eps=eps, H=H, BLOCK_M=bm, BLOCK_A=ba, BLOCK_B=bb, STAGES=st,
           GROUP=configs.GROUP, RED_C=64 * nw, KAHAN=kahan, num_warps=nw, num_stages=st)
    return dx, dw


def rmsnorm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, variant: str) -> tuple[torch.Tensor]:
    """(y,): y in x's dtype and shape, contiguous. Both variants launch the same kernel."""
    return (_fwd(x, weight, eps),)


def rmsnorm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
                     variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx in x's dtype and shape, dw `[H]` in the weight's dtype); `variant` is the forward's."""
    return _bwd(dy, x, weight, eps)


def _forward_fake(x, weight, eps, variant):
    return (x.new_empty(x.shape),)


def _backward_fake(dy, x, weight, eps, variant):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _setup(inputs, res):
    x, weight, eps, variant = inputs
    return (x, weight), (eps, variant)


RMSNORM = KernelOp(OP, forward=rmsnorm_forward, forward_fake=_forward_fake, setup=_setup, backward=rmsnorm_backward,
                   backward_fake=_backward_fake, grad_inputs=(0, 1))


def rmsnorm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, *, cfg=None) -> torch.Tensor:
    """The forward launcher with checks, outside autograd (benchmarks, tests): y. `cfg` = (BLOCK_M, num_warps,
    num_stages) overrides the table."""
    check_args(x, weight, eps)
    with build.device_guard(x):
        return _fwd(x, weight, float(eps), cfg)


def rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, *, cfg=None, programs=None):
    """The backward launcher with checks, outside autograd (benchmarks, tests): (dx, dw). `cfg` = (BLOCK_M,
    num_warps, STAGES, KAHAN) and `programs` override the table."""
    check_args(x, weight, eps)
    _norms.check_dy(dy, x)
    with build.device_guard(dy):
        return _bwd(dy, x, weight, float(eps), cfg, programs)


def zero_centered_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * (1 + weight); see `cake.rmsnorm.zero_centered_rmsnorm`."""
    check_args(x, weight, eps)
    return RMSNORM(x, weight, float(eps))


# ------------------------------------------------------------------------------------------------------------------
class ZeroCenteredRMSNorm(torch.nn.Module):
    """Zero-centred RMSNorm module; see `cake.rmsnorm.ZeroCenteredRMSNorm`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, *, device=None, dtype=None, sequence_parallel=None):
        super().__init__()
        checks.check_host_int("hidden_size", hidden_size, minimum=1)
        _decl.check_supported(hidden_size)
        checks.check_eps(eps)
        if dtype is not None and dtype not in W_DTYPES:
            raise TypeError(f"dtype must be float32 or bfloat16, got {dtype}")
        if sequence_parallel is not None and not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel must be a bool or None, got {type(sequence_parallel).__name__}")
        self.hidden_size = hidden_size
        self.eps = float(eps)
        self.sequence_parallel = sequence_parallel
        self.weight = torch.nn.Parameter(
            torch.empty(hidden_size, device=_default_device(device), dtype=dtype or torch.float32))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Zero the weight (1 + w = 1) and (re)mark it for sequence parallelism when asked to."""
        with torch.no_grad():
            self.weight.zero_()
        if self.sequence_parallel is not None:
            setattr(self.weight, "sequence_parallel", self.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zero_centered_rmsnorm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}"


def _default_device(device):
    """`device` if given; else where torch's factories allocate when that is not the CPU (a `torch.device(...)`
    context, `torch.set_default_device`); else the current CUDA device (the CPU when no GPU is visible)."""
    if device is not None:
        try:
            return torch.device(device)
        except RuntimeError as e:  # torch rejects a malformed device string with a RuntimeError
            raise ValueError(f"device must be a torch.device, a device string such as 'cuda:0' or an index, got "
                             f"{device!r} ({e})") from None
    default = torch.get_default_device()
    if default.type != "cpu":
        return default
    if torch.cuda.is_available() and not build.INTERPRET:
        return torch.device("cuda", torch.cuda.current_device())
    return default


# ------------------------------------------------------------------------------------------------------------------
def routes(*, hidden_size: int):
    """Every kernel specialization a call of width `hidden_size` can launch: the launchers above run on meta tensors
    for both weight dtypes, both token-count windows (SMALL_T and SMALL_T + 1 rows) and both variants, and record
    their launches (the persistent backward's program count is the table arch's, 132 SMs on sm_90a, for meta
    tensors as for real ones; no specialized argument depends on it)."""
    _decl.check_supported(hidden_size)
    H = hidden_size

    def run(wdt, T, variant):
        x = torch.empty(T, H, dtype=torch.bfloat16, device="meta")
        w = torch.empty(H, dtype=wdt, device="meta")
        rmsnorm_forward(x, w, 1e-6, variant)
        rmsnorm_backward(x, x, w, 1e-6, variant)

    return _norms.routes({"small": configs.SMALL_T, "large": configs.SMALL_T + 1}, run)
