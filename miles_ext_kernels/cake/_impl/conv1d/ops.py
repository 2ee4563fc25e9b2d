"""conv1d: operand checks, launchers, autograd.

Forward: one launch (y). Backward: one launch (dx, and fp32 dw partials per token block), then the fixed-order dw
reduction. Both variants launch the same kernels, so `fast` is `det`. Launch configs: configs.py (fixed per arch).
An initial state (`initial_state`: the kernels' HALO flag) adds no launch to the forward and the zeroing of its
gradient to the backward; without one, the kernels are compiled without any of its code.
Every launch goes through `_runtime.launch.launch`; `routes()` runs these launchers on meta tensors, so prebuild
compiles exactly what they launch. Autograd and the custom ops `miles_ext_kernels::conv1d_fwd` / `conv1d_bwd`:
`_runtime.autograd.KernelOp`. The variant and the SiLU-grad option are read when the forward runs; its backward
runs what it read.
"""
from __future__ import annotations

from typing import Optional

import torch

from miles_ext_kernels.cake._runtime import build, checks, config, workspace
from miles_ext_kernels.cake._runtime.autograd import KernelOp
from miles_ext_kernels.cake._runtime.cp import check_call as check_cp_call
from miles_ext_kernels.cake._runtime.cp import stage_function
from miles_ext_kernels.cake._runtime.launch import arch_of, collect_routes, launch
from miles_ext_kernels.cake._runtime.operands import operand
from miles_ext_kernels.cake.conv1d import OP as SPEC
from miles_ext_kernels.cake.conv1d import WEIGHT_DTYPES, WIDTHS  # the declaration owns what is served

from . import configs, kernels

OP = SPEC.name
_ACT_NAMES = {None: 0, "silu": 1, "swish": 1}


def _operands(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
              initial_state: Optional[torch.Tensor]):
    """(x, weight, cu_seqlens, initial_state, n_seq, n_iter) as the kernels read them. x is read in place with any
    row stride (a column slice of a packed projection: ALIGN=1 routes take strides that are not multiples of 8) once
    it starts 16-byte aligned, as the routes are compiled for aligned pointers; the weight, cu_seqlens (int32 or
    int64, the kernels load either) and the initial state are indexed densely. n_seq: the documents (1 without
    cu_seqlens: the initial state's index bound)."""
    x = operand(x, OP, "x")
    w = operand(weight, OP, "weight", contiguous=True)
    h = None if initial_state is None else operand(initial_state, OP, "initial_state", contiguous=True)
    if cu_seqlens is None:
        return x, w, None, h, 1, 0
    cu = operand(cu_seqlens, OP, "cu_seqlens", contiguous=True)
    n_seq = cu.numel() - 1
    return x, w, cu, h, n_seq, max(1, n_seq.bit_length())


def _align(D: int, *strides: int) -> int:
    """ALIGN: 8 when D and the row strides allow 16-byte rows (the kernels see them divided by it and vectorize)."""
    return 8 if D % 8 == 0 and all(s % 8 == 0 for s in strides) else 1


# ---------------------------------------------------------------------------------------------------- launchers
def conv1d_forward(x: torch.Tensor, weight: torch.Tensor, cu_seqlens: Optional[torch.Tensor],
                   initial_state: Optional[torch.Tensor], act_mode: int, variant: str = "det") -> tuple[torch.Tensor]:
    """(y,): y [T, D] (x's dtype, contiguous) of x [T, D], weight [D, W], cu_seqlens [N + 1] or None, initial_state
    [N, D, W] (N = 1 without cu_seqlens) or None. act_mode: 0 no activation, 1 or 2 SiLU (the forward is the same;
    the backward's SiLU' differs, see `conv1d_backward`). Operands already checked."""
    T, D = x.shape
    W = weight.shape[1]
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T == 0 or D == 0:
        return (y,)
    cfg = configs.CONFIGS[arch_of(x, "x")]["fwd"]
    x, w, cu, h, n_seq, n_iter = _operands(x, weight, cu_seqlens, initial_state)
    sx = x.stride(0) if T > 1 else D
    al = _align(D, sx)
    launch(kernels.conv1d_fwd_kernel, (build.cdiv(T, cfg["CHUNK"]), build.cdiv(D, cfg["BLOCK_D"])), x_ptr=x,
           w_ptr=w, y_ptr=y, cu_ptr=cu, h_ptr=h, T=T, D_a=D // al, sx_a=sx // al, sy_a=D // al, n_seq=n_seq,
           n_iter=n_iter, W=W, ACT=min(act_mode, 1), HAS_CU=cu is not None, HALO=h is not None, ALIGN=al, **cfg)
    return (y,)


