"""Chunked Gated DeltaNet: operand checks, launchers, autograd.

Forward: [L2 norm of q, k] -> prep (gc = in-chunk cumsum of g, A = (I + L)^-1) -> w, u -> state recurrence
(h per chunk, dlt) -> o. Backward: [recompute w, u, h, dlt] -> in-chunk d(dlt) -> reverse state recurrence (d of
every chunk-end state, full d(dlt), dh0) -> dq, dk, dw, partial dg -> WY backward (dk, dv, dbeta, dg) -> sum dq,
dk over the value heads of each key head (fixed order) and back through the L2 norm.

Variants, launch configs and routes(): as `_impl/delta_rule/host.py` says of both delta-rule ops.
"""
from __future__ import annotations

from typing import Optional

import torch

from miles_ext_kernels.cake._runtime import build, checks, config
from miles_ext_kernels.cake._runtime.autograd import KernelOp
from miles_ext_kernels.cake._runtime.cp import check_call as check_cp_call
from miles_ext_kernels.cake._runtime.cp import simulate, stage_function
from miles_ext_kernels.cake._runtime.launch import arch_of, collect_routes, launch
from miles_ext_kernels.cake.gdn import HEAD_DIMS  # the declaration owns the served head dims
from miles_ext_kernels.cake.gdn import OP as SPEC

from ..delta_rule import cp as cp_core
from ..delta_rule import host
from ..delta_rule import launchers as core
from . import configs
from . import kernels as kn

OP = SPEC.name
BT = kn.BT
IN_DTYPES = (torch.bfloat16,)
GATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INTERPRET = build.INTERPRET
_cfg, _state_cfg, _dqkw_cfg, _rows_cfg, _ws, _c = host.bind(OP, configs)
_pdt, _kdt, _empty0 = core.partial_dtype, core.dk_dtype, core.empty0


def _dqkw_launches(tab: dict, K: int) -> tuple:
    """(phase, BK, first dG slot, first dg slot) of each dq / dk / dw launch, the number of dG slots and of dg slots
    (one per K slice of the launches with the dk part: its state term of dg, see bwd_dqkw_kernel). Phases: (0,) one
    launch of all three; (1, 2) a dq, dw launch and a dk launch (fewer live tiles each, each with its own BK)."""
    c = tab["dqkw"]
    out, slot, direct = [], 0, 0
    for phase in ((1, 2) if c["SPLIT"] else (0,)):
        bk = min(K, c["BK_dk" if phase == 2 else "BK"])
        out.append((phase, bk, slot, direct))
        slot += K // bk
        direct += K // bk if phase != 1 else 0
    return out, slot, direct


# ----------------------------------------------------------------------------------------------------------------
# checks
def _check(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens):
    B, T, H, K, HV, V = host.check_operands(q, k, v, g, beta, scale, head_dims=HEAD_DIMS, in_dtypes=IN_DTYPES,
                                            g_dtypes=GATE_DTYPES, beta_dtypes=GATE_DTYPES, gate_per_key=False)
    host.check_flags((("output_final_state", output_final_state),
                      ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)))
    N = host.check_packing(q, cu_seqlens, initial_state, [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)],
                           HV, K, V, state_dtypes=GATE_DTYPES)
    return B, T, H, K, HV, V, N


