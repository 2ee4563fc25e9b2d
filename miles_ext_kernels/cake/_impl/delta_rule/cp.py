"""Context parallelism of the chunked delta rule (gdn, kda): the state exchange both ops run inside their forward
and backward (see `_runtime/cp.py` for the plan and the stage protocol).

Forward, per rank: the pieces that export run the op's state recurrence once more, from [0 | I] with [u | 0] (V + K
value columns; the kernel reads the zeros, nothing is stored but the final states). The delta rule's state is
column-independent in V, so the first V columns end in E, the state from a zero start, and the last K in M, the
piece's K x K transition (a document's first piece takes E from its own pass, run before the exchange: it starts
from a zero state, and its M would multiply one, so the state chain has none for it) -> one all_gather of
[max_export, HV, K, V + K] fp32 -> each importing piece folds its document's earlier pieces, S <- M S + E, in fp32
and a fixed order (one launch per step) -> the op's own recurrence and output with S as the piece's initial state.
Backward, per rank: after the in-chunk d(dlt), the pieces that import run the reverse recurrence from a zero end
gradient: D, the gradient their start state gets (a document's last piece in its own pass, whose end gradient is
zero; the others in an extra pass) -> one all_gather of [max_import, HV, K, V] fp32 -> each exporting
piece folds its document's later pieces from the last back, G <- M^T G + D -> the op's reverse recurrence with G
as the piece's final-state gradient. A rank sends 4 HV K (V + K) bytes per exporting piece forward and
4 HV K V per importing piece backward (padded to the plan's maximum over ranks; it receives W times that),
whatever T.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_ext_kernels.cake._runtime.launch import launch

CHAIN_BLOCK = 32  # output rows and columns per program of a chain step


@triton.jit(do_not_specialize=["step", "L", "HV", "ldE", "ldM"])
def chain_step_kernel(E, M, table, S_in, S_out, step, L, HV, ldE, ldM, K: tl.constexpr, V: tl.constexpr,
                      BR: tl.constexpr, BC: tl.constexpr, TRANS: tl.constexpr):
    """One step of the chains of `table` ([n, L, 2] (E slot, M slot)): S_out[i] = op(M[m]) S_in[i] + E[e] (m = -1: no
    transition; e = -1, padding: S_out[i] = S_in[i]); op = transpose under TRANS. A BR x BC block of S [n, HV, K, V]
    per program, fp32 products over K in a fixed order. E [F, HV, K, ldE], M [F, HV, K, ldM] (first V / K columns
    read)."""
    i = tl.program_id(0)
    hv = tl.program_id(1)
    nc = V // BC
    ir = tl.program_id(2) // nc
    ic = tl.program_id(2) % nc
    o_r = ir * BR + tl.arange(0, BR)
    o_c = ic * BC + tl.arange(0, BC)
    o_k = tl.arange(0, K)
    e = tl.load(table + (i * L + step) * 2)
    m = tl.load(table + (i * L + step) * 2 + 1)
    st = (i * HV + hv).to(tl.int64) * (K * V)
    out = tl.load(S_in + st + o_r[:, None] * V + o_c[None, :])
    if e >= 0:
        if m >= 0:
            base = M + (m * HV + hv) * K * ldM
            if TRANS:
                b_m = tl.load(base + o_k[None, :] * ldM + o_r[:, None])
            else:
                b_m = tl.load(base + o_r[:, None] * ldM + o_k[None, :])
            b_s = tl.load(S_in + st + o_k[:, None] * V + o_c[None, :])
            out = tl.dot(b_m, b_s, input_precision="ieee")
        out += tl.load(E + (e * HV + hv) * K * ldE + o_r[:, None] * ldE + o_c[None, :])
    tl.store(S_out + st + o_r[:, None] * V + o_c[None, :], out)


def chain(E: torch.Tensor, M: torch.Tensor, table: torch.Tensor, dest: torch.Tensor, out: torch.Tensor, V: int,
          trans: bool) -> None:
    """Fold `table` ([n, L, 2] (E slot, M slot)) into out[dest] ([N, HV, K, V] fp32) from S = 0: one launch per
    step (a step's blocks need the whole previous S), L <= 2W - 1. E / M: gathered buffers viewed [F, HV, K, ld]
    (M already offset to its first column)."""
    n, L = table.shape[0], table.shape[1]
    HV, K = out.shape[1], out.shape[2]
    if n == 0:
        return
    br, bc = min(CHAIN_BLOCK, K), min(CHAIN_BLOCK, V)
    cur = torch.zeros(n, HV, K, V, dtype=torch.float32, device=out.device)
    nxt = torch.empty_like(cur)
    for step in range(L):
        launch(chain_step_kernel, (n, HV, (K // br) * (V // bc)), E=E, M=M, table=table, S_in=cur, S_out=nxt,
               step=step, L=L, HV=HV, ldE=E.stride(2), ldM=M.stride(2), K=K, V=V, BR=br, BC=bc, TRANS=trans,
               num_warps=4)
        cur, nxt = nxt, cur
    out.index_copy_(0, dest, cur)


def _split_rows(se: torch.Tensor, rows: torch.Tensor) -> tuple:
    """(se with only `rows` kept, se with `rows` emptied): a row is emptied by eos = bos, not dropped, since the
    kernels place a sequence's chunks by its row index."""
    only = se.clone()
    only[:, 1] = se[:, 0]
    only[rows] = se[rows]
    rest = se.clone()
    rest[rows, 1] = se[rows, 0]
    return only, rest


def incoming_states(cp, se: torch.Tensor, u: torch.Tensor, HV: int, K: int, V: int, run_state):
    """Stage generator (forward): yields this rank's [max_export, HV, K, V + K] buffer, receives the gathered one;
    returns (h0 [N, HV, K, V] fp32 or None when no piece imports, gathered, se_own: the sequence table of the op's
    recurrence after the exchange). run_state(se_rows, u_ext, h0_ext, V_ext, own) runs the op's state recurrence over
    the given sequences (u's V columns, then zeros) and returns their final states [n, HV, K, V_ext] fp32; with `own`
    (V columns from a zero state) it is those sequences' own pass (per-chunk states and dlt stored). A document's
    first piece starts from a zero state, so its own pass, run here, gives its E (its M would multiply a zero state:
    the state chain has none for it); the recurrence after the exchange skips it (its row of se_own empty)."""
    device = u.device
    VX = V + K
    buf = torch.zeros(cp.max_export, HV, K, VX, dtype=torch.float32, device=device)
    pos_both, seg_both, pos_first, seg_first = cp.export_split()
    se_own = se
    if seg_first.numel():
        only_first, se_own = _split_rows(se, seg_first)
        buf[pos_first, :, :, :V] = run_state(only_first, u, None, V, True).index_select(0, seg_first)
    if seg_both.numel():  # pieces that import and export: E and M, u's V columns then K columns of 0
        h0_x = torch.zeros(seg_both.numel(), HV, K, VX, dtype=torch.float32, device=device)
        h0_x[..., V:] = torch.eye(K, dtype=torch.float32, device=device)
        buf[pos_both] = run_state(se.index_select(0, seg_both), u, h0_x, VX, False)
    gathered = yield buf
    gathered = gathered.view(-1, HV, K, VX)
    h0 = None
    if cp.n_import:
        h0 = torch.zeros(se.shape[0], HV, K, V, dtype=torch.float32, device=device)
        chain(gathered, gathered[..., V:], cp.state_chain(), cp.import_segs, h0, V, trans=False)
    return h0, gathered, se_own


def outgoing_grads(cp, se: torch.Tensor, gathered_fwd: torch.Tensor, HV: int, K: int, V: int, run_dh):
    """Stage generator (backward): yields this rank's [max_import, HV, K, V] buffer of D, receives the gathered one;
    returns (dht [N, HV, K, V] fp32, None when no piece exports; se_own, the sequence table of the op's reverse pass
    after the exchange). run_dh(se_rows, own) runs the op's reverse recurrence from a zero end gradient over the
    given sequences and returns the gradients of their start states [n, HV, K, V] fp32; with `own` it is those
    sequences' own pass (its per-chunk outputs stored). A document's last piece exports nothing, so its end gradient
    is zero and its own pass, run here, gives its D; the pass after the exchange skips it (its row of se_own empty)."""
    device = gathered_fwd.device
    buf = torch.zeros(cp.max_import, HV, K, V, dtype=torch.float32, device=device)
    pos_both, seg_both, pos_last, seg_last = cp.import_split()
    se_own = se
    if seg_last.numel():
        only_last, se_own = _split_rows(se, seg_last)
        buf[pos_last] = run_dh(only_last, True).index_select(0, seg_last)
    if seg_both.numel():
        buf[pos_both] = run_dh(se.index_select(0, seg_both), False)
    gathered = (yield buf).view(-1, HV, K, V)
    if not cp.n_export:
        return None, se_own
    dht = torch.zeros(se.shape[0], HV, K, V, dtype=torch.float32, device=device)
    chain(gathered, gathered_fwd[..., V:], cp.grad_chain(), cp.export_segs, dht, V, trans=True)
    return dht, se_own


def route_plans(device="meta") -> list:
    """CP plans whose simulated ranks launch every CP specialization (an op's routes() runs them on meta tensors):
    one document over three ranks (a first, a middle and a last piece: the narrow state tiles), and 40 pieces per
    rank (the wide ones; zigzag gives both first and middle pieces)."""
    from miles_ext_kernels.cake._runtime.cp import simulated_contexts

    return [simulated_contexts([0, 192], 3, device=device),
            simulated_contexts(list(range(0, 4 * 41, 4)), 2, layout="zigzag", device=device)]


def drive(stage):
    """The result of a stage generator that must not communicate (no CP context)."""
    try:
        next(stage)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a delta-rule pass without a CP context tried to communicate")