def conv1d_backward(dy: Optional[torch.Tensor], x: torch.Tensor, weight: torch.Tensor,
                    cu_seqlens: Optional[torch.Tensor], initial_state: Optional[torch.Tensor], act_mode: int,
                    variant: str = "det") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx [T, D] in x's dtype, dw [D, W] in weight's dtype, dh), all contiguous, from dy [T, D] (None: no gradient
    reached y, taken as zeros). dh: the initial state's gradient [N, D, W] in its dtype (entry 0 of the last dim,
    which the forward does not read, and every entry of an empty document are 0), or an empty tensor without one.
    act_mode: 0 no activation, 1 SiLU' at the pre-activation rounded to bf16, 2 at the exact fp32 one (the
    pre-activation is recomputed from x and weight). Both variants run these kernels: dw partials per token block,
    reduced in a fixed order (fp32 atomics into [D, W] were measured slower on the H200)."""
    T, D = x.shape
    W = weight.shape[1]
    dx = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if initial_state is None:
        dh = x.new_empty((0,))
    else:  # zeros: the kernel writes the entries of the documents it enters, 1..W-1 of the last dim
        dh = torch.zeros(initial_state.shape, dtype=initial_state.dtype, device=x.device)
    if T == 0 or D == 0:
        return dx, torch.zeros_like(weight, memory_format=torch.contiguous_format), dh
    cfgs = configs.CONFIGS[arch_of(x, "x")]
    cfg, red = cfgs["bwd"], cfgs["red"]
    if dy is None:
        dy = torch.zeros((T, D), dtype=x.dtype, device=x.device)
    dy = operand(dy.to(x.dtype), OP, "dy")
    x, w, cu, h, n_seq, n_iter = _operands(x, weight, cu_seqlens, initial_state)
    sx = x.stride(0) if T > 1 else D
    sdy = dy.stride(0) if T > 1 else D
    al = _align(D, sx, sdy)
    n_blocks = build.cdiv(T, cfg["CHUNK"])
    Dp = build.cdiv(D, 8) * 8
    part = workspace.take((OP, "dw_partial"), n_blocks * W * Dp * 4, device=x.device).view(torch.float32)
    launch(kernels.conv1d_bwd_kernel, (n_blocks, build.cdiv(D, cfg["BLOCK_D"])), x_ptr=x, w_ptr=w, dy_ptr=dy,
           dx_ptr=dx, dw_ptr=part, cu_ptr=cu, h_ptr=h, dh_ptr=None if h is None else dh, T=T, D_a=D // al,
           sx_a=sx // al, sdy_a=sdy // al, sdx_a=D // al, Dp_a=Dp // 8, n_seq=n_seq, n_iter=n_iter, W=W, ACT=act_mode,
           HAS_CU=cu is not None, HALO=h is not None, ALIGN=al, **cfg)
    # Not _runtime/reduce.py's reduce_columns: a [n_blocks, W * Dp] view of the partials has its columns in [W, Dp]
    # order, not dw's [D, W] (a transposing copy would be one more launch), and it sums 32 rows per step where the
    # table says BLOCK_P (another summation order, other bits; bench/NOTES.md, conv1d).
    dw = torch.empty((D, W), dtype=weight.dtype, device=x.device)
    launch(kernels.dw_reduce_kernel, (build.cdiv(D, red["BLOCK_D"]), W), part_ptr=part, dw_ptr=dw, n_part=n_blocks,
           D=D, Dp_a=Dp // 8, W=W, **red)
    return dx, dw, dh


# ---------------------------------------------------------------------------------------------------- autograd
def _forward_fake(x, weight, cu_seqlens, initial_state, act_mode, variant="det"):
    return (x.new_empty(x.shape),)


def _backward_fake(dy, x, weight, cu_seqlens, initial_state, act_mode, variant="det"):
    dh = x.new_empty((0,)) if initial_state is None else initial_state.new_empty(initial_state.shape)
    return x.new_empty(x.shape), weight.new_empty(weight.shape), dh


def _setup(inputs, res):
    x, weight, cu_seqlens, initial_state, act_mode, variant = inputs
    return (x, weight, cu_seqlens, initial_state), (act_mode, variant)


CONV1D = KernelOp(OP, forward=conv1d_forward, forward_fake=_forward_fake, setup=_setup, backward=conv1d_backward,
                  backward_fake=_backward_fake, grad_inputs=(0, 1, 3))


# ---------------------------------------------------------------------------------------------------- public
def _check(x, weight, cu_seqlens, activation, initial_state) -> None:
    checks.check_tensor("x", x, dtype=torch.bfloat16, ndim=2, last_stride_one=True)
    checks.check_tensor("weight", weight, dtype=(torch.float32, torch.bfloat16), ndim=2, device=x.device)
    if weight.shape[0] != x.shape[1]:
        raise ValueError(f"weight must be [D, W] with D = x.shape[1] = {x.shape[1]}, got {tuple(weight.shape)}")
    if weight.shape[1] not in WIDTHS:
        raise ValueError(f"weight width W must be 2, 3 or 4, got {weight.shape[1]}")
    if cu_seqlens is not None:
        checks.check_tensor("cu_seqlens", cu_seqlens, dtype=(torch.int32, torch.int64), ndim=1, device=x.device)
        if cu_seqlens.shape[0] < 1:
            raise ValueError("cu_seqlens must hold at least one entry (cu_seqlens[0] == 0)")
    if not (activation is None or isinstance(activation, str)) or activation not in _ACT_NAMES:
        raise ValueError(f"activation must be 'silu', 'swish' or None, got {activation!r}")
    if initial_state is not None:
        checks.check_tensor("initial_state", initial_state, dtype=x.dtype, ndim=3, device=x.device)
        want = (1 if cu_seqlens is None else cu_seqlens.shape[0] - 1, x.shape[1], weight.shape[1])
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must be [N, D, W] = {list(want)} (N: the documents of cu_seqlens, 1 "
                             f"without it), got {list(initial_state.shape)}")
    build.check_device(x, "x")


def _act_mode(activation) -> int:
    """0 no activation; SiLU: 2 when the silu_grad_preactivation option configured now is fp32, else 1."""
    if not _ACT_NAMES[activation]:
        return 0
    return 2 if config.option(OP, "silu_grad_preactivation") == "fp32" else 1


def causal_conv1d(x, weight, *, cu_seqlens=None, activation="silu", initial_state=None, cp_context=None):
    """See `miles_ext_kernels.cake.conv1d.causal_conv1d`."""
    if cp_context is not None:
        _check_cp(cp_context, x, weight, cu_seqlens, initial_state)
        _check(x, weight, cp_context.cu_seqlens, activation, None)
        return CONV1D_CP.apply(cp_context, x, weight, _act_mode(activation))
    _check(x, weight, cu_seqlens, activation, initial_state)
    return CONV1D(x, weight, cu_seqlens, initial_state, _act_mode(activation))


# ------------------------------------------------------------------------------------------ context parallelism
def _check_cp(cp, x, weight, cu_seqlens, initial_state) -> None:
    check_cp_call(OP, cp, "x", x, token_dim=0, given=(("cu_seqlens", cu_seqlens), ("initial_state", initial_state)))
    W = weight.shape[-1] if isinstance(weight, torch.Tensor) else None
    if cp.conv1d_kernel_size is not None and W is not None and W != cp.conv1d_kernel_size:
        raise ValueError(f"conv1d: weight has width {W}, the CP context was built for conv1d_kernel_size="
                         f"{cp.conv1d_kernel_size}")


def _rows(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """src[idx] along dim 0 with -1 giving zero rows (an index_select and a select, no copy of src)."""
    got = src.index_select(0, idx.clamp(min=0).reshape(-1)).view(*idx.shape, *src.shape[1:])
    return torch.where((idx >= 0).view(*idx.shape, *([1] * (src.dim() - 1))), got, torch.zeros((), dtype=src.dtype,
                                                                                              device=src.device))


def cp_forward_stage(cp, x, weight, act_mode):
    """One rank's CP forward (a stage generator, `_runtime/cp.py`): each exporting piece sends its last W - 1 rows;
    each local document's initial state is read from the gathered rows (zeros where the document starts here)."""
    W = weight.shape[1]
    t = cp.halo_tables(W)
    gathered = yield _rows(x, t["export"])                                   # [max_export, W - 1, D]
    flat = gathered.reshape(-1, x.shape[1])
    h0 = _rows(flat, t["state"]).permute(0, 2, 1).contiguous()               # [n_local, D, W]
    (y,) = conv1d_forward(x, weight, cp.cu_seqlens, h0, act_mode)
    return y, (x, weight, h0, act_mode)


