"""Chunked Gated DeltaNet: operand checks, launchers, torch.library custom ops, autograd.

Forward: [L2 norm of q, k] -> prep (gc = in-chunk cumsum of g, A = (I + L)^-1) -> w, u -> state recurrence
(h per chunk, dlt) -> o. Backward: [recompute w, u, h, dlt] -> in-chunk d(dlt) -> reverse state recurrence (d of
every chunk-end state, full d(dlt), dh0) -> dq, dk, dw, partial dg -> WY backward (dk, dv, dbeta, dg) -> sum dq,
dk over the value heads of each key head (fixed order) and back through the L2 norm.

Both variants launch the same kernels: no kernel uses atomics and every split sum is added in one fixed order, so
`fast` is `det`. Launch configs: configs.py (fixed per kernel).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from miles_ext_kernels.cake._runtime import build, checks, config, workspace
from miles_ext_kernels.cake._runtime.checks import check_same_device, check_tensor
from miles_ext_kernels.cake.gdn import HEAD_DIMS  # the declaration owns the served head dims

from . import configs
from . import kernels as kn

OP = "gdn"
BT = kn.BT
IN_DTYPES = (torch.bfloat16,)
GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_STAGES = 2  # default (the chunk kernels have no pipelined loop)
_TABLE_BP = 128  # chunk slots per program of the chunk-table kernel


def _cfg(name: str) -> dict:
    """Launch options of one kernel (configs.CFG): num_warps, num_stages, and its tile constexprs."""
    c = configs.CFG[name]
    out = dict(num_warps=c["num_warps"], num_stages=c.get("num_stages", _STAGES))
    return out


def _bv(name: str, V: int) -> int:
    return min(V, configs.CFG[name]["BV"])


def _state_cfg(name: str, V: int, seq_heads: int) -> tuple:
    """(config name, BV) of a sequential state kernel ("h": fwd_h, "dh": bwd_dh), which runs one program per
    (sequence, value head, BV block): the narrow config when the wide tiles would leave most SMs idle."""
    bv = _bv(name, V)
    if seq_heads * (V // bv) < configs.NARROW_BELOW and _bv(name + "_narrow", V) < bv:
        name += "_narrow"
        bv = _bv(name, V)
    return name, bv


def _bk(K: int, phase: int = 0) -> int:
    return min(K, configs.CFG["dqkw"]["BK_dk" if phase == 2 else "BK"])


def _dqkw_launches(K: int) -> list:
    """(phase, BK, first dG slot) of each dq / dk / dw launch, and the number of dG slots."""
    out, slot = [], 0
    for phase in _dqkw_phases():
        bk = _bk(K, phase)
        out.append((phase, bk, slot))
        slot += K // bk
    return out, slot


def _fuse_dvl() -> bool:
    return bool(configs.CFG["dh"]["FUSE_DVL"])


def _dqkw_phases() -> tuple:
    """(0,): one dq / dk / dw launch; (1, 2): a dq, dw launch and a dk launch."""
    return (1, 2) if configs.CFG["dqkw"]["SPLIT"] else (0,)


def _dqkw_cfg(phase: int) -> dict:
    c = _cfg("dqkw")
    if phase == 2:  # the dk launch has its own warp count
        c["num_warps"] = configs.CFG["dqkw"]["num_warps_dk"]
    return c


def _rows(name: str) -> int:
    return configs.CFG[name]["BR"]


def _pdt(dt):
    """dtype of the per-value-head dq, dk sums read by bwd_final: the input dtype (one more rounding, half the
    bytes) or fp32."""
    return dt if configs.CFG["final"]["LOW_PARTIALS"] else torch.float32


def _kdt(dt):
    """dtype of dqkw's dk part, read back (and completed) by the WY backward: the input dtype or fp32."""
    return dt if configs.CFG["final"]["LOW_DK"] else torch.float32