def _operands(q, k, v, use_l2: bool) -> tuple:
    """(config table, (B, T, H, K, HV, V), q, k, v as the kernels read them: `core.qkv_operands`) of a forward or
    backward call."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    q, k, v = core.qkv_operands(q, k, v, OP, use_l2)
    return configs.CONFIGS[arch_of(q, "q")], (B, T, H, K, HV, V), q, k, v


# ----------------------------------------------------------------------------------------------------------------
# launchers (no autograd)
def _fwd_state(tab, kk, w, u, gc, se, h0, N, HV, H, K, V, P, want_ht, device, dt, ws_prefix, store_h=True, out=None):
    """Run the state recurrence; returns (h, vn, ht). store_h off: the final state only (h, vn empty); `out`: the
    (h, vn) to store into. kk: [B, T, H, K] or rows (`core.token_rows`)."""
    T = gc.shape[0]
    if not store_h:
        h = vn = _empty0(device, dt)
    elif out is not None:
        h, vn = out
    elif ws_prefix:
        h, vn = _ws(ws_prefix + "h", (P, HV, K, V), dt, device), _ws(ws_prefix + "vn", (T, HV, V), dt, device)
    else:
        h, vn = torch.empty(P, HV, K, V, dtype=dt, device=device), torch.empty(T, HV, V, dtype=dt, device=device)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=device) if want_ht else _empty0(device)
    cname, BV = _state_cfg(tab, "h", V, N * HV)
    launch(kn.fwd_h_kernel, (N * HV, V // BV), k=kk, w=w, u=u, gc=gc, se=se, h0=h0 if h0 is not None else gc, h=h,
           vn=vn, ht=ht if want_ht else gc, SK=core.row_stride(kk), H=H, HV=HV, K=K, V=V, BT=BT, BV=BV,
           USE_H0=h0 is not None, STORE_HT=want_ht, STORE_H=store_h, VU=u.shape[-1], INTERPRET=INTERPRET,
           **_cfg(tab, cname))
    return h, vn, ht


def _wu(tab, kk, v, beta, gc, A, se, table, H, HV, K, V, P, device, dt, ws: bool, ws_u: bool = True):
    T = gc.shape[0]
    w = _ws("w", (T, HV, K), dt, device, own=not ws)
    u = _ws("u", (T, HV, V), dt, device, own=not ws_u)
    launch(kn.fwd_wu_kernel, (P, HV), k=kk, v=v, beta=beta, gc=gc, A=A, se=se, table=table, w=w, u=u,
           SK=core.row_stride(kk), SV=core.row_stride(v), H=H, HV=HV, K=K, V=V, BT=BT, INTERPRET=INTERPRET,
           **_cfg(tab, "wu"))
    return w, u


def gdn_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                initial_state: Optional[torch.Tensor], cu_seqlens: Optional[torch.Tensor], scale: float,
                output_final_state: bool, use_l2: bool, keep_state: bool, variant: str = "det"
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                           torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(o, ht, then what the backward needs: qn, kk, gc, A, w, h, vn, se, table). Both variants run these kernels.
    Operands already checked."""
    return cp_core.drive(forward_stage(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2,
                                       keep_state))


def forward_stage(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2, keep_state,
                  cp=None):
    """gdn_forward as a stage generator: under a CP context (`cp`, whose cu_seqlens the call reads) it exchanges
    states with the other ranks before the recurrence (`delta_rule/cp.py`) and also returns (h0, kept_m: the
    transitions its backward reads)."""
    tab, (B, T, H, K, HV, V), q, k, v = _operands(q, k, v, use_l2)
    device, dt, Tt = q.device, q.dtype, B * T
    # the L2 norm first: the GPU runs it while the host prepares the chunk table and the next launches (launched
    # after the table, it waited on that host work: a 0.09 ms gap in a synced call's timeline)
    if use_l2:
        qn, kk = core.l2norm(q, k, (B, T, H, K), _rows_cfg(tab, "l2norm"))
    else:
        qn, kk = q, k
    sqk = core.qk_strides(qn, kk)
    N, P, table, se = core.chunk_setup(OP, cu_seqlens, B, T, device)
    gf = _c(g.to(torch.float32), "g")
    bf = _c(beta.to(torch.float32), "beta")
    h0 = _c(initial_state.to(torch.float32), "initial_state") if initial_state is not None else None
    gc = torch.empty(Tt, HV, dtype=torch.float32, device=device)
    A = torch.empty(Tt, HV, BT, dtype=dt, device=device)
    launch(kn.fwd_prep_kernel, (P, HV), k=kk, g=gf, beta=bf, se=se, table=table, gc=gc, A=A, SK=sqk["SK"], H=H,
           HV=HV, K=K, BT=BT, INTERPRET=INTERPRET, **_cfg(tab, "prep"))
    # under CP, w and u outlive the exchange (other ranks' stages may run in between): no scratch
    w, u = _wu(tab, kk, v, bf, gc, A, se, table, H, HV, K, V, P, device, dt, ws=not keep_state and cp is None,
               ws_u=cp is None)
    kept_m = None
    se_own, out = se, None
    if cp is not None:
        # the per-chunk states and dlt: a document's first piece fills its part before the exchange
        out = (torch.empty(P, HV, K, V, dtype=dt, device=device), torch.empty(Tt, HV, V, dtype=dt, device=device))

        def run_state(se_x, u_x, h0_x, VX, own):
            return _fwd_state(tab, kk, w, u_x, gc, se_x, h0_x, se_x.shape[0], HV, H, K, VX, P, True, device, dt,
                              ws_prefix=None, store_h=own, out=out)[2]

        h0, kept_m, se_own = yield from cp_core.incoming_states(cp, se, u, HV, K, V, run_state)
    h, vn, ht = _fwd_state(tab, kk, w, u, gc, se_own, h0, N, HV, H, K, V, P, output_final_state, device, dt,
                           ws_prefix=None if keep_state else "f_", out=out)
    o = torch.empty(B, T, HV, V, dtype=dt, device=device)
    launch(kn.fwd_o_kernel, (P, HV), q=qn, k=kk, vn=vn, gc=gc, h=h, se=se, table=table, o=o, scale=float(scale),
           **sqk, H=H, HV=HV, K=K, V=V, BT=BT, INTERPRET=INTERPRET, **_cfg(tab, "o"))
    if not keep_state:
        w, h, vn = _empty0(device, dt), _empty0(device, dt), _empty0(device, dt)
    if not use_l2:
        qn, kk = _empty0(device, dt), _empty0(device, dt)
    res = (o, ht, qn, kk, gc, A, w, h, vn, se, table)
    return res if cp is None else (res, h0, kept_m)


