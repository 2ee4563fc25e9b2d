"""Chunked Kimi Delta Attention: operand checks, launchers, autograd.

Forward: [L2 norm of q, k] -> chunk table -> prep (the gate, gc = in-chunk cumsum of the log decay, Aqk,
A = (I + L)^-1) -> w, u -> state recurrence (h per chunk, dlt) -> o. Backward: in-chunk d(dlt) -> reverse state
recurrence (d of every chunk-end state, full d(dlt), dh0) -> dq, dk, dw, partial dG -> WY backward (dk, dv, dbeta,
dg through the gate, per-chunk dA_log / ddt_bias partials) -> sum dq, dk over the value heads of each key head
(fixed order) and back through the L2 norm -> fixed-order column sum of the gate-parameter partials. gdn's launch
sequence, one to one; the L2 norm, the chunk table and the per-key-head sums are the shared core's
(`_impl/delta_rule/launchers.py`).

Variants, launch configs and routes(): gdn's (see `_impl/delta_rule/host.py`, which both ops' checks share too).
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from miles_ext_kernels.cake._runtime import build, checks, config
from miles_ext_kernels.cake._runtime.autograd import KernelOp
from miles_ext_kernels.cake._runtime.checks import check_tensor
from miles_ext_kernels.cake._runtime.cp import check_call as check_cp_call
from miles_ext_kernels.cake._runtime.cp import simulate, stage_function
from miles_ext_kernels.cake._runtime.launch import arch_of, collect_routes, launch
from miles_ext_kernels.cake.kda import HEAD_DIMS, SAFE_LOWER_BOUND  # the declaration owns what is served
from miles_ext_kernels.cake.kda import OP as SPEC

from ..delta_rule import cp as cp_core
from ..delta_rule import host
from ..delta_rule import launchers as core
from . import configs
from . import kernels as kn

OP = SPEC.name
BT = kn.BT
IN_DTYPES = (torch.bfloat16,)
BETA_DTYPES = (torch.float32, torch.bfloat16)
RAW_GATE_DTYPES = (torch.float32, torch.bfloat16)
STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INTERPRET = build.INTERPRET
_cfg, _state_cfg, _, _rows_cfg, _ws, _c = host.bind(OP, configs)  # gdn's dq / dk / dw launches: not kda's
_pdt, _kdt = core.partial_dtype, core.dk_dtype


def gate_kind(use_gate_in_kernel: bool, lower_bound) -> int:
    """kernels.GATE_*: the log decay as given, the softplus gate, or the lower-bound (sigmoid) gate."""
    if not use_gate_in_kernel:
        return kn.GATE_NONE
    return kn.GATE_SOFTPLUS if lower_bound is None else kn.GATE_SIGMOID


# ----------------------------------------------------------------------------------------------------------------
# checks
def _check(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, use_gate_in_kernel,
           A_log, dt_bias, safe_gate, lower_bound, transpose_state_layout, cu_seqlens, cp_context):
    host.check_flags((("output_final_state", output_final_state),
                      ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel),
                      ("use_gate_in_kernel", use_gate_in_kernel), ("safe_gate", safe_gate),
                      ("transpose_state_layout", transpose_state_layout)))
    B, T, H, K, HV, V = host.check_operands(
        q, k, v, g, beta, scale, head_dims=HEAD_DIMS, in_dtypes=IN_DTYPES,
        g_dtypes=RAW_GATE_DTYPES if use_gate_in_kernel else (torch.float32,), beta_dtypes=BETA_DTYPES,
        gate_per_key=True)
    host.check_optional_float("lower_bound", lower_bound)
    if lower_bound is not None:
        if not (math.isfinite(lower_bound) and lower_bound < 0):
            raise ValueError(f"lower_bound must be a finite float < 0, got {lower_bound}")
        if safe_gate and lower_bound < SAFE_LOWER_BOUND:
            raise ValueError(f"lower_bound must lie in [{SAFE_LOWER_BOUND:g}, 0) with safe_gate=True, got "
                             f"{lower_bound}")
    named = [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)]
    if use_gate_in_kernel:
        if safe_gate and lower_bound is None:
            raise ValueError("lower_bound is required with safe_gate=True and use_gate_in_kernel=True (e.g. -5)")
        for name, t, shape in (("A_log", A_log, (HV,)), ("dt_bias", dt_bias, (HV * K,))):
            if t is None:
                raise ValueError(f"{name} is required with use_gate_in_kernel=True ({list(shape)} fp32)")
            check_tensor(name, t, dtype=torch.float32)
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)} (HV={HV}, K={K}), got {tuple(t.shape)}")
            named.append((name, t))
    else:
        for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
            if t is not None:
                raise ValueError(f"{name} is read only by the in-kernel gate: pass use_gate_in_kernel=True or "
                                 f"{name}=None")
    host.check_packing(q, cu_seqlens, initial_state, named, HV, K, V, state_dtypes=STATE_DTYPES,
                       transpose_state=transpose_state_layout)
    return gate_kind(use_gate_in_kernel, lower_bound)


# ----------------------------------------------------------------------------------------------------------------
# launchers (no autograd)
def _gate_operand(g: torch.Tensor) -> torch.Tensor:
    """g as rows [B * T, HV * K] for the gate kernels (fwd_gate, bwd_dg), which take the row stride and index in
    int32: a view of a wider projection in place where it can be (`core.token_rows`)."""
    return core.token_rows(g, OP, "g", int32_offsets=True)


def _decayed(tab: dict, cname: str) -> bool:
    """Whether the state kernel of config entry `cname` takes its decay-weighted operands from decayed_kernel (the
    entry's DECAYED; a host choice by shapes, as the entry is: the bits are the same either way)."""
    return bool(tab[cname].get("DECAYED", False))


def _decayed_operands(tab, qn, kk, gc, se, table, scale, H, with_q, own=False):
    """kd = k * exp(G_last - G) and, with_q, qg = q * exp(G) * scale ([T, HV, K] in the run's dtype) for the state
    kernels' DECAYED route: kd alone, or (kd, qg); qn, kk [B, T, H, K] or rows (`core.token_rows`). Scratch, or
    (own: under CP, whose other ranks' stages may run between this launch and the last state pass that reads them)
    buffers of their own."""
    Tt, HV, K = gc.shape
    kd = _ws("kd", (Tt, HV, K), kk.dtype, gc.device, own=own)
    qg = _ws("qg", (Tt, HV, K), kk.dtype, gc.device, own=own) if with_q else gc
    qx = qn if with_q else kk
    launch(kn.decayed_kernel, (table.shape[0], HV), q=qx, k=kk, gc=gc, se=se, table=table, kd=kd, qg=qg,
           scale=float(scale), SQ=core.row_stride(qx), SK=core.row_stride(kk), H=H, HV=HV, K=K, BT=BT,
           BK=min(K, tab["decayed"]["BK"]), WITH_Q=with_q, INTERPRET=INTERPRET, **_cfg(tab, "decayed"))
    return (kd, qg) if with_q else kd


def kda_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor], initial_state: Optional[torch.Tensor],
                cu_seqlens: Optional[torch.Tensor], scale: float, lower_bound: float, gate: int,
                output_final_state: bool, use_l2: bool, trans_state: bool, variant: str = "det"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, ht, then what the backward needs: qn, kk, gc, A, Aqk, w, h, vn, se, table). Both variants run these
    kernels. Operands already checked."""
    return cp_core.drive(forward_stage(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale,
                                       lower_bound, gate, output_final_state, use_l2, trans_state))


def forward_stage(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound, gate,
                  output_final_state, use_l2, trans_state, cp=None):
    """kda_forward as a stage generator: under a CP context (`cp`, whose cu_seqlens the call reads; states in the
    [K, V] layout) it exchanges states with the other ranks before the recurrence (`delta_rule/cp.py`) and also
    returns (h0, kept_m: the transitions its backward reads)."""
    tab = configs.CONFIGS[arch_of(q, "q")]
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device, dt = q.device, q.dtype
    Tt = B * T
    q, k, v = core.qkv_operands(q, k, v, OP, use_l2)
    # the L2 norm first: the GPU runs it while the host prepares the chunk table and the next launches
    if use_l2:
        qn, kk = core.l2norm(q, k, (B, T, H, K), _rows_cfg(tab, "l2norm"))
    else:
        qn, kk = q, k
    sqk = core.qk_strides(qn, kk)
    N, P, table, se = core.chunk_setup(OP, cu_seqlens, B, T, device)
    gd = _gate_operand(g)  # the log decay (fp32) or the raw gate (its own dtype: the prep reads it)
    bf = _c(beta.to(torch.float32), "beta")
    if gate:
        al, db = _c(A_log, "A_log"), _c(dt_bias, "dt_bias")
    else:
        al = db = gd  # stand-ins, never read
    h0 = _c(initial_state.to(torch.float32), "initial_state") if initial_state is not None else None
    gc = torch.empty(Tt, HV, K, dtype=torch.float32, device=device)
    A = torch.empty(Tt, HV, BT, dtype=dt, device=device)
    Aqk = torch.empty(Tt, HV, BT, dtype=dt, device=device)
    gk = min(K, tab["gate"]["BK"])
    gs = min(K // gk, tab["gate"]["SPLIT"])
    launch(kn.fwd_gate_kernel, (P, HV, gs), g=gd, A_log=al, dt_bias=db, se=se, table=table, gc=gc,
           lower_bound=float(lower_bound), SG=gd.stride(0), H=H, HV=HV, K=K, BT=BT, BK=gk, SPLIT=gs, GATE=gate,
           **_cfg(tab, "gate"))
    Ls = _ws("Ls", (Tt, HV, BT), torch.float32, device)
    launch(kn.fwd_grams_kernel, (P * 4, HV), q=qn, k=kk, gc=gc, beta=bf, se=se, table=table, Aqk=Aqk, Ls=Ls,
           scale=float(scale), **sqk, H=H, HV=HV, K=K, BT=BT, BK=min(K, tab["grams"]["BK"]),
           DIAG=kn.DIAG_MODES[tab["grams"]["DIAG"]], INTERPRET=INTERPRET, **_cfg(tab, "grams"))
    launch(kn.fwd_inv_kernel, (P, HV), Ls=Ls, se=se, table=table, A=A, HV=HV, BT=BT, TC=tab["inv"]["TC"],
           INTERPRET=INTERPRET, **_cfg(tab, "inv"))
    w = torch.empty(Tt, HV, K, dtype=dt, device=device)
    # under CP, u outlives the exchange (other ranks' stages may run in between): no scratch
    u = _ws("u", (Tt, HV, V), dt, device, own=cp is not None)
    launch(kn.fwd_wu_kernel, (P, HV), k=kk, v=v, beta=bf, gc=gc, A=A, se=se, table=table, w=w, u=u,
           SK=sqk["SK"], SV=core.row_stride(v), H=H, HV=HV, K=K, V=V, BT=BT, INTERPRET=INTERPRET, **_cfg(tab, "wu"))

    # the per-chunk states and dlt (kept for the backward); under CP a document's first piece fills its part before
    # the exchange
    h_all = torch.empty(P, HV, K, V, dtype=dt, device=device)
    vn_all = torch.empty(Tt, HV, V, dtype=dt, device=device)

    operands = []  # kd, formed once per call for every state pass that takes the DECAYED route

    def run_state(se_x, u_x, h0_x, n, VX, want_ht, store_h):
        h, vn = (h_all, vn_all) if store_h else (core.empty0(device, dt), core.empty0(device, dt))
        ht_shape = (n, HV, VX, K) if trans_state else (n, HV, K, VX)
        ht = torch.empty(ht_shape, dtype=torch.float32, device=device) if want_ht else core.empty0(device)
        cname, BV = _state_cfg(tab, "h", VX, n * HV)
        decayed = _decayed(tab, cname)
        if decayed and not operands:
            operands.append(_decayed_operands(tab, qn, kk, gc, se, table, scale, H, False, own=cp is not None))
        kd = operands[0] if decayed else gc
        launch(kn.fwd_h_kernel, (n * HV, VX // BV), k=kk, kd=kd, w=w, u=u_x, gc=gc, se=se_x,
               h0=h0_x if h0_x is not None else gc, h=h, vn=vn, ht=ht if want_ht else gc, SK=sqk["SK"], H=H, HV=HV,
               K=K, V=VX, BT=BT, BV=BV, USE_H0=h0_x is not None, STORE_HT=want_ht, TRANS_STATE=trans_state,
               STORE_H=store_h, VU=u_x.shape[-1], DECAYED=decayed, INTERPRET=INTERPRET, **_cfg(tab, cname))
        return h, vn, ht

    kept_m = None
    se_own = se
    if cp is not None:
        h0, kept_m, se_own = yield from cp_core.incoming_states(
            cp, se, u, HV, K, V, lambda se_x, u_x, h0_x, VX, own: run_state(se_x, u_x, h0_x, se_x.shape[0], VX, True,
                                                                           own)[2])
    h, vn, ht = run_state(se_own, u, h0, N, V, output_final_state, True)
    o = torch.empty(B, T, HV, V, dtype=dt, device=device)
    ov = core.block_v(tab, "o", V)
    launch(kn.fwd_o_kernel, (P, HV, V // ov), q=qn, gc=gc, Aqk=Aqk, vn=vn, h=h, se=se, table=table, o=o,
           scale=float(scale), SQ=sqk["SQ"], H=H, HV=HV, K=K, V=V, BT=BT, BV=ov, INTERPRET=INTERPRET, **_cfg(tab, "o"))
    if not use_l2:
        qn, kk = core.empty0(device, dt), core.empty0(device, dt)
    res = (o, ht, qn, kk, gc, A, Aqk, w, h, vn, se, table)
    return res if cp is None else (res, h0, kept_m)


def kda_backward(do: Optional[torch.Tensor], dht: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                 qn: torch.Tensor, kk: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 A_log: Optional[torch.Tensor], dt_bias: Optional[torch.Tensor],
                 initial_state: Optional[torch.Tensor], gc: torch.Tensor, A: torch.Tensor, Aqk: torch.Tensor,
                 w: torch.Tensor, h: torch.Tensor, vn: torch.Tensor, se: torch.Tensor, table: torch.Tensor,
                 scale: float, lower_bound: float, gate: int, use_l2: bool, trans_state: bool,
                 output_final_state: bool = True, variant: str = "det"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                            torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta, dA_log, ddt_bias, dh0; empty where the input was None). `do` / `dht` None: no
    gradient reached o / the final state."""
    return cp_core.drive(backward_stage(do, dht, q, k, qn, kk, v, g, beta, A_log, dt_bias, initial_state, gc, A, Aqk,
                                        w, h, vn, se, table, scale, lower_bound, gate, use_l2, trans_state,
                                        output_final_state))


