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
from . import configs, kernels

OP = "conv1d"

_WEIGHT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_ACT_NAMES = {None: 0, "silu": 1, "swish": 1}


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` if it starts 16-byte aligned (the compiled specializations assume it), else an aligned copy."""
    if t.numel() and t.data_ptr() % 16:
        return t.clone(memory_format=torch.contiguous_format)
    return t


def _prep_cu(cu: Optional[torch.Tensor]):
    if cu is None:
        return None, 0, 0
    if cu.stride(0) != 1:  # int32 or int64: the kernels load either
        cu = cu.contiguous()
    cu = _aligned(cu)
    n_seq = cu.numel() - 1
    return cu, n_seq, max(1, n_seq.bit_length())


def _align(D: int, *strides: int) -> int:
    return 8 if D % 8 == 0 and all(s % 8 == 0 for s in strides) else 1


def _meta(W: int, act: int, has_cu: bool, align: int, cfg: dict) -> dict:
    """Constexprs + launch options of a forward or backward launch (the backward's `act` is its SiLU-grad mode)."""
    return dict(W=W, ACT=act, HAS_CU=has_cu, ALIGN=align, **cfg)


def _red_meta(W: int, cfg: dict) -> dict:
    return dict(W=W, **cfg)


# ---------------------------------------------------------------------------------------------------- launchers
@build.on_input_device
def _fwd(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Optional[torch.Tensor], act: int) -> torch.Tensor:
    T, D = x.shape
    W = weight.shape[1]
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T == 0 or D == 0:
        return y
    x = _aligned(x)
    w = _aligned(weight.contiguous())
    cu, n_seq, n_iter = _prep_cu(cu_seqlens)
    cfg = configs.CONFIGS[build.check_device(x, "x")]["fwd"]
    sx = x.stride(0) if T > 1 else D
    align = _align(D, sx)
    grid = (build.cdiv(T, cfg["CHUNK"]), build.cdiv(D, cfg["BLOCK_D"]))
    kernels.conv1d_fwd_kernel[grid](x, w, y, cu, T, D // align, sx // align, D // align, n_seq, n_iter,
                                    **_meta(W, act, cu is not None, align, cfg))
    return y


@build.on_input_device
def _bwd(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
         act_mode: int, det: bool = True):
    """dx, dw. Both variants (`det`) run these kernels: dw partials per token block, reduced in a fixed order
    (fp32 atomics were measured slower on the H200), so fast and det give the same bits."""
    T, D = x.shape
    W = weight.shape[1]
    dx = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T == 0 or D == 0:
        return dx, torch.zeros_like(weight, memory_format=torch.contiguous_format)
    if dy.dtype != x.dtype:
        dy = dy.to(x.dtype)
    if dy.stride(-1) != 1:
        dy = dy.contiguous()
    dy = _aligned(dy)
    x = _aligned(x)
    w = _aligned(weight.contiguous())
    cu, n_seq, n_iter = _prep_cu(cu_seqlens)
    cfgs = configs.CONFIGS[build.check_device(x, "x")]
    cfg = cfgs["bwd"]
    sx = x.stride(0) if T > 1 else D
    sdy = dy.stride(0) if T > 1 else D
    align = _align(D, sx, sdy)
    n_blocks = build.cdiv(T, cfg["CHUNK"])
    grid = (n_blocks, build.cdiv(D, cfg["BLOCK_D"]))
    Dp = build.cdiv(D, 8) * 8
    part = workspace.take((OP, "dw_partial"), n_blocks * W * Dp * 4, device=x.device).view(torch.float32)
    kernels.conv1d_bwd_kernel[grid](x, w, dy, dx, part, cu, T, D // align, sx // align, sdy // align,
                                    D // align, Dp // 8, n_seq, n_iter,
                                    **_meta(W, act_mode, cu is not None, align, cfg))
    dw = torch.empty((D, W), dtype=weight.dtype, device=x.device)
    red = cfgs["red"]
    kernels.dw_reduce_kernel[(build.cdiv(D, red["BLOCK_D"]), W)](part, dw, n_blocks, D, Dp // 8,
                                                                  **_red_meta(W, red))
    return dx, dw


# ---------------------------------------------------------------------------------------------------- custom ops
@torch.library.custom_op("miles_ext_kernels::cake_conv1d_fwd", mutates_args=())
def _fwd_op(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Optional[torch.Tensor], act: int) -> torch.Tensor:
    return _fwd(x, weight, cu_seqlens, act)


@_fwd_op.register_fake
def _(x, weight, cu_seqlens, act):
    return x.new_empty(x.shape)


@torch.library.custom_op("miles_ext_kernels::cake_conv1d_bwd", mutates_args=())
def _bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
            act_mode: int, det: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _bwd(dy, x, weight, cu_seqlens, act_mode, det)


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
        return _fwd(x, weight, cu_seqlens, act)

    @staticmethod
    @once_differentiable  # a second derivative raises instead of silently carrying no history
    def backward(ctx, dy):
        x, weight, cu_seqlens = ctx.saved_tensors
        dx, dw = _bwd(dy, x, weight, cu_seqlens, ctx.act_mode, ctx.det)
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
        return _fwd(x, weight, cu_seqlens, act)
    det, act_mode = _modes(act)
    return _Conv1dFn.apply(x, weight, cu_seqlens, act, det, act_mode)


# ---------------------------------------------------------------------------------------------------- routes
def routes(*, weight_dtype: str):
    """Every kernel specialization a call can launch on sm_90a for `weight_dtype` ("float32" / "bfloat16"):
    both variants (they share kernels), both silu-grad options (and no activation), W in 2..4, with/without
    cu_seqlens, aligned (D and row strides multiples of 8) or not, and the dw reduction per W."""
    if weight_dtype not in _WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {tuple(_WEIGHT_DTYPES)}, got {weight_dtype!r}")
    wdt = _WEIGHT_DTYPES[weight_dtype]
    cfgs = configs.CONFIGS["sm_90a"]
    bf = torch.bfloat16
    out = []
    for W in (2, 3, 4):
        for cu in (None, torch.int32, torch.int64):
            has_cu = cu is not None
            for align in (1, 8):
                for act in (0, 1):
                    out.append(build.Route(
                        kernels.conv1d_fwd_kernel, (bf, wdt, bf, cu, 4096, 64, 64, 64, 8, 4), (1, 1),
                        _meta(W, act, has_cu, align, cfgs["fwd"]),
                        f"fwd[W={W},act={act},cu={str(cu)[6:] or 'none'},align={align}]"))
                for act_mode in (0, 1, 2):
                    out.append(build.Route(
                        kernels.conv1d_bwd_kernel,
                        (bf, wdt, bf, bf, torch.float32, cu, 4096, 64, 64, 64, 64, 64, 8, 4), (1, 1),
                        _meta(W, act_mode, has_cu, align, cfgs["bwd"]),
                        f"bwd[W={W},act={act_mode},cu={str(cu)[6:] or 'none'},align={align}]"))
        out.append(build.Route(kernels.dw_reduce_kernel, (torch.float32, wdt, 64, 512, 64), (1, 1),
                               _red_meta(W, cfgs["red"]), f"dw_reduce[W={W}]"))
    return out