def gdn_backward(do: Optional[torch.Tensor], dht: Optional[torch.Tensor], q: torch.Tensor, k: torch.Tensor,
                 qn: torch.Tensor, kk: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 initial_state: Optional[torch.Tensor], gc: torch.Tensor, A: torch.Tensor, w: torch.Tensor,
                 h: torch.Tensor, vn: torch.Tensor, se: torch.Tensor, table: torch.Tensor, scale: float,
                 use_l2: bool, keep_state: bool, output_final_state: bool = True, variant: str = "det"
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, dg, dbeta, dh0; dh0 empty without an initial state). `do` / `dht` None: no gradient reached o /
    the final state."""
    return cp_core.drive(backward_stage(do, dht, q, k, qn, kk, v, g, beta, initial_state, gc, A, w, h, vn, se, table,
                                        scale, use_l2, keep_state, output_final_state))


def backward_stage(do, dht, q, k, qn, kk, v, g, beta, initial_state, gc, A, w, h, vn, se, table, scale, use_l2,
                   keep_state, output_final_state=True, cp=None, kept_m=None):
    """gdn_backward as a stage generator: under a CP context (`cp`; `initial_state` then the forward's incoming
    states, `kept_m` the transitions it kept) it exchanges state gradients with the other ranks before the reverse
    recurrence and returns no dh0."""
    tab, (B, T, H, K, HV, V), q, k, v = _operands(q, k, v, use_l2)
    device, dt, Tt = q.device, q.dtype, B * T
    N, P = se.shape[0], table.shape[0]
    if not use_l2:
        qn, kk = q, k
    sqk = core.qk_strides(qn, kk)
    bf = _c(beta.to(torch.float32), "beta")
    if do is None:
        do = torch.zeros(B, T, HV, V, dtype=dt, device=device)
    do = _c(do.to(dt), "do")
    if not output_final_state:
        dht = None
    if not keep_state:
        h0 = _c(initial_state.to(torch.float32), "initial_state") if initial_state is not None else None
        w, _u = _wu(tab, kk, v, bf, gc, A, se, table, H, HV, K, V, P, device, dt, ws=cp is None, ws_u=cp is None)
        h, vn, _ = _fwd_state(tab, kk, w, _u, gc, se, h0, N, HV, H, K, V, P, False, device, dt,
                              ws_prefix="b_" if cp is None else None)
    grid = (P, HV)
    dvl = _ws("dvl", (Tt, HV, V), dt, device, own=cp is not None)
    launch(kn.bwd_dvl_kernel, grid, q=qn, k=kk, do=do, gc=gc, se=se, table=table, dvl=dvl, scale=float(scale), **sqk,
           H=H, HV=HV, K=K, V=V, BT=BT, INTERPRET=INTERPRET, **_cfg(tab, "dvl"))

    # under CP, a document's last piece runs its reverse pass before the exchange (other ranks' stages may run in
    # between): no scratch for what it stores
    dhe = _ws("dhe", (P, HV, K, V), dt, device, own=cp is not None)
    dd = _ws("dd", (Tt, HV, V), dt, device, own=cp is not None)

    def run_dh(se_x, dht_x, want_dh0, store=True):
        n = se_x.shape[0]
        dh0 = torch.empty(n, HV, K, V, dtype=torch.float32, device=device) if want_dh0 else None
        cname, BV = _state_cfg(tab, "dh", V, n * HV)
        launch(kn.bwd_dh_kernel, (n * HV, V // BV), q=qn, k=kk, w=w, do=do, dvl=dvl, gc=gc, se=se_x,
               dht=dht_x if dht_x is not None else gc, dh0=dh0 if want_dh0 else gc, dhe=dhe, dd=dd,
               scale=float(scale), **sqk, H=H, HV=HV, K=K, V=V, BT=BT, BV=BV, USE_DHT=dht_x is not None,
               STORE_DH0=want_dh0, STORE_DHE=store, INTERPRET=INTERPRET, **_cfg(tab, cname))
        return dhe, dd, dh0

    se_own = se
    if cp is not None:
        dht, se_own = yield from cp_core.outgoing_grads(cp, se, kept_m, HV, K, V, lambda se_x, dht_x, own: run_dh(
            se_x, dht_x, True, own)[2])
    want_dh0 = initial_state is not None and cp is None
    dhe, dd, dh0 = run_dh(se_own, _c(dht.to(torch.float32), "dht") if dht is not None else None, want_dh0)
    pdt = _pdt(tab, dt)
    dqv = _ws("dqv", (Tt, HV, K), pdt, device)
    kdt = _kdt(tab, dt)  # dk of dqkw, read back by the WY backward
    dkv = _ws("dkv", (Tt, HV, K), kdt, device)
    dw = _ws("dw", (Tt, HV, K), dt, device)
    launches, NP, ND = _dqkw_launches(tab, K)  # NP: partial dG sums per row, ND: terms of dg
    dgp = _ws("dgp", (Tt, HV, NP + ND), torch.float32, device)
    for phase, BK, slot0, dslot0 in launches:
        launch(kn.bwd_dqkw_kernel, (P * (K // BK), HV), q=qn, k=kk, vn=vn, do=do, dd=dd, gc=gc, h=h, dhe=dhe, se=se,
               table=table, dq=dqv, dk=dkv, dw=dw, dgp=dgp, scale=float(scale), **sqk, H=H, HV=HV, K=K, V=V, BT=BT,
               BK=BK, PHASE=phase, NPART=NP + ND, SLOT0=slot0, DSLOT0=NP + dslot0, INTERPRET=INTERPRET,
               **_dqkw_cfg(tab, phase))
    dkf = dkv if pdt == kdt else _ws("dkf", (Tt, HV, K), pdt, device)
    dv = torch.empty(B, T, HV, V, dtype=v.dtype, device=device)
    dbf = torch.empty(Tt, HV, dtype=torch.float32, device=device)
    dgf = torch.empty(Tt, HV, dtype=torch.float32, device=device)
    launch(kn.bwd_wy_kernel, grid, k=kk, v=v, beta=bf, gc=gc, A=A, dw=dw, dd=dd, se=se, table=table, dk=dkv, dko=dkf,
           dgp=dgp, dv=dv, dbeta=dbf, dg=dgf, SK=sqk["SK"], SV=core.row_stride(v), H=H, HV=HV, K=K, V=V, BT=BT, NK=NP,
           ND=ND, INTERPRET=INTERPRET, **_cfg(tab, "wy"))
    dq = torch.empty(B, T, H, K, dtype=q.dtype, device=device)
    dk = torch.empty(B, T, H, K, dtype=k.dtype, device=device)
    core.key_head_sums(((q, dqv, dq), (k, dkf, dk)), Tt, H, HV, K, use_l2, _rows_cfg(tab, "final"))
    dg = dgf.view(B, T, HV).to(g.dtype)
    db = dbf.view(B, T, HV).to(beta.dtype)
    dh0 = dh0.to(initial_state.dtype) if dh0 is not None else _empty0(device)
    return dq, dk, dv, dg, db, dh0


def _forward_fake(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2, keep_state,
                  variant="det"):
    B, T, H, K, HV, V, N, Tt, P = host.fake_sizes(q, v, cu_seqlens)
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
    se = e((N, 2), dtype=torch.int32)
    table = e((P, 2), dtype=torch.int32)
    return o, ht, qn, kk, gc, A, w, h, vn, se, table


def _backward_fake(do, dht, q, k, qn, kk, v, g, beta, initial_state, gc, A, w, h, vn, se, table, scale, use_l2,
                   keep_state, output_final_state=True, variant="det"):
    # contiguous like the real op's outputs (empty_like would copy a permuted input's strides)
    dh0 = (initial_state.new_empty(initial_state.shape) if initial_state is not None
           else q.new_empty((0,), dtype=torch.float32))
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), g.new_empty(g.shape),
            beta.new_empty(beta.shape), dh0)


def _setup(inputs, res):
    q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_l2, keep_state, variant = inputs
    o, ht, qn, kk, gc, A, w, h, vn, se, table = res
    return ((q, k, qn, kk, v, g, beta, initial_state, gc, A, w, h, vn, se, table),
            (scale, use_l2, keep_state, output_final_state, variant))


GDN = KernelOp(OP, forward=gdn_forward, forward_fake=_forward_fake, setup=_setup, backward=gdn_backward,
               backward_fake=_backward_fake, grad_inputs=(0, 1, 2, 3, 4, 5), n_outputs=2)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, cp_context=None):
    if cp_context is not None:
        check_cp_call(OP, cp_context, "q", q, token_dim=1, given=(("cu_seqlens", cu_seqlens),),
                      unserved=(("initial_state", initial_state), ("output_final_state", output_final_state)))
        cu_seqlens = cp_context.cu_seqlens
    _check(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    if cu_seqlens is not None and cp_context is None and config.option(OP, "check_seqlens"):
        checks.check_cu_seqlens("cu_seqlens", cu_seqlens, q.shape[1], must_end_at_total=True)
    keep_state = not config.option(OP, "recompute_state")
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    if cp_context is not None:
        o = GDN_CP.apply(cp_context, q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, keep_state)
        return o, None
    o, ht = GDN(q, k, v, g, beta, initial_state, cu_seqlens, scale, output_final_state, use_qk_l2norm_in_kernel,
                keep_state)
    return o, (ht if output_final_state else None)


def cp_forward_stage(cp, q, k, v, g, beta, scale, use_l2, keep_state):
    """One rank's CP forward (a stage generator, `_runtime/cp.py`): (o, what cp_backward_stage needs)."""
    res, h0, kept_m = yield from forward_stage(q, k, v, g, beta, None, cp.cu_seqlens, scale, False, use_l2,
                                               keep_state, cp=cp)
    return res[0], (q, k, v, g, beta, h0, res[2:], kept_m, scale, use_l2, keep_state)