def backward_stage(do, dht, q, k, qn, kk, v, g, beta, A_log, dt_bias, initial_state, gc, A, Aqk, w, h, vn, se, table,
                   scale, lower_bound, gate, use_l2, trans_state, output_final_state=True, cp=None,
                   kept_m=None):
    """kda_backward as a stage generator: under a CP context (`cp`; `kept_m` the transitions the forward kept)
    it exchanges state gradients with the other ranks before the reverse recurrence and returns no dh0."""
    tab = configs.CONFIGS[arch_of(q, "q")]
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    device, dt = q.device, q.dtype
    Tt = B * T
    P = table.shape[0]
    q, k, v = core.qkv_operands(q, k, v, OP, use_l2)
    if not use_l2:
        qn, kk = q, k
    sqk = core.qk_strides(qn, kk)
    gd = _gate_operand(g)
    bf = _c(beta.to(torch.float32), "beta")
    if gate:
        al, db = _c(A_log, "A_log"), _c(dt_bias, "dt_bias")
    else:
        al = db = gd
    if do is None:
        do = torch.zeros(B, T, HV, V, dtype=dt, device=device)
    do = _c(do.to(dt), "do")
    if not output_final_state:
        dht = None
    grid = (P, HV)
    dvl = _ws("dvl", (Tt, HV, V), dt, device, own=cp is not None)
    dAqk = _ws("dAqk", (Tt, HV, BT), torch.float32, device)
    launch(kn.bwd_dvl_kernel, grid, Aqk=Aqk, do=do, vn=vn, se=se, table=table, dvl=dvl, dAqk=dAqk,
           scale=float(scale), H=H, HV=HV, V=V, BT=BT, INTERPRET=INTERPRET, **_cfg(tab, "dvl"))

    # under CP, a document's last piece runs its reverse pass before the exchange (other ranks' stages may run in
    # between): no scratch for what it stores
    dhe = _ws("dhe", (P, HV, K, V), dt, device, own=cp is not None)
    dd = _ws("dd", (Tt, HV, V), dt, device, own=cp is not None)

    operands = []  # (kd, qg), formed once per call for every reverse pass that takes the DECAYED route

    def run_dh(se_x, dht_x, dh0_shape, store=True):
        n = se_x.shape[0]
        dh0 = torch.empty(dh0_shape, dtype=torch.float32, device=device) if dh0_shape else None
        cname, BV = _state_cfg(tab, "dh", V, n * HV)
        decayed = _decayed(tab, cname)
        if decayed and not operands:
            operands.append(_decayed_operands(tab, qn, kk, gc, se, table, scale, H, True, own=cp is not None))
        kd, qg = operands[0] if decayed else (gc, gc)
        launch(kn.bwd_dh_kernel, (n * HV, V // BV), q=qn, k=kk, kd=kd, qg=qg, w=w, do=do, dvl=dvl, gc=gc, se=se_x,
               dht=dht_x if dht_x is not None else gc, dh0=dh0 if dh0 is not None else gc, dhe=dhe, dd=dd,
               scale=float(scale), **sqk, H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, USE_DHT=dht_x is not None,
               STORE_DH0=dh0 is not None, STORE_DHE=store, TRANS_STATE=trans_state, DECAYED=decayed,
               INTERPRET=INTERPRET, **_cfg(tab, cname))
        return dhe, dd, dh0

    se_own = se
    if cp is not None:
        dht, se_own = yield from cp_core.outgoing_grads(cp, se, kept_m, HV, K, V, lambda se_x, dht_x, own:
            run_dh(se_x, dht_x, (se_x.shape[0], HV, K, V), own)[2])
    want_dh0 = initial_state is not None and cp is None
    dhe, dd, dh0 = run_dh(se_own, _c(dht.to(torch.float32), "dht") if dht is not None else None,
                          initial_state.shape if want_dh0 else None)
    pdt, kdt = _pdt(tab, dt), _kdt(tab, dt)
    dqs = _ws("dqs", (Tt, HV, K), torch.float32, device)
    dks = _ws("dks", (Tt, HV, K), kdt, device)
    dgs = _ws("dgs", (Tt, HV, K), torch.float32, device)
    dgx = _ws("dgx", (Tt, HV, K), torch.float32, device)
    NK = K // min(K, tab["intra"]["BK"])
    dbp = _ws("dbp", (NK + 1, Tt, HV), torch.float32, device)  # dbeta's partials: per key slice, then the dense
    dL = _ws("dL", (Tt, HV, BT), torch.float32, device)
    dv = torch.empty(B, T, HV, V, dtype=v.dtype, device=device)
    launch(kn.bwd_dense_kernel, grid, q=qn, k=kk, v=v, vn=vn, beta=bf, do=do, dd=dd, gc=gc, A=A, h=h, dhe=dhe, se=se,
           table=table, dqs=dqs, dks=dks, dgs=dgs, dgx=dgx, dv=dv, dbs=dbp[NK], dL=dL, scale=float(scale),
           **sqk, SV=core.row_stride(v), H=H, HV=HV, K=K, V=V, BT=BT, BK=min(K, tab["dense"]["BK"]),
           INTERPRET=INTERPRET, **_cfg(tab, "dense"))
    dqv = _ws("dqv", (Tt, HV, K), pdt, device)
    dkf = _ws("dkf", (Tt, HV, K), pdt, device)
    dGi = _ws("dGi", (Tt, HV, K), torch.float32, device)
    launch(kn.bwd_intra_kernel, (P * 4 * NK, HV), q=qn, k=kk, beta=bf, gc=gc, dAqk=dAqk, dL=dL, se=se, table=table,
           dqs=dqs, dks=dks, dq=dqv, dk=dkf, dbp=dbp, dGi=dGi, TT=Tt, **sqk, H=H, HV=HV, K=K,
           BT=BT, BK=min(K, tab["intra"]["BK"]), DIAG=kn.DIAG_MODES[tab["intra"]["DIAG"]], INTERPRET=INTERPRET,
           **_cfg(tab, "intra"))
    dbf = torch.empty(Tt, HV, dtype=torch.float32, device=device)
    dg = torch.empty(B, T, HV, K, dtype=g.dtype, device=device)
    part = _ws("gate_part", (P, HV * K + HV), torch.float32, device) if gate else dbf
    launch(kn.bwd_dg_kernel, grid, g=gd, A_log=al, dt_bias=db, dGi=dGi, dGd=dgs, dgx=dgx, dbp=dbp, se=se, table=table,
           dbeta=dbf, dg=dg, part=part, lower_bound=float(lower_bound), SG=gd.stride(0), TT=Tt, H=H, HV=HV, K=K, BT=BT,
           BK=min(K, tab["dg"]["BK"]), NB=NK + 1, GATE=gate, INTERPRET=INTERPRET, **_cfg(tab, "dg"))
    dq = torch.empty(B, T, H, K, dtype=q.dtype, device=device)
    dk = torch.empty(B, T, H, K, dtype=k.dtype, device=device)
    core.key_head_sums(((q, dqv, dq), (k, dkf, dk)), Tt, H, HV, K, use_l2, _rows_cfg(tab, "final"))
    if gate:
        dA = torch.empty(HV, dtype=torch.float32, device=device)
        ddt = torch.empty(HV * K, dtype=torch.float32, device=device)
        c = tab["gate_sum"]
        launch(kn.gate_sum_kernel, (build.cdiv(HV * K + HV, c["BN"]),), part=part, out1=ddt, out2=dA, P=P,
               N1=HV * K, N2=HV, BP=c["BP"], BN=c["BN"], **_cfg(tab, "gate_sum"))
        dA, ddt = dA.to(A_log.dtype), ddt.to(dt_bias.dtype)
    else:
        dA = ddt = core.empty0(device)
    dbeta = dbf.view(B, T, HV).to(beta.dtype)
    dh0 = dh0.to(initial_state.dtype) if dh0 is not None else core.empty0(device)
    return dq, dk, dv, dg, dbeta, dA, ddt, dh0


def _forward_fake(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound, gate,
                  output_final_state, use_l2, trans_state, variant="det"):
    B, T, H, K, HV, V, N, Tt, P = host.fake_sizes(q, v, cu_seqlens)
    e = q.new_empty
    f32 = torch.float32
    o = e((B, T, HV, V))
    ht = e((N, HV, V, K) if trans_state else (N, HV, K, V), dtype=f32) if output_final_state else e((0,), dtype=f32)
    qn = e((B, T, H, K)) if use_l2 else e((0,))
    kk = e((B, T, H, K)) if use_l2 else e((0,))
    gc = e((Tt, HV, K), dtype=f32)
    A = e((Tt, HV, BT))
    Aqk = e((Tt, HV, BT))
    w = e((Tt, HV, K))
    h = e((P, HV, K, V))
    vn = e((Tt, HV, V))
    se = e((N, 2), dtype=torch.int32)
    table = e((P, 2), dtype=torch.int32)
    return o, ht, qn, kk, gc, A, Aqk, w, h, vn, se, table


def _backward_fake(do, dht, q, k, qn, kk, v, g, beta, A_log, dt_bias, initial_state, gc, A, Aqk, w, h, vn, se, table,
                   scale, lower_bound, gate, use_l2, trans_state, output_final_state=True, variant="det"):
    # contiguous like the real op's outputs (empty_like would copy a permuted input's strides)
    def like(t):
        return t.new_empty(t.shape) if t is not None else q.new_empty((0,), dtype=torch.float32)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), like(A_log if gate else None), like(dt_bias if gate else None),
            like(initial_state))