# ----------------------------------------------------------------------------------------------------------------
# checks
def _check(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    check_tensor("q", q, dtype=IN_DTYPES, ndim=4)
    check_tensor("k", k, dtype=IN_DTYPES, ndim=4)
    check_tensor("v", v, dtype=IN_DTYPES, ndim=4)
    check_tensor("g", g, dtype=GATE_DTYPES, ndim=3)
    check_tensor("beta", beta, dtype=GATE_DTYPES, ndim=3)
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, H, K = q.shape
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v must be [B, T, HV, V] = [{B}, {T}, HV, V], got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H < 1 or HV < 1 or HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a positive multiple of q/k's head count H={H}")
    if K not in HEAD_DIMS:
        raise ValueError(f"q/k head dim K={K} is not served (served: {HEAD_DIMS})")
    if V not in HEAD_DIMS:
        raise ValueError(f"v head dim V={V} is not served (served: {HEAD_DIMS})")
    if tuple(g.shape) != (B, T, HV):
        raise ValueError(f"g must be [B, T, HV] = {(B, T, HV)}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    if T < 1 or B < 1:
        raise ValueError(f"q must hold at least one token, got shape {tuple(q.shape)}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    for name, flag in (("output_final_state", output_final_state), ("use_qk_l2norm_in_kernel",
                                                                     use_qk_l2norm_in_kernel)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    named = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)]
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, dtype=(torch.int32, torch.int64), ndim=1)
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (packed documents), got B={B}")
        if cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must hold at least 2 offsets ([0, ..., T])")
        if cu_seqlens.device.type == "cpu" and q.device.type == "cpu" and not torch.compiler.is_compiling():
            cu = cu_seqlens.tolist()  # host tensor next to host data (interpreter): cheap to check fully
            if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu[:-1], cu[1:])):
                raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu}")
        named.append(("cu_seqlens", cu_seqlens))
        N = cu_seqlens.numel() - 1
    else:
        N = B
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtype=GATE_DTYPES, ndim=4)
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)}, got "
                             f"{tuple(initial_state.shape)}")
        named.append(("initial_state", initial_state))
    check_same_device(named)
    build.check_device(q, "q")
    return B, T, H, K, HV, V, N


def _c(x: torch.Tensor) -> torch.Tensor:
    """Contiguous and 16-byte aligned (kernels are specialized on aligned pointers)."""
    x = x.contiguous()
    if x.numel() and x.data_ptr() % 16:
        x = x.clone()
    return x


def _ws(role: str, shape, dtype, device) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    size = numel * dtype.itemsize
    return workspace.take((OP, role), max(size, 16), device=device)[:size].view(dtype).view(shape)


def _empty0(device, dtype=torch.float32):
    return torch.empty(0, dtype=dtype, device=device)