def cp_backward_stage(cp, saved, do):
    """One rank's CP backward (a stage generator): the gradients of q, k, v, g, beta (then None for the rest)."""
    q, k, v, g, beta, h0, (qn, kk, gc, A, w, h, vn, se, table), kept_m, scale, use_l2, keep_state = saved
    dq, dk, dv, dg, db, _ = yield from backward_stage(do, None, q, k, qn, kk, v, g, beta, h0, gc, A, w, h, vn, se,
                                                      table, scale, use_l2, keep_state, False, cp=cp,
                                                      kept_m=kept_m)
    return dq, dk, dv, dg, db, None, None, None


GDN_CP = stage_function(cp_forward_stage, cp_backward_stage)


# ----------------------------------------------------------------------------------------------------------------
def routes(head_k_dim: int = 128, head_v_dim: int = 128):
    """Every kernel specialization a call with these head dims can launch: the launchers above run on meta tensors
    over every flag (L2 norm, initial / final state, kept / recomputed states, wide / narrow state tiles, int32 /
    int64 / no cu_seqlens, context parallelism) and record their launches."""
    K, V = head_k_dim, head_v_dim
    arch = host.route_arch(K, V, HEAD_DIMS)
    H, HV = 2, 4
    meta = dict(device="meta")
    with collect_routes(arch) as rs:
        for n_seq in (1, configs.NARROW_BELOW):  # narrow and wide state tiles
            for cu_dtype in (None,) + host.CU_DTYPES:
                cu, B, Tb, q, v = host.route_operands(n_seq, cu_dtype, H, HV, K, V)
                g = torch.empty(B, Tb, HV, **meta)
                h0 = torch.empty(n_seq, HV, K, V, **meta)
                for use_l2 in (False, True):
                    for init in (None, h0):
                        for final in (False, True):
                            for keep in (False, True):
                                res = gdn_forward(q, q, v, g, g, init, cu, 1.0, final, use_l2, keep)
                                gdn_backward(v, h0 if final else None, q, q, *res[2:4], v, g, g, init, *res[4:], 1.0,
                                             use_l2, keep, final, "det")
        for ctxs in cp_core.route_plans():  # context parallelism's extra passes and its chain kernel
            T = ctxs[0].total_tokens
            q = torch.empty(1, T, H, K, dtype=torch.bfloat16, **meta)
            v = torch.empty(1, T, HV, V, dtype=torch.bfloat16, **meta)
            g = torch.empty(1, T, HV, **meta)
            for keep in (False, True):
                simulate(cp_forward_stage, cp_backward_stage, ctxs, [q, q, v, g, g], args=(1.0, True, keep),
                         grad_out=v)
    return rs.routes