def _setup(inputs, res):
    (q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lower_bound, gate, output_final_state,
     use_l2, trans_state, variant) = inputs
    o, ht, qn, kk, gc, A, Aqk, w, h, vn, se, table = res
    return ((q, k, qn, kk, v, g, beta, A_log, dt_bias, initial_state, gc, A, Aqk, w, h, vn, se, table),
            (scale, lower_bound, gate, use_l2, trans_state, output_final_state, variant))


KDA = KernelOp(OP, forward=kda_forward, forward_fake=_forward_fake, setup=_setup, backward=kda_backward,
               backward_fake=_backward_fake, grad_inputs=(0, 1, 2, 3, 4, 5, 6, 7), n_outputs=2)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, safe_gate=False,
              lower_bound=None, transpose_state_layout=False, cu_seqlens=None, cp_context=None):
    if cp_context is not None:
        check_cp_call(OP, cp_context, "q", q, token_dim=1, given=(("cu_seqlens", cu_seqlens),),
                      unserved=(("initial_state", initial_state), ("output_final_state", output_final_state)))
        cu_seqlens = cp_context.cu_seqlens
    gate = _check(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                  use_gate_in_kernel, A_log, dt_bias, safe_gate, lower_bound, transpose_state_layout, cu_seqlens,
                  cp_context)
    if cu_seqlens is not None and cp_context is None and config.option(OP, "check_seqlens"):
        checks.check_cu_seqlens("cu_seqlens", cu_seqlens, q.shape[1], must_end_at_total=True)
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    lb = float(lower_bound) if gate == kn.GATE_SIGMOID else 0.0
    if not gate:
        A_log = dt_bias = None
    if cp_context is not None:
        o = KDA_CP.apply(cp_context, q, k, v, g, beta, A_log, dt_bias, scale, lb, gate, use_qk_l2norm_in_kernel)
        return o, None
    o, ht = KDA(q, k, v, g, beta, A_log, dt_bias, initial_state, cu_seqlens, scale, lb, gate, output_final_state,
                use_qk_l2norm_in_kernel, transpose_state_layout)
    return o, (ht if output_final_state else None)


