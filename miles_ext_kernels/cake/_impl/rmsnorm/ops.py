"""Zero-centred RMSNorm: checks, launchers, the torch.library custom ops (with autograd and fake kernels).

Layers: kernels.py (@triton.jit) -> launchers here (`rmsnorm_fwd`, `rmsnorm_bwd`: allocate, pick the route,
launch; no autograd) -> custom ops `miles_ext_kernels::cake_rmsnorm_fwd/bwd` with `register_autograd` (the
autograd function: saves x and the weight, nothing else; rstd is recomputed in the backward, which costs no
extra bytes) -> the public `zero_centered_rmsnorm` / `ZeroCenteredRMSNorm`.

Weight gradient: each persistent backward program writes its fp32 partial row into a workspace, and the same launch
sums those rows in a fixed order (`_runtime.reduce.fixed_order_finish`: the last program of each group of GROUP
sums its group, the last group sums the groups; counters per device and stream, reset by the kernel), so a
backward is one launch and its bits depend only on the token count. The kernel can instead add the rows atomically
into one fp32 row (`FAST_DW_ATOMIC`, for the fast variant); that measured no faster on the H200, so the table
keeps it off and fast runs the det path. y and dx are computed one row at a time and always repeat bit for bit.

Host path: eager calls use a plain autograd.Function (the custom ops only while torch.compile traces), and launch
through the Triton JIT.
"""
from __future__ import annotations

from collections import Counter

import torch
from torch.autograd.function import once_differentiable
import triton

from miles_ext_kernels.cake import rmsnorm as _decl
from miles_ext_kernels.cake._runtime import reduce as _reduce
from miles_ext_kernels.cake._runtime import build, checks, config

from . import kernels

OP = "rmsnorm"
X_DTYPES = (torch.bfloat16,)
W_DTYPES = (torch.float32, torch.bfloat16)

# ------------------------------------------------------------------------------------------------------------------
# Fixed configuration table (no autotuning: the same table in every process gives the same bits).
# Token-count windows: calls with T <= SMALL_T rows use the "small" forward configs (fewer rows per program, so
# short calls still spread over the SMs); longer calls use "large". The backward is persistent: a fixed number of
# programs per SM (not the live SM count), so the partial-row layout, and therefore the det weight gradient's bits,
# depend only on the token count. Picked from the H200 sweep in bench/NOTES.md, norms.
SMALL_T = 1024
WINDOWS = ("small", "large")
# The fast variant may add the weight-gradient rows with atomics (no fixed order). On the H200 that was not faster
# than the fixed-order two-stage sum (bench/NOTES.md, norms, v1), and less accurate, so fast runs the det path.
FAST_DW_ATOMIC = False


def _pow2(n: int) -> int:
    return triton.next_power_of_2(n)


_splits: dict = {}


def split(H: int) -> tuple[int, int]:
    """(BLOCK_A, BLOCK_B): a row as a power-of-two tile [0, BLOCK_A) and, when H is not a power of two, a second
    tile of next_pow2(H - BLOCK_A) columns (masked); H 5120 = 4096 + 1024, 2560 = 2048 + 512, 7168 = 4096 + 4096."""
    s = _splits.get(H)
    if s is None:
        a = 1 << (H.bit_length() - 1)
        s = _splits[H] = (a, (_pow2(H - a) if H > a else 0))
    return s


# Forward, large window, by padded width: (BLOCK_M, num_warps); narrower rows scale BLOCK_M up from the 2048 entry.
FWD_TABLE = {2048: (2, 8), 4096: (2, 8), 8192: (2, 8), 16384: (1, 16)}