def cp_backward_stage(cp, saved, dy):
    """One rank's CP backward: the initial states' gradients go back to the rows they read, summed in the plan's
    fixed order; dweight is this rank's partial sum."""
    x, weight, h0, act_mode = saved
    W = weight.shape[1]
    t = cp.halo_tables(W)
    dx, dw, dh = conv1d_backward(dy, x, weight, cp.cu_seqlens, h0, act_mode)
    R = W - 1
    # the importing documents' state gradients, as rows: entry W - k of the last dim is row k - 1
    d_rows = dh.flip(-1)[:, :, :R].permute(0, 2, 1)                           # [n_local, W - 1, D]
    buf = torch.zeros(cp.max_import, R, x.shape[1], dtype=dh.dtype, device=dh.device)
    if cp.n_import:
        buf[:cp.n_import] = d_rows.index_select(0, cp.import_segs)
    gathered = (yield buf).reshape(-1, x.shape[1]).float()
    if t["rows"].numel():
        parts = _rows(gathered, t["grad"])                                   # [max_export * (W - 1), L, D]
        total = parts[:, 0]
        for j in range(1, parts.shape[1]):
            total = total + parts[:, j]
        rows = t["rows"]
        dx[rows] = (dx.index_select(0, rows).float() + total.index_select(0, t["slots"])).to(dx.dtype)
    return dx, dw, None