def cp_forward_stage(cp, q, k, v, g, beta, A_log, dt_bias, scale, lower_bound, gate, use_l2):
    """One rank's CP forward (a stage generator, `_runtime/cp.py`): (o, what cp_backward_stage needs)."""
    res, h0, kept_m = yield from forward_stage(q, k, v, g, beta, A_log, dt_bias, None, cp.cu_seqlens, scale,
                                               lower_bound, gate, False, use_l2, False, cp=cp)
    return res[0], (q, k, v, g, beta, A_log, dt_bias, h0, res[2:], kept_m, scale, lower_bound, gate, use_l2)


def cp_backward_stage(cp, saved, do):
    """One rank's CP backward (a stage generator): the gradients of q, k, v, g, beta, then this rank's partial sums
    of the gradients of A_log and dt_bias (None without the in-kernel gate), then None for the rest."""
    q, k, v, g, beta, A_log, dt_bias, h0, res, kept_m, scale, lower_bound, gate, use_l2 = saved
    qn, kk, gc, A, Aqk, w, h, vn, se, table = res
    dq, dk, dv, dg, db, dA, ddt, _ = yield from backward_stage(
        do, None, q, k, qn, kk, v, g, beta, A_log, dt_bias, h0, gc, A, Aqk, w, h, vn, se, table, scale, lower_bound,
        gate, use_l2, False, False, cp=cp, kept_m=kept_m)
    return dq, dk, dv, dg, db, (dA if gate else None), (ddt if gate else None), None, None, None, None


