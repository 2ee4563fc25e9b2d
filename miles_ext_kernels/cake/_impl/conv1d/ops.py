"""conv1d: checks, launchers, autograd and torch.library registration.

Layers: kernels (kernels.py) -> launchers `_fwd` / `_bwd` (allocate, pick the config, build the grid; no autograd)
-> eager: `_Conv1dFn` (torch.autograd.Function); under torch.compile: custom ops
`miles_ext_kernels::cake_conv1d_fwd` / `cake_conv1d_bwd` (+ fake kernels) with `register_autograd`, so a fullgraph
trace sees one opaque op (the custom-op dispatch costs host time eager calls need not pay) -> `causal_conv1d`.
The variant and the silu-grad option are read when the forward runs and saved for the backward (under
torch.compile: when the graph is traced).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..._runtime import build, checks, config, workspace
from ..._runtime.launch import arch_of, collect_routes, launch
from ..._runtime.operands import operand
from . import configs, kernels

OP = "conv1d"

_WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_ACT_NAMES = {None: 0, "silu": 1, "swish": 1}


def _operands(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Optional[torch.Tensor]):
    """(x, weight, cu_seqlens, n_seq, n_iter) as the kernels read them. x is read in place with any row stride (a
    column slice of a packed projection: ALIGN=1 routes take strides that are not multiples of 8) once it starts
    16-byte aligned, as the routes are compiled for aligned pointers; the weight and cu_seqlens (int32 or int64,
    the kernels load either) are indexed densely."""
    x = operand(x, OP, "x")
    w = operand(weight, OP, "weight", contiguous=True)
    if cu_seqlens is None:
        return x, w, None, 0, 0
    cu = operand(cu_seqlens, OP, "cu_seqlens", contiguous=True)
    n_seq = cu.numel() - 1
    return x, w, cu, n_seq, max(1, n_seq.bit_length())


def _align(D: int, *strides: int) -> int:
    """ALIGN: 8 when D and the row strides allow 16-byte rows (the kernels see them divided by it and vectorize)."""
    return 8 if D % 8 == 0 and all(s % 8 == 0 for s in strides) else 1


# ---------------------------------------------------------------------------------------------------- launchers
@build.on_input_device
def conv1d_forward(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Optional[torch.Tensor], act: int,
                   variant: str = "det") -> torch.Tensor:
    """y [T, D] (x's dtype, contiguous) of x [T, D], weight [D, W], cu_seqlens [N + 1] or None; act: 0 none,
    1 SiLU. Operands already checked."""
    T, D = x.shape
    W = weight.shape[1]
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T == 0 or D == 0:
        return y
    cfg = configs.CONFIGS[arch_of(x, "x")]["fwd"]
    x, w, cu, n_seq, n_iter = _operands(x, weight, cu_seqlens)
    sx = x.stride(0) if T > 1 else D
    al = _align(D, sx)
    launch(kernels.conv1d_fwd_kernel, (build.cdiv(T, cfg["CHUNK"]), build.cdiv(D, cfg["BLOCK_D"])), x_ptr=x,
           w_ptr=w, y_ptr=y, cu_ptr=cu, T=T, D_a=D // al, sx_a=sx // al, sy_a=D // al, n_seq=n_seq, n_iter=n_iter,
           W=W, ACT=act, HAS_CU=cu is not None, ALIGN=al, **cfg)
    return y


@build.on_input_device
def conv1d_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                    act_mode: int, variant: str = "det") -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [T, D] in x's dtype, dw [D, W] in weight's dtype), both contiguous. act_mode: 0 no activation, 1 SiLU'
    at the bf16-rounded pre-activation, 2 at the exact fp32 one. Both variants run these kernels: dw partials per
    token block, reduced in a fixed order (fp32 atomics into [D, W] were measured slower on the H200)."""
    T, D = x.shape
    W = weight.shape[1]
    dx = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T == 0 or D == 0:
        return dx, torch.zeros_like(weight, memory_format=torch.contiguous_format)
    cfgs = configs.CONFIGS[arch_of(x, "x")]
    cfg, red = cfgs["bwd"], cfgs["red"]
    dy = operand(dy.to(x.dtype), OP, "dy")
    x, w, cu, n_seq, n_iter = _operands(x, weight, cu_seqlens)
    sx = x.stride(0) if T > 1 else D
    sdy = dy.stride(0) if T > 1 else D
    al = _align(D, sx, sdy)
    n_blocks = build.cdiv(T, cfg["CHUNK"])
    Dp = build.cdiv(D, 8) * 8
    part = workspace.take((OP, "dw_partial"), n_blocks * W * Dp * 4, device=x.device).view(torch.float32)
    launch(kernels.conv1d_bwd_kernel, (n_blocks, build.cdiv(D, cfg["BLOCK_D"])), x_ptr=x, w_ptr=w, dy_ptr=dy,
           dx_ptr=dx, dw_ptr=part, cu_ptr=cu, T=T, D_a=D // al, sx_a=sx // al, sdy_a=sdy // al, sdx_a=D // al,
           Dp_a=Dp // 8, n_seq=n_seq, n_iter=n_iter, W=W, ACT=act_mode, HAS_CU=cu is not None, ALIGN=al, **cfg)
    dw = torch.empty((D, W), dtype=weight.dtype, device=x.device)
    launch(kernels.dw_reduce_kernel, (build.cdiv(D, red["BLOCK_D"]), W), part_ptr=part, dw_ptr=dw, n_part=n_blocks,
           D=D, Dp_a=Dp // 8, W=W, **red)
    return dx, dw


# ---------------------------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("miles_ext_kernels::cake_conv1d_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Optional[torch.Tensor], act: int) -> torch.Tensor:
    return conv1d_forward(x, weight, cu_seqlens, act)


@_fwd_op.register_fake
def _(x, weight, cu_seqlens, act):
    return x.new_empty(x.shape)


@torch.library.custom_op("miles_ext_kernels::cake_conv1d_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
            act_mode: int, det: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return conv1d_backward(dy, x, weight, cu_seqlens, act_mode, "det" if det else "fast")


@_bwd_op.register_fake
def _(dy, x, weight, cu_seqlens, act_mode, det):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _modes(act: int):
    """(det, act_mode) configured now: read when a forward runs; its backward runs what it read."""
    det = config.variant(OP) == "det"
    if not act:
        return det, 0
    return det, 2 if config.option(OP, "silu_grad_preactivation") == "fp32" else 1


def _setup_context(ctx, inputs, output):
    x, weight, cu_seqlens, act = inputs
    ctx.save_for_backward(x, weight, cu_seqlens)
    ctx.det, ctx.act_mode = _modes(act)


def _backward(ctx, dy):
    x, weight, cu_seqlens = ctx.saved_tensors
    dx, dw = _bwd_op(dy, x, weight, cu_seqlens, ctx.act_mode, ctx.det)
    return dx, dw, None, None


torch.library.register_autograd("miles_ext_kernels::cake_conv1d_fwd", _backward, setup_context=_setup_context)


class _Conv1dFn(torch.autograd.Function):
    """The eager path: the same launchers as the custom ops, without the custom-op dispatch."""

    @staticmethod
    def forward(ctx, x, weight, cu_seqlens, act, det, act_mode):
        ctx.save_for_backward(x, weight, cu_seqlens)
        ctx.det, ctx.act_mode = det, act_mode
        return conv1d_forward(x, weight, cu_seqlens, act)

    @staticmethod
    @once_differentiable  # a second derivative raises instead of silently carrying no history
    def backward(ctx, dy):
        x, weight, cu_seqlens = ctx.saved_tensors
        dx, dw = conv1d_backward(dy, x, weight, cu_seqlens, ctx.act_mode, "det" if ctx.det else "fast")
        return dx, dw, None, None, None, None


# ---------------------------------------------------------------------------------------------------- public
def causal_conv1d(x, weight, *, cu_seqlens=None, activation="silu"):
    """See `miles_ext_kernels.cake.conv1d.causal_conv1d`."""
    checks.check_tensor("x", x, dtype=torch.bfloat16, ndim=2, last_stride_one=True)
    checks.check_tensor("weight", weight, dtype=(torch.float32, torch.bfloat16), ndim=2, device=x.device)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be [D, W] with D = x.shape[1] = {x.shape[1]}, got {tuple(weight.shape)}")
    if weight.shape[1] not in (2, 3, 4):
        raise ValueError(f"weight width W must be 2, 3 or 4, got {weight.shape[1]}")
    if cu_seqlens is not None:
        checks.check_tensor("cu_seqlens", cu_seqlens, dtype=(torch.int32, torch.int64), ndim=1, device=x.device)
        if cu_seqlens.shape[0] < 1:
            raise ValueError("cu_seqlens must hold at least one entry (cu_seqlens[0] == 0)")
    if not (activation is None or isinstance(activation, str)) or activation not in _ACT_NAMES:
        raise ValueError(f"activation must be 'silu', 'swish' or None, got {activation!r}")
    build.check_device(x, "x")
    act = _ACT_NAMES[activation]
    if torch.compiler.is_compiling():
        return _fwd_op(x, weight, cu_seqlens, act)
    if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        return conv1d_forward(x, weight, cu_seqlens, act)
    det, act_mode = _modes(act)
    return _Conv1dFn.apply(x, weight, cu_seqlens, act, det, act_mode)


# ---------------------------------------------------------------------------------------------------- routes
def routes(*, weight_dtype: str):
    """Every kernel specialization a call with a `weight_dtype` ("float32" / "bfloat16") weight can launch: the
    launchers above run on meta tensors over every flag (W 2..4; no activation, SiLU with either SiLU-grad mode;
    no / int32 / int64 cu_seqlens; D and row strides multiples of 8 or not) and record their launches; both
    variants launch the same kernels. Every int argument of the kernels is `do_not_specialize`, so only its width
    (32 bit at any real size) enters a route, and small meta shapes stand for real ones."""
    if weight_dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {tuple(_WEIGHT_DTYPES)}, got {weight_dtype!r}")
    wdt = _WEIGHT_DTYPES[weight_dtype]
    arch = build.INTERPRETER_ARCH if build.INTERPRET else build.device_arch()
    meta = dict(device="meta")
    T = 64
    layouts = (torch.empty(T, 64, dtype=torch.bfloat16, **meta),  # aligned: D and row stride multiples of 8
               torch.empty(T, 60, dtype=torch.bfloat16, **meta),  # D % 8 != 0
               torch.empty(T, 68, dtype=torch.bfloat16, **meta)[:, :64])  # a column slice, row stride 68
    with collect_routes(arch) as rs:
        for W in (2, 3, 4):
            for cu_dtype in (None, torch.int32, torch.int64):
                cu = None if cu_dtype is None else torch.empty(4, dtype=cu_dtype, **meta)
                for x in layouts:
                    w = torch.empty(x.shape[1], W, dtype=wdt, **meta)
                    for act_mode in (0, 1, 2):
                        conv1d_forward(x, w, cu, min(act_mode, 1))
                        conv1d_backward(x, x, w, cu, act_mode)
    return rs.routes