def fwd_config(H: int, window: str):
    """(BLOCK_M, num_warps, num_stages) of the forward for width H (one tile of BLOCK_M rows per program)."""
    bn = _pow2(H)
    if window == "small":
        return max(1, 2048 // bn), (4 if bn <= 2048 else 8), 1
    if bn <= 2048:
        bm, nw = FWD_TABLE[2048]
        return bm * 2048 // bn, nw, 1
    return (*FWD_TABLE[bn], 1)


# Backward, by padded width: (BLOCK_M, num_warps, STAGES = row blocks of loads in flight + 1, KAHAN = compensated
# weight-gradient sum, programs per SM).
BWD_TABLE = {2048: (4, 8, 3, True, 1), 4096: (1, 8, 3, True, 2), 8192: (1, 8, 3, True, 1), 16384: (1, 16, 2, True, 1)}
GROUP = 16  # partial rows per group of the in-launch fixed-order weight-gradient sum


# Exact widths whose registers allow another tile than their padded width's entry (checked before BWD_TABLE).
# H 5120 without the Kahan compensation fits two 8-warp CTAs per SM: 0.280 vs 0.355 ms at 32k tokens on the H200,
# dw error vs FP64 at 8k tokens 1.44e-7 vs 1.05e-7 (Liger 1.70e-7 on another input; all from scratch sweeps recorded
# in bench/NOTES.md, norms v4); at H 7168 / 8192 the plain sum was slower.
BWD_BY_WIDTH: dict = {5120: (1, 8, 3, False, 2)}


def bwd_config(H: int, window: str):
    """(BLOCK_M, num_warps, STAGES, KAHAN, programs per SM) of the backward (both windows: same)."""
    if H in BWD_BY_WIDTH:
        return BWD_BY_WIDTH[H]
    bn = _pow2(H)
    if bn <= 2048:
        bm, nw, st, kahan, pps = BWD_TABLE[2048]
        return max(1, bm * 2048 // bn), nw, st, kahan, pps
    return BWD_TABLE[bn]


_configs = _reduce.RowConfigs(fwd_config, bwd_config, SMALL_T)
window_of = _configs.window


# ------------------------------------------------------------------------------------------------------------------
# operand handling
COPIES: Counter = Counter()  # how often an operand had to be copied before a launch, by argument name


def _rows(t: torch.Tensor, H: int, name: str):
    """(tensor, row stride): `t` read as `[T, H]` rows with unit column stride, a row stride that is a multiple of 8
    elements and a 16-byte aligned start (what the kernels' vector loads assume); a contiguous copy otherwise."""
    if t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t, H
    if t.dim() >= 1 and t.stride(-1) == 1:
        try:
            v = t.view(-1, H)
        except RuntimeError:
            v = None
        if v is not None and (v.shape[0] <= 1 or v.stride(0) % 8 == 0) and v.data_ptr() % 16 == 0:
            return v, (v.stride(0) if v.shape[0] > 1 else H)
    COPIES[name] += 1
    out = torch.empty((t.numel() // H, H), dtype=t.dtype, device=t.device)
    out.copy_(t.reshape(-1, H))
    return out, H


def _weight(w: torch.Tensor) -> torch.Tensor:
    if w.stride(0) == 1 and w.data_ptr() % 16 == 0:
        return w
    COPIES["weight"] += 1
    return w.clone(memory_format=torch.contiguous_format) if w.stride(0) == 1 else w.contiguous()


def check_args(x, weight, eps) -> int:
    """Host-side checks (ValueError/TypeError naming the argument); returns the width H."""
    checks.check_tensor("x", x, dtype=X_DTYPES)
    if x.dim() < 1:
        raise ValueError(f"x must have at least 1 dimension [..., hidden_size], got shape {tuple(x.shape)}")
    checks.check_tensor("weight", weight, dtype=W_DTYPES, ndim=1)
    H = x.shape[-1]
    if weight.shape[0] != H:
        raise ValueError(f"weight has {weight.shape[0]} elements but x's last dimension is {H}")
    checks.check_same_device([("x", x), ("weight", weight)])
    checks.check_eps(eps)
    try:
        _decl.check_supported(H)
    except ValueError as e:
        raise ValueError(f"x's last dimension: {e}") from None
    return H


# ------------------------------------------------------------------------------------------------------------------
# launchers: `_fwd` / `_bwd` assume checked arguments (the hot path); `rmsnorm_fwd` / `rmsnorm_bwd` check first.
def _launch(kernel, grid: int, args: tuple, constexprs: dict, num_warps: int, num_stages: int) -> None:
    kernel[(grid,)](*args, **constexprs, num_warps=num_warps, num_stages=num_stages)


@build.on_input_device
def _fwd(x, weight, eps: float, H: int, cfg=None):
    arch = _reduce.table_arch(x)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    T = x.numel() // H
    if T == 0:
        return y
    x2, sx = _rows(x, H, "x")
    w = _weight(weight)
    bm, nw, ns = cfg or _configs(H, T, arch)[0]
    ba, bb = split(H)
    _launch(kernels._rmsnorm_fwd_kernel, -(-T // bm), (x2, w, y, T, sx, H, eps), dict(H=H, BLOCK_M=bm, BLOCK_A=ba, BLOCK_B=bb), nw, ns)
    return y


@build.on_input_device
def _bwd(dy, x, weight, eps: float, deterministic: bool, H: int, cfg=None, programs=None, atomic=None):
    arch = _reduce.table_arch(x)
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    T = x.numel() // H
    if T == 0:
        return dx, torch.zeros_like(weight, memory_format=torch.contiguous_format)
    x2, sx = _rows(x, H, "x")
    dy2, sdy = _rows(dy, H, "dy")
    w = _weight(weight)
    _, bcfg, P = _configs(H, T, arch)
    bm, nw, st, kahan = cfg or bcfg
    P = programs or P
    rows_per_prog, grid = _reduce.row_split(T, P, bm)
    atomic = (not deterministic and FAST_DW_ATOMIC) if atomic is None else atomic
    ba, bb = split(H)
    consts = dict(H=H, BLOCK_M=bm, BLOCK_A=ba, BLOCK_B=bb, STAGES=st, GROUP=GROUP, RED_C=64 * nw, KAHAN=kahan,
                  ATOMIC=atomic)
    if atomic:
        dw, target = _reduce.weight_grad_buffers(OP, grid, H, weight, True)
        _launch(kernels._rmsnorm_bwd_kernel, grid, (x2, w, dy2, dx, target, target, target, T, sx, sdy, H, rows_per_prog, eps), consts, nw, st)
        return dx, _reduce.finish_weight_grad(dw, target, grid, H, True)
    dw = torch.empty(H, dtype=weight.dtype, device=weight.device)
    part = _reduce.partial_rows(OP, _reduce.finish_rows(grid, GROUP) * H, weight.device)
    cnt = _reduce.counters(x)
    _launch(kernels._rmsnorm_bwd_kernel, grid, (x2, w, dy2, dx, part, cnt, dw, T, sx, sdy, H, rows_per_prog, eps), consts, nw, st)
    return dx, dw


def rmsnorm_fwd(x: torch.Tensor, weight: torch.Tensor, eps: float, *, cfg=None) -> torch.Tensor:
    """y (x's dtype and shape, contiguous). `cfg` overrides the table (benchmarks only)."""
    H = check_args(x, weight, eps)
    return _fwd(x, weight, float(eps), H, cfg)


def rmsnorm_bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float, deterministic: bool, *,
                cfg=None, programs=None, atomic=None):
    """(dx in x's dtype and shape, dw in weight's dtype). `cfg` / `programs` / `atomic` override the table
    (benchmarks)."""
    H = check_args(x, weight, eps)
    checks.check_tensor("dy", dy, dtype=X_DTYPES)
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but x has {tuple(x.shape)}")
    return _bwd(dy, x, weight, float(eps), deterministic, H, cfg, programs, atomic)


# ------------------------------------------------------------------------------------------------------------------
# eager autograd: a plain autograd.Function (a torch.library custom op costs ~100 us of host time per call in
# eager mode, more than the kernel at 32k tokens); under torch.compile the custom op below is traced instead.
class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, deterministic, H):
        ctx.save_for_backward(x, weight)
        ctx.eps, ctx.deterministic, ctx.H = eps, deterministic, H
        return _fwd(x, weight, eps, H)

    @staticmethod
    @once_differentiable  # a second derivative raises instead of silently carrying no history
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dx, dw = _bwd(dy, x, weight, ctx.eps, ctx.deterministic, ctx.H)
        return dx, dw, None, None, None


# ------------------------------------------------------------------------------------------------------------------
# custom ops (torch.compile traces these; fake kernels give shapes)
@torch.library.custom_op("miles_ext_kernels::cake_rmsnorm_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float, deterministic: bool) -> torch.Tensor:
    return rmsnorm_fwd(x, weight, eps)


@_fwd_op.register_fake
def _fwd_fake(x, weight, eps, deterministic):
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@torch.library.custom_op("miles_ext_kernels::cake_rmsnorm_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, eps: float,
            deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return rmsnorm_bwd(dy, x, weight, eps, deterministic)


@_bwd_op.register_fake
def _bwd_fake(dy, x, weight, eps, deterministic):
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(weight.shape, dtype=weight.dtype, device=weight.device))


def _setup_context(ctx, inputs, output):
    x, weight, eps, deterministic = inputs
    ctx.save_for_backward(x, weight)
    ctx.eps = eps
    ctx.deterministic = deterministic


def _backward(ctx, dy):
    x, weight = ctx.saved_tensors
    dx, dw = _bwd_op(dy, x, weight, ctx.eps, ctx.deterministic)
    return dx, dw, None, None


_fwd_op.register_autograd(_backward, setup_context=_setup_context)


def zero_centered_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2) + eps) * (1 + weight); see `cake.rmsnorm.zero_centered_rmsnorm`."""
    H = check_args(x, weight, eps)
    deterministic = config.variant(OP) == "det"
    if torch.compiler.is_compiling():
        return _fwd_op(x, weight, float(eps), deterministic)
    return _RMSNormFn.apply(x, weight, float(eps), deterministic, H)


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
    """Every kernel specialization a call of width `hidden_size` can launch: both variants, both weight dtypes,
    every token-count window."""
    _decl.check_supported(hidden_size)
    H = hidden_size
    rs = build.RouteSet()
    add = rs.add

    bf = torch.bfloat16
    ba, bb = split(H)
    for wdt in W_DTYPES:
        wn = str(wdt).replace("torch.", "")
        for window in WINDOWS:
            bm, nw, ns = fwd_config(H, window)
            add(kernels._rmsnorm_fwd_kernel, (bf, wdt, bf, 4096, H, H, 1e-6),
                dict(H=H, BLOCK_M=bm, BLOCK_A=ba, BLOCK_B=bb, num_warps=nw, num_stages=ns), f"rmsnorm.fwd[H={H},w={wn},{'+'.join(v for v in WINDOWS if fwd_config(H, v) == fwd_config(H, window))}]")
            for variant in (("det", "fast") if FAST_DW_ATOMIC else ("det+fast",)):
                bm, nw, st, kahan, _ = bwd_config(H, window)
                add(kernels._rmsnorm_bwd_kernel,
                    (bf, wdt, bf, bf, torch.float32, *((torch.float32,) * 2 if variant == "fast" else (torch.int32, wdt)),
                     4096, H, H, H, 16, 1e-6),
                    dict(H=H, BLOCK_M=bm, BLOCK_A=ba, BLOCK_B=bb, STAGES=st, GROUP=GROUP, RED_C=64 * nw,
                         KAHAN=kahan, ATOMIC=variant == "fast", num_warps=nw, num_stages=st),
                    f"rmsnorm.bwd[H={H},w={wn},{variant},{'+'.join(v for v in WINDOWS if bwd_config(H, v) == bwd_config(H, window))}]")
    return rs.routes + _reduce.routes("rmsnorm.")  # the reduction: the atomic path's bf16 cast