KDA_CP = stage_function(cp_forward_stage, cp_backward_stage)


# ----------------------------------------------------------------------------------------------------------------
def routes(head_k_dim: int = 128, head_v_dim: int = 128):
    """Every kernel specialization a call with these head dims can launch: the launchers above run on meta tensors
    over every flag (gate kind and raw-gate dtype, L2 norm, initial / final state and its layout, wide / narrow state
    tiles, int32 / int64 / no cu_seqlens, context parallelism) and record their launches."""
    K, V = head_k_dim, head_v_dim
    arch = host.route_arch(K, V, HEAD_DIMS)
    H, HV = 2, 4
    meta = dict(device="meta")
    gates = [(kn.GATE_NONE, torch.float32)] + [(kind, dt) for kind in (kn.GATE_SOFTPLUS, kn.GATE_SIGMOID)
                                               for dt in RAW_GATE_DTYPES]
    with collect_routes(arch) as rs:
        for n_seq in (1, configs.NARROW_BELOW):  # narrow and wide state tiles
            for cu_dtype in (None,) + host.CU_DTYPES:
                cu, B, Tb, q, v = host.route_operands(n_seq, cu_dtype, H, HV, K, V)
                beta = torch.empty(B, Tb, HV, **meta)
                a_log = torch.empty(HV, **meta)
                dt_bias = torch.empty(HV * K, **meta)
                for gate, gdt in gates:
                    g = torch.empty(B, Tb, HV, K, dtype=gdt, **meta)
                    al, db = (a_log, dt_bias) if gate else (None, None)
                    for use_l2 in (False, True):
                        for trans in (False, True):
                            h0 = torch.empty((n_seq, HV, V, K) if trans else (n_seq, HV, K, V), **meta)
                            for init in (None, h0):
                                for final in (False, True):
                                    res = kda_forward(q, q, v, g, beta, al, db, init, cu, 1.0, -1.0, gate, final,
                                                      use_l2, trans)
                                    kda_backward(v, h0 if final else None, q, q, *res[2:4], v, g, beta, al, db, init,
                                                 *res[4:], 1.0, -1.0, gate, use_l2, trans, final, "det")
        for ctxs in cp_core.route_plans():  # context parallelism's extra passes and its chain kernel
            T = ctxs[0].total_tokens
            q = torch.empty(1, T, H, K, dtype=torch.bfloat16, **meta)
            v = torch.empty(1, T, HV, V, dtype=torch.bfloat16, **meta)
            beta = torch.empty(1, T, HV, **meta)
            for gate, gdt in gates:
                g = torch.empty(1, T, HV, K, dtype=gdt, **meta)
                params = [torch.empty(HV, **meta), torch.empty(HV * K, **meta)] if gate else [None, None]
                simulate(cp_forward_stage, cp_backward_stage, ctxs, [q, q, v, g, beta], params=params,
                         args=(1.0, -1.0, gate, True), grad_out=v)
    return rs.routes