def _chunk_table(cu: torch.Tensor, N: int, P: int, T: int) -> tuple:
    """(table [P, 2] int32: slot -> (sequence, chunk index), sequence -1 for unused slots; se [N, 2] int32: each
    sequence's (bos, eos), cu clamped into [0, T], read by every later kernel). One launch, no sync (a launch
    instead of a dozen torch ops: the forward's first long kernel waits on it, so its host time is exposed)."""
    table = torch.empty(P, 2, dtype=torch.int32, device=cu.device)
    se = torch.empty(N, 2, dtype=torch.int32, device=cu.device)
    BP = _TABLE_BP
    kn.chunk_table_kernel[((P + BP - 1) // BP,)](cu, table, se, N, P, T, N.bit_length(), BT=BT, BP=BP, num_warps=4)
    return table, se


# ----------------------------------------------------------------------------------------------------------------
# launchers (no autograd)
def _fwd_state(kk, w, u, gc, cu, h0, N, HV, H, K, V, P, want_ht, device, dt, ws_prefix):
    """Run the state recurrence; returns (h, vn, ht)."""
    T = kk.shape[0] * kk.shape[1]
    h = (_ws(ws_prefix + "h", (P, HV, K, V), dt, device) if ws_prefix
         else torch.empty(P, HV, K, V, dtype=dt, device=device))
    vn = (_ws(ws_prefix + "vn", (T, HV, V), dt, device) if ws_prefix
          else torch.empty(T, HV, V, dtype=dt, device=device))
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=device) if want_ht else _empty0(device)
    cname, BV = _state_cfg("h", V, N * HV)
    kn.fwd_h_kernel[(N * HV, V // BV)](
        kk, w, u, gc, cu, h0 if h0 is not None else gc, h, vn, ht if want_ht else gc, H, HV,
        K=K, V=V, BT=BT, BV=BV, USE_H0=h0 is not None, STORE_HT=want_ht, INTERPRET=build.INTERPRET, **_cfg(cname))
    return h, vn, ht


def _wu(kk, v, beta, gc, A, cu, table, H, HV, K, V, P, device, dt, ws: bool):
    T = kk.shape[0] * kk.shape[1]
    w = _ws("w", (T, HV, K), dt, device) if ws else torch.empty(T, HV, K, dtype=dt, device=device)
    u = _ws("u", (T, HV, V), dt, device)
    kn.fwd_wu_kernel[(P, HV)](kk, v, beta, gc, A, cu, table, w, u, H, HV, K=K, V=V, BT=BT,
                              INTERPRET=build.INTERPRET, **_cfg("wu"))
    return w, u


def _l2norm(q: torch.Tensor, k: torch.Tensor) -> tuple:
    """q, k L2-normalised per row of K, in one launch."""
    K = q.shape[-1]
    qn, kn_ = torch.empty_like(q), torch.empty_like(k)
    R = q.numel() // K
    BR = _rows("l2norm")
    kn.l2norm_fwd_kernel[((R + BR - 1) // BR, 2)](q, qn, k, kn_, R, K=K, BR=BR, INTERPRET=build.INTERPRET,
                                                  **_cfg("l2norm"))
    return qn, kn_


@build.on_input_device
def gdn_forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2, keep_state):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device, dt = q.device, q.dtype
    Tt = B * T
    q, k, v = _c(q), _c(k), _c(v)
    # the L2 norm first: the GPU runs it while the host prepares the chunk table and the next launches (launched
    # after the table, it waited on that host work: a 0.09 ms gap in a synced call's timeline)
    if use_l2:
        qn, kk = _l2norm(q, k)
    else:
        qn, kk = q, k
    if cu_seqlens is None:
        N = B
        cu = torch.arange(B + 1, dtype=torch.int32, device=device) * T
    else:
        N = cu_seqlens.numel() - 1
        cu = _c(cu_seqlens)  # int32 or int64: only the table kernel reads it
    P = build.cdiv(Tt, BT) + N
    table, cu = _chunk_table(cu, N, P, Tt)  # from here on `cu` is the clamped [N, 2] (bos, eos)
    gf = _c(g.to(torch.float32))
    bf = _c(beta.to(torch.float32))
    h0 = _c(initial_state.to(torch.float32)) if initial_state is not None else None
    gc = torch.empty(Tt, HV, dtype=torch.float32, device=device)
    A = torch.empty(Tt, HV, BT, dtype=dt, device=device)
    kn.fwd_prep_kernel[(P, HV)](kk, gf, bf, cu, table, gc, A, H, HV, K=K, BT=BT, INTERPRET=build.INTERPRET,
                                **_cfg("prep"))
    w, u = _wu(kk, v, bf, gc, A, cu, table, H, HV, K, V, P, device, dt, ws=not keep_state)
    h, vn, ht = _fwd_state(kk, w, u, gc, cu, h0, N, HV, H, K, V, P, output_final_state, device, dt,
                           ws_prefix=None if keep_state else "f_")
    o = torch.empty(B, T, HV, V, dtype=dt, device=device)
    kn.fwd_o_kernel[(P, HV)](qn, kk, vn, gc, h, cu, table, o, float(scale), H, HV, K=K, V=V, BT=BT,
                             INTERPRET=build.INTERPRET, **_cfg("o"))
    if not keep_state:
        w, h, vn = _empty0(device, dt), _empty0(device, dt), _empty0(device, dt)
    if not use_l2:
        qn, kk = _empty0(device, dt), _empty0(device, dt)
    return o, ht, qn, kk, gc, A, w, h, vn, cu, table


@build.on_input_device
def gdn_backward(do, dht, q, k, qn, kk, v, g, beta, initial_state, gc, A, w, h, vn, cu, table, scale, use_l2,
                 keep_state):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device, dt = q.device, q.dtype
    Tt = B * T
    N = cu.shape[0]
    P = table.shape[0]
    q, k, v = _c(q), _c(k), _c(v)
    if not use_l2:
        qn, kk = q, k
    bf = _c(beta.to(torch.float32))
    do = _c(do.to(dt))
    if not keep_state:
        h0 = _c(initial_state.to(torch.float32)) if initial_state is not None else None
        w, _u = _wu(kk, v, bf, gc, A, cu, table, H, HV, K, V, P, device, dt, ws=True)
        h, vn, _ = _fwd_state(kk, w, _u, gc, cu, h0, N, HV, H, K, V, P, False, device, dt, ws_prefix="b_")
    grid = (P, HV)
    fuse = _fuse_dvl()
    if fuse:
        dvl = gc  # unused by the fused state backward
    else:
        dvl = _ws("dvl", (Tt, HV, V), dt, device)
        kn.bwd_dvl_kernel[grid](qn, kk, do, gc, cu, table, dvl, float(scale), H, HV, K=K, V=V, BT=BT,
                                INTERPRET=build.INTERPRET, **_cfg("dvl"))
    dhe = _ws("dhe", (P, HV, K, V), dt, device)
    dd = _ws("dd", (Tt, HV, V), dt, device)
    want_dh0 = initial_state is not None
    dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=device) if want_dh0 else None
    dhtf = _c(dht.to(torch.float32)) if dht is not None else None
    cname, BV = _state_cfg("dh", V, N * HV)
    kn.bwd_dh_kernel[(N * HV, V // BV)](
        qn, kk, w, do, dvl, gc, cu, dhtf if dhtf is not None else gc, dh0 if want_dh0 else gc, dhe, dd,
        float(scale), H, HV, K=K, V=V, BT=BT, BV=BV, USE_DHT=dhtf is not None, STORE_DH0=want_dh0, FUSE_DVL=fuse,
        INTERPRET=build.INTERPRET, **_cfg(cname))
    pdt = _pdt(dt)
    dqv = _ws("dqv", (Tt, HV, K), pdt, device)
    kdt = _kdt(dt)  # dk of dqkw, read back by the WY backward
    dkv = _ws("dkv", (Tt, HV, K), kdt, device)
    dw = _ws("dw", (Tt, HV, K), dt, device)
    launches, NP = _dqkw_launches(K)  # NP: partial dG sums per row
    dgp = _ws("dgp", (Tt, HV, NP), torch.float32, device)
    for phase, BK, slot0 in launches:
        kn.bwd_dqkw_kernel[(P * (K // BK), HV)](
            qn, kk, vn, do, dd, gc, h, dhe, cu, table, dqv, dkv, dw, dgp, float(scale), H, HV, K=K, V=V, BT=BT,
            BK=BK, PHASE=phase, NPART=NP, SLOT0=slot0, INTERPRET=build.INTERPRET, **_dqkw_cfg(phase))
    dkf = dkv if pdt == kdt else _ws("dkf", (Tt, HV, K), pdt, device)
    dv = torch.empty(B, T, HV, V, dtype=v.dtype, device=device)
    dbf = torch.empty(Tt, HV, dtype=torch.float32, device=device)
    dgf = torch.empty(Tt, HV, dtype=torch.float32, device=device)
    kn.bwd_wy_kernel[grid](kk, v, bf, gc, A, dw, dd, cu, table, dkv, dkf, dgp, dv, dbf, dgf, H, HV, K=K, V=V, BT=BT,
                           NK=NP, INTERPRET=build.INTERPRET, **_cfg("wy"))
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    BR = _rows("final")
    fgrid = (build.cdiv(Tt, BR), H)
    kn.bwd_final_kernel[fgrid](q, dqv, dq, Tt, H, HV, K=K, BR=BR, L2=use_l2, INTERPRET=build.INTERPRET,
                               **_cfg("final"))
    kn.bwd_final_kernel[fgrid](k, dkf, dk, Tt, H, HV, K=K, BR=BR, L2=use_l2, INTERPRET=build.INTERPRET,
                               **_cfg("final"))
    dg = dgf.view(B, T, HV).to(g.dtype)
    db = dbf.view(B, T, HV).to(beta.dtype)
    if dh0 is not None:
        dh0 = dh0.to(initial_state.dtype)
    else:
        dh0 = _empty0(device)
    return dq, dk, dv, dg, db, dh0


# ----------------------------------------------------------------------------------------------------------------
# torch.library custom ops (torch.compile(fullgraph=True) traces them through their fake implementations)
@torch.library.custom_op("miles_ext_kernels::gdn_fwd", mutates_args=())
def _gdn_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                output_final_state: bool, use_l2: bool, keep_state: bool
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return gdn_forward(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2, keep_state)


@_gdn_fwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2, keep_state):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    Tt = B * T
    P = build.cdiv(Tt, BT) + N
    e = q.new_empty
    f32 = torch.float32
    o = e((B, T, HV, V))
    ht = e((N, HV, K, V), dtype=f32) if output_final_state else e((0,), dtype=f32)
    qn = e((B, T, H, K)) if use_l2 else e((0,))
    kk = e((B, T, H, K)) if use_l2 else e((0,))
    gc = e((Tt, HV), dtype=f32)
    A = e((Tt, HV, BT))
    w = e((Tt, HV, K)) if keep_state else e((0,))
    h = e((P, HV, K, V)) if keep_state else e((0,))
    vn = e((Tt, HV, V)) if keep_state else e((0,))
    cu = e((N, 2), dtype=torch.int32)
    table = e((P, 2), dtype=torch.int32)
    return o, ht, qn, kk, gc, A, w, h, vn, cu, table


@torch.library.custom_op("miles_ext_kernels::gdn_bwd", mutates_args=())
def _gdn_bwd_op(do: torch.Tensor, dht: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                qn: torch.Tensor, kk: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: Optional[torch.Tensor], gc: torch.Tensor, A: torch.Tensor, w: torch.Tensor,
                h: torch.Tensor, vn: torch.Tensor, cu: torch.Tensor, table: torch.Tensor, scale: float, use_l2: bool,
                keep_state: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                           torch.Tensor]:
    return gdn_backward(do, dht, q, k, qn, kk, v, g, beta, initial_state, gc, A, w, h, vn, cu, table, scale, use_l2,
                        keep_state)


@_gdn_bwd_op.register_fake
def _(do, dht, q, k, qn, kk, v, g, beta, initial_state, gc, A, w, h, vn, cu, table, scale, use_l2, keep_state):
    # contiguous like the real op's outputs (empty_like would copy a permuted input's strides)
    dh0 = (initial_state.new_empty(initial_state.shape) if initial_state is not None
           else q.new_empty((0,), dtype=torch.float32))
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), dh0)


class _GatedDeltaRule(torch.autograd.Function):
    """The autograd node of both paths: under torch.compile the custom ops (traced through their fakes); in eager mode
    the same launchers called directly (the custom-op dispatch costs host time)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2, keep_state,
                variant, via_custom_ops):
        fwd = torch.ops.miles_ext_kernels.gdn_fwd if via_custom_ops else gdn_forward
        o, ht, qn, kk, gc, A, w, h, vn, cu, table = fwd(
            q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2, keep_state)
        ctx.save_for_backward(q, k, qn, kk, v, g, beta, initial_state, gc, A, w, h, vn, cu, table)
        ctx.scale, ctx.use_l2, ctx.keep_state, ctx.variant = scale, use_l2, keep_state, variant
        ctx.output_final_state, ctx.via_custom_ops = output_final_state, via_custom_ops
        return o, ht

    @staticmethod
    @once_differentiable  # a second derivative raises instead of silently carrying no history
    def backward(ctx, do, dht):
        q, k, qn, kk, v, g, beta, initial_state, gc, A, w, h, vn, cu, table = ctx.saved_tensors
        if not ctx.output_final_state:
            dht = None
        if do is None:
            do = torch.zeros(q.shape[0], q.shape[1], v.shape[2], v.shape[3], dtype=q.dtype, device=q.device)
        bwd = torch.ops.miles_ext_kernels.gdn_bwd if ctx.via_custom_ops else gdn_backward
        dq, dk, dv, dg, db, dh0 = bwd(do, dht, q, k, qn, kk, v, g, beta, initial_state, gc, A, w, h, vn, cu, table,
                                      ctx.scale, ctx.use_l2, ctx.keep_state)
        dh0 = dh0 if initial_state is not None else None
        return dq, dk, dv, dg, db, dh0, None, None, None, None, None, None, None


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    _check(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    variant = config.variant(OP)
    if cu_seqlens is not None and config.option(OP, "check_seqlens"):
        checks.check_cu_seqlens("cu_seqlens", cu_seqlens, q.shape[1], must_end_at_total=True)
    keep_state = not config.option(OP, "recompute_state")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    o, ht = _GatedDeltaRule.apply(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state,
                                  use_qk_l2norm_in_kernel, keep_state, variant, torch.compiler.is_compiling())
    return o, (ht if output_final_state else None)


# ----------------------------------------------------------------------------------------------------------------
def routes(head_k_dim: int = 128, head_v_dim: int = 128):
    """Every kernel specialization a call with these head dims can launch (bf16 q/k/v; g, beta cast to fp32)."""
    K, V = head_k_dim, head_v_dim
    if K not in HEAD_DIMS or V not in HEAD_DIMS:
        raise ValueError(f"head dims must be in {HEAD_DIMS}, got head_k_dim={K}, head_v_dim={V}")
    bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    I = build.INTERPRET  # noqa: E741
    fuse = _fuse_dvl()
    R = build.Route
    out = [R(kn.chunk_table_kernel, (cu_t, i32, i32, 1, 1, 1, 1), (1,), dict(BT=BT, BP=_TABLE_BP, num_warps=4),
             f"chunk_table[{str(cu_t)[6:]}]") for cu_t in (i32, torch.int64)]
    for X, name in ((K, "k"),):
        out.append(R(kn.l2norm_fwd_kernel, (bf, bf, bf, bf, 1), (1,),
                     dict(K=X, BR=_rows("l2norm"), INTERPRET=I, **_cfg("l2norm")), f"l2norm_fwd[{name}]"))
    out.append(R(kn.fwd_prep_kernel, (bf, f32, f32, i32, i32, f32, bf, 1, 1), (1, 1),
                 dict(K=K, BT=BT, INTERPRET=I, **_cfg("prep")), "fwd_prep"))
    out.append(R(kn.fwd_wu_kernel, (bf, bf, f32, f32, bf, i32, i32, bf, bf, 1, 1), (1, 1),
                 dict(K=K, V=V, BT=BT, INTERPRET=I, **_cfg("wu")), "fwd_wu"))
    for cname in ("h", "h_narrow"):
        for use_h0 in (False, True):
            for store_ht in (False, True):
                out.append(R(kn.fwd_h_kernel, (bf, bf, bf, f32, i32, f32, bf, bf, f32, 1, 1), (1, 1),
                             dict(K=K, V=V, BT=BT, BV=_bv(cname, V), USE_H0=use_h0, STORE_HT=store_ht, INTERPRET=I,
                                  **_cfg(cname)),
                             f"fwd_h[h0={int(use_h0)},ht={int(store_ht)}{',narrow' * (cname != 'h')}]"))
    out.append(R(kn.fwd_o_kernel, (bf, bf, bf, f32, bf, i32, i32, bf, 1.0, 1, 1), (1, 1),
                 dict(K=K, V=V, BT=BT, INTERPRET=I, **_cfg("o")), "fwd_o"))
    if not fuse:
        out.append(R(kn.bwd_dvl_kernel, (bf, bf, bf, f32, i32, i32, bf, 1.0, 1, 1), (1, 1),
                     dict(K=K, V=V, BT=BT, INTERPRET=I, **_cfg("dvl")), "bwd_dvl"))
    dvl_t = f32 if fuse else bf
    for cname in ("dh", "dh_narrow"):
        for use_dht in (False, True):
            for dh0 in (False, True):
                out.append(R(kn.bwd_dh_kernel, (bf, bf, bf, bf, dvl_t, f32, i32, f32, f32, bf, bf, 1.0, 1, 1),
                             (1, 1),
                             dict(K=K, V=V, BT=BT, BV=_bv(cname, V), USE_DHT=use_dht, STORE_DH0=dh0, FUSE_DVL=fuse,
                                  INTERPRET=I, **_cfg(cname)),
                             f"bwd_dh[dht={int(use_dht)},dh0={int(dh0)}{',narrow' * (cname != 'dh')}]"))
    launches, NP = _dqkw_launches(K)
    pdt = _pdt(bf)
    kdt = _kdt(bf)
    for phase, BK, slot0 in launches:
        out.append(R(kn.bwd_dqkw_kernel,
                     (bf, bf, bf, bf, bf, f32, bf, bf, i32, i32, pdt, kdt, bf, f32, 1.0, 1, 1), (1, 1),
                     dict(K=K, V=V, BT=BT, BK=BK, PHASE=phase, NPART=NP, SLOT0=slot0, INTERPRET=I,
                          **_dqkw_cfg(phase)),
                     f"bwd_dqkw[phase={phase}]"))
    out.append(R(kn.bwd_wy_kernel, (bf, bf, f32, f32, bf, bf, bf, i32, i32, kdt, pdt, f32, bf, f32, f32, 1, 1),
                 (1, 1),
                 dict(K=K, V=V, BT=BT, NK=NP, INTERPRET=I, **_cfg("wy")),
                 "bwd_wy"))
    for l2 in (False, True):
        out.append(R(kn.bwd_final_kernel, (bf, pdt, bf, 1, 1, 1), (1, 1),
                     dict(K=K, BR=_rows("final"), L2=l2, INTERPRET=I, **_cfg("final")),
                     f"bwd_final[l2={int(l2)}]"))
    return out