CONV1D_CP = stage_function(cp_forward_stage, cp_backward_stage)


# ---------------------------------------------------------------------------------------------------- routes
def routes(*, weight_dtype: str):
    """Every kernel specialization a call with a `weight_dtype` ("float32" / "bfloat16") weight can launch: the
    launchers above run on meta tensors over every flag (both variants; W 2..4; no activation, SiLU with either
    SiLU-grad mode; no / int32 / int64 cu_seqlens; D and row strides multiples of 8 or not; with and without an
    initial state) and record their launches. Every int argument of the kernels is `do_not_specialize`, so only its
    width (32 bit at any real size) enters a route, and small meta shapes stand for real ones."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    wdt = getattr(torch, weight_dtype)
    arch = build.INTERPRETER_ARCH if build.INTERPRET else build.device_arch()
    meta = dict(device="meta")
    T = 64
    layouts = (torch.empty(T, 64, dtype=torch.bfloat16, **meta),  # aligned: D and row stride multiples of 8
               torch.empty(T, 60, dtype=torch.bfloat16, **meta),  # D % 8 != 0
               torch.empty(T, 68, dtype=torch.bfloat16, **meta)[:, :64])  # a column slice, row stride 68
    with collect_routes(arch) as rs:
        for W in WIDTHS:
            for cu_dtype in (None, torch.int32, torch.int64):
                cu = None if cu_dtype is None else torch.empty(4, dtype=cu_dtype, **meta)
                for x in layouts:
                    w = torch.empty(x.shape[1], W, dtype=wdt, **meta)
                    halo = torch.empty(1 if cu is None else 3, x.shape[1], W, dtype=x.dtype, **meta)
                    for h in (None, halo):
                        for act_mode in (0, 1, 2):
                            for variant in SPEC.variants:
                                conv1d_forward(x, w, cu, h, act_mode, variant)
                                conv1d_backward(x, x, w, cu, h, act_mode, variant)
    return rs.routes
