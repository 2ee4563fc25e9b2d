"""Host side of the delta-rule core shared by gdn and kda: scratch and operands, the chunk table, and the launches
of the gate-independent kernels (the L2 norm of q and k; the per-key-head sum of the per-value-head dq / dk with the
L2-norm backward). Every launch goes through `_runtime.launch.launch`, so each op's `routes()` records them."""
from __future__ import annotations

import torch

from miles_ext_kernels.cake._runtime import build, varlen, workspace
from miles_ext_kernels.cake._runtime.launch import launch
from miles_ext_kernels.cake._runtime.operands import operand

from . import common

INTERPRET = build.INTERPRET


def scratch(op: str, role: str, shape, dtype, device, own: bool = False) -> torch.Tensor:
    """A `shape` tensor of scratch from the workspace pool (role `(op, role)`), or with `own` an allocation of its
    own (under context parallelism, where other ranks' stages may run between its writes and its last read); its
    content is undefined."""
    if own:
        return torch.empty(shape, dtype=dtype, device=device)
    return workspace.take_tensor((op, role), shape, dtype, device=device)


def dense(x: torch.Tensor, op: str, name: str) -> torch.Tensor:
    """Contiguous and 16-byte aligned (the kernels index rows densely and are specialized on aligned pointers)."""
    return operand(x, op, name, contiguous=True)


def token_rows(x: torch.Tensor, op: str, name: str, int32_offsets: bool = False) -> torch.Tensor:
    """x [B, T, A, D] as rows [B * T, A * D] for the kernels that take its row stride: in place where its heads are
    packed within a token (a view of a wider projection: unit last stride, head stride D), its row stride is a
    multiple of 16 elements and, with `int32_offsets` (kernels that index it in int32), every offset fits int32;
    otherwise a contiguous copy."""
    B, T, A, D = x.shape
    return operand(x, op, name, view=(B * T, A * D), stride_multiple=16, fits=_int32_rows if int32_offsets else None)


def _int32_rows(r: torch.Tensor) -> bool:
    return r.numel() == 0 or (r.shape[0] - 1) * r.stride(0) + r.shape[1] < 2 ** 31


def qkv_operands(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, op: str, use_l2: bool) -> tuple:
    """q, k, v as rows (`token_rows`: a view of a wider projection in place) for the kernels, which take their row
    strides. With the L2 norm in the kernel only its forward and backward read q and k (64-bit offsets); otherwise
    the chunk kernels, which index in int32, as they do v."""
    return (token_rows(q, op, "q", int32_offsets=not use_l2), token_rows(k, op, "k", int32_offsets=not use_l2),
            token_rows(v, op, "v", int32_offsets=True))


def row_stride(x: torch.Tensor) -> int:
    """Elements between tokens of `x`: rows [B * T, A * D] from `token_rows`, or a contiguous [B, T, A, D]."""
    return x.stride(0) if x.dim() == 2 else x.shape[-2] * x.shape[-1]


def qk_strides(qn: torch.Tensor, kk: torch.Tensor) -> dict:
    """The chunk kernels' SQ, SK: the row strides of the q and k they read (the L2 norm's contiguous outputs, or
    without it the operands from `qkv_operands`, views of a wider projection included)."""
    return dict(SQ=row_stride(qn), SK=row_stride(kk))


def empty0(device, dtype=torch.float32) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def chunk_setup(op: str, cu_seqlens, B: int, T: int, device) -> tuple:
    """(N, P, table, se) of a call: N sequences (B, or the documents of cu_seqlens), P = cdiv(B T, BT) + N chunk
    slots, and `varlen.chunk_table`'s slot table and clamped per-sequence bounds (the only launch that reads
    cu_seqlens)."""
    if cu_seqlens is None:
        N = B
        cu = torch.arange(B + 1, dtype=torch.int32, device=device) * T
    else:
        N = cu_seqlens.numel() - 1
        cu = dense(cu_seqlens, op, "cu_seqlens")  # int32 or int64: only the table kernel reads it
    P = build.cdiv(B * T, common.BT) + N
    table, se = varlen.chunk_table(cu, N, P, B * T, common.BT)
    return N, P, table, se


def l2norm(q: torch.Tensor, k: torch.Tensor, shape: tuple, cfg: dict) -> tuple:
    """q, k (`shape` [B, T, H, K]: contiguous, or rows from `token_rows`) L2-normalised per head, in one launch, into
    contiguous `shape` tensors. cfg: BR, num_warps, num_stages."""
    B, T, H, K = shape
    qn = torch.empty(shape, dtype=q.dtype, device=q.device)
    kn = torch.empty(shape, dtype=k.dtype, device=k.device)
    R = B * T * H
    BR = cfg["BR"]
    launch(common.l2norm_fwd_kernel, ((R + BR - 1) // BR, 2), x=q, y=qn, x2=k, y2=kn, R=R, SX=row_stride(q),
           SX2=row_stride(k), H=H, K=K, BR=BR, INTERPRET=INTERPRET, num_warps=cfg["num_warps"],
           num_stages=cfg["num_stages"])
    return qn, kn


def key_head_sums(pairs, R: int, H: int, HV: int, K: int, use_l2: bool, cfg: dict) -> None:
    """For each (x, dxv, dx) of `pairs`: dx[t, h] = the sum of dxv [R, HV, K] over the value heads of key head h
    (fixed order), then back through the L2 norm of x when `use_l2`. cfg: BR, num_warps, num_stages."""
    BR = cfg["BR"]
    grid = (build.cdiv(R, BR), H)
    for x, dxv, dx in pairs:
        launch(common.bwd_final_kernel, grid, x=x, dxv=dxv, dx=dx, R=R, SX=row_stride(x), H=H, HV=HV, K=K, BR=BR,
               L2=use_l2, INTERPRET=INTERPRET, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])


# ---------------------------------------------------------------------------------------------------------------
# the config tables' reading, shared by gdn and kda (`cm` is the op's configs module: DEFAULT_STAGES, NARROW_BELOW
# are read when a call runs, so a test may patch them)
def launch_opts(tab: dict, name: str, cm) -> dict:
    """Launch options of one kernel: num_warps, num_stages (cm.DEFAULT_STAGES unless its entry says) and, where its
    entry has one, maxnreg (a register cap per thread: fewer registers, more CTAs per SM, more spills)."""
    c = tab[name]
    opts = dict(num_warps=c["num_warps"], num_stages=c.get("num_stages", cm.DEFAULT_STAGES))
    if "maxnreg" in c:
        opts["maxnreg"] = c["maxnreg"]
    return opts


def block_v(tab: dict, name: str, V: int) -> int:
    """The config's BV, halved until it divides V (V + K columns of context parallelism's extra state pass)."""
    bv = min(V, tab[name]["BV"])
    while V % bv:
        bv //= 2
    return bv


def state_cfg(tab: dict, name: str, V: int, seq_heads: int, cm) -> tuple:
    """(config name, BV) of a sequential state kernel ("h": fwd_h, "dh": bwd_dh), which runs one program per
    (sequence, value head, BV block): the narrow config when the wide tiles would leave most SMs idle."""
    bv = block_v(tab, name, V)
    if seq_heads * (V // bv) < cm.NARROW_BELOW and block_v(tab, name + "_narrow", V) < bv:
        name += "_narrow"
        bv = block_v(tab, name, V)
    return name, bv


def dqkw_opts(tab: dict, phase: int, cm) -> dict:
    c = launch_opts(tab, "dqkw", cm)
    if phase == 2:  # the dk launch has its own warp count
        c["num_warps"] = tab["dqkw"]["num_warps_dk"]
    return c


def partial_dtype(tab: dict, dt):
    """dtype of the per-value-head dq, dk sums read by the per-key-head sum: the input dtype (one more rounding,
    half the bytes) or fp32."""
    return dt if tab["final"]["LOW_PARTIALS"] else torch.float32


def dk_dtype(tab: dict, dt):
    """dtype of dqkw's dk part, read back (and completed) by the WY backward: the input dtype or fp32."""
    return dt if tab["final"]["LOW_DK"] else torch.float32
