"""Context parallelism of the chunked delta rule (gdn, kda): the state exchange both ops run inside their forward
and backward (see `_runtime/cp.py` for the plan and the stage protocol).

Forward, per rank: a piece in a document's middle either runs the op's state recurrence once more, from [0 | I]
with [u | 0] (V + K value columns; the kernel reads the zeros, nothing is stored but the final states), or waits
for its true incoming state (`CPContext.state_exchanges` - 1 pieces per document at most, chosen by the plan). The
delta rule's state is column-independent in V, so the first V columns of the extra pass end in E, the state from a
zero start, and the last K in M, the piece's K x K transition. A document's first piece and a waiting piece send
their true final state (E, no M) from their own pass. Exchange k (an all_gather of [max_fwd_send[k], HV, K, V + K]
fp32) carries the true state of the (k - 1)-th waiting piece (the first piece for k = 1) and the (E, M) of the
pieces up to the next waiting one; each piece whose incoming state it completes folds S <- M S + E over them in fp32
and a fixed order (one launch per exchange). A waiting piece runs its own pass between exchanges; the rest run it after
the last exchange, with S as their initial state.
Backward, per rank, the mirror image: after the in-chunk d(dlt), D is the gradient a piece's start state gets from
a zero end gradient (the extra reverse pass) or the true one (a document's last piece, whose end gradient is zero,
and a waiting piece, from the gradient the exchanges so far gave its end); exchange k (an all_gather of
[max_bwd_send[k], HV, K, V] fp32) carries them; each piece whose end gradient it completes folds G <- M^T G + D
over the later pieces (M: the rows of the forward's gathered buffers the rank kept for it), then the op's reverse
recurrence with G as the piece's final-state gradient. Per exchange a rank sends 4 HV K (V + K) bytes per piece it
sends forward and 4 HV K V backward (padded to the plan's maximum over ranks; it receives W times that), whatever T.
The forward keeps for the backward only the M its chains read (K x K per piece), not the gathered buffers.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from miles_ext_kernels.cake._runtime.launch import launch

CHAIN_COLS = 32  # state columns per program of a chain: a column block of S folds independently of the others
CHAIN_ROWS = 32  # rows of S per product of a chain step (its M operand is K x CHAIN_ROWS)


@triton.jit(do_not_specialize=["L", "HV", "ldE", "ldM"])
def chain_kernel(E, M, table, dest, out, work, L, HV, ldE, ldM, K: tl.constexpr, V: tl.constexpr, BC: tl.constexpr,
                 KB: tl.constexpr, TRANS: tl.constexpr):
    """The chains of `table` ([n, L, 2] (E slot, M slot)) into out[dest[i]]: from S = 0, per step S <- op(M[m]) S +
    E[e] (m = -1: no transition, S <- S + E; e = -1, padding: S unchanged); op = transpose under TRANS. Columns of S
    fold independently, so one program runs all L steps of a K x BC column block of S [n, HV, K, V]; S goes through
    `work` (its own block, [n, HV, K, V] fp32) between steps, read back KB rows at a time for the products. fp32
    products over K in a fixed order. E [F, HV, K, ldE], M [F, HV, K, ldM] (first V / K columns read)."""
    i = tl.program_id(0)
    hv = tl.program_id(1)
    o_k = tl.arange(0, K)
    o_kb = tl.arange(0, KB)
    o_c = tl.program_id(2) * BC + tl.arange(0, BC)
    blk = work + (i * HV + hv).to(tl.int64) * (K * V)
    s = tl.zeros([K, BC], dtype=tl.float32)
    for step in range(L):
        e = tl.load(table + (i * L + step) * 2)
        m = tl.load(table + (i * L + step) * 2 + 1)
        if e >= 0:
            if m >= 0:
                base = M + (m * HV + hv).to(tl.int64) * K * ldM
                acc = tl.zeros([K, BC], dtype=tl.float32)
                for kb in tl.static_range(0, K, KB):
                    if TRANS:
                        b_m = tl.load(base + (kb + o_kb)[None, :] * ldM + o_k[:, None])
                    else:
                        b_m = tl.load(base + o_k[:, None] * ldM + (kb + o_kb)[None, :])
                    b_s = tl.load(blk + (kb + o_kb)[:, None] * V + o_c[None, :])
                    acc += tl.dot(b_m, b_s, input_precision="ieee")
                s = acc
                tl.debug_barrier()  # every thread has read S before any overwrites it
            s += tl.load(E + (e * HV + hv).to(tl.int64) * K * ldE + o_k[:, None] * ldE + o_c[None, :])
            tl.store(blk + o_k[:, None] * V + o_c[None, :], s)
            tl.debug_barrier()  # the block's S is written before the next step reads its rows
    d = tl.load(dest + i)
    tl.store(out + (d * HV + hv).to(tl.int64) * (K * V) + o_k[:, None] * V + o_c[None, :], s)


def chain(E: torch.Tensor, M: torch.Tensor, table: torch.Tensor, dest: torch.Tensor, out: torch.Tensor, V: int,
          trans: bool) -> None:
    """Fold `table` ([n, L, 2] (E slot, M slot)) into out[dest] ([N, HV, K, V] fp32) from S = 0, one launch
    (L <= 2W - 1 steps per program). E / M: gathered buffers viewed [F, HV, K, ld] (M already offset to its first
    column)."""
    n, L = table.shape[0], table.shape[1]
    if n == 0:
        return
    HV, K = out.shape[1], out.shape[2]
    bc, kb = min(CHAIN_COLS, V), min(CHAIN_ROWS, K)
    work = torch.empty(n, HV, K, V, dtype=torch.float32, device=out.device)
    launch(chain_kernel, (n, HV, V // bc), E=E, M=M, table=table, dest=dest, out=out, work=work, L=L, HV=HV,
           ldE=E.stride(2), ldM=M.stride(2), K=K, V=V, BC=bc, KB=kb, TRANS=trans, num_warps=8)


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
    """Stage generator (forward), one yield per state exchange: yields this rank's [max_fwd_send[k], HV, K, V + K]
    buffer, receives the gathered one; returns (h0 [N, HV, K, V] fp32 or None when no piece imports, kept_m
    [F, HV, K, K] fp32: the transitions M the backward's chains read (`state_round`'s "keep" rows of each gathered
    buffer, in exchange order; not the whole buffers, which hold W times a rank's sends), se_own: the sequence table
    of the op's recurrence after the last exchange). run_state(se_rows, u_ext, h0_ext, V_ext, own) runs the op's
    state recurrence over the given sequences (u's V columns, then zeros) and returns their final states
    [n, HV, K, V_ext] fp32; with `own` (V columns) it is those sequences' own pass (per-chunk states and dlt stored).
    Before exchange k a piece that sends a true final state runs its own pass (a document's first piece from a zero
    state before the first exchange, its M would multiply a zero state; a waiting piece from the incoming state the
    exchanges so far gave it) and the pieces that send (E, M) run the extra pass; after it, the pieces whose incoming
    state it completes fold their chains. The recurrence after the last exchange skips the pieces that ran their own
    pass (their rows of se_own empty)."""
    device = u.device
    VX = V + K
    h0 = None
    if cp.n_import:
        h0 = torch.zeros(se.shape[0], HV, K, V, dtype=torch.float32, device=device)
    se_own = se
    kept = []
    for k in range(1, cp.state_exchanges + 1):
        t = cp.state_round(k)
        # slots past the rank's sends and the M columns of a true state are padding no chain reads
        buf = torch.empty(cp.max_fwd_send[k - 1], HV, K, VX, dtype=torch.float32, device=device)
        if t["own_segs"].numel():
            only, se_own = _split_rows(se_own, t["own_segs"])
            ends = run_state(only, u, h0 if k > 1 else None, V, True)
            buf[t["own_pos"], :, :, :V] = ends.index_select(0, t["own_segs"])
        if t["extra_segs"].numel():  # pieces that import and export: E and M, u's V columns then K columns of 0
            n = t["extra_segs"].numel()
            h0_x = torch.zeros(n, HV, K, VX, dtype=torch.float32, device=device)
            h0_x[..., V:] = torch.eye(K, dtype=torch.float32, device=device)
            buf[t["extra_pos"]] = run_state(se.index_select(0, t["extra_segs"]), u, h0_x, VX, False)
        gathered = (yield buf).view(-1, HV, K, VX)
        if t["keep"].numel():
            kept.append(gathered[..., V:].index_select(0, t["keep"]))
        chain(gathered, gathered[..., V:], t["chain"], t["dest"], h0, V, trans=False)
    kept_m = kept[0] if len(kept) == 1 else (torch.cat(kept) if kept else
                                               torch.empty(0, HV, K, K, dtype=torch.float32, device=device))
    return h0, kept_m, se_own


def outgoing_grads(cp, se: torch.Tensor, kept_m: torch.Tensor, HV: int, K: int, V: int, run_dh):
    """Stage generator (backward), the mirror of `incoming_states`: per state exchange it yields this rank's
    [max_bwd_send[k], HV, K, V] buffer of D, receives the gathered one; returns (dht [N, HV, K, V] fp32, None when
    no piece exports; se_own, the sequence table of the op's reverse pass after the last exchange). run_dh(se_rows,
    dht_rows, own) runs the op's reverse recurrence over the given sequences from the given end-state gradients
    (None: zero) and returns the gradients of their start states [n, HV, K, V] fp32; with `own` it is those
    sequences' own pass (its per-chunk outputs stored). A document's last piece (zero end gradient) and a waiting
    piece (its end gradient from the exchanges so far) run their own pass before the exchange that carries their D;
    the pass after the last exchange skips them (their rows of se_own empty). M comes from `kept_m`, the rows the
    forward kept."""
    device = kept_m.device
    dht = None
    if cp.n_export:
        dht = torch.zeros(se.shape[0], HV, K, V, dtype=torch.float32, device=device)
    se_own = se
    for k in range(1, cp.state_exchanges + 1):
        t = cp.grad_round(k)
        buf = torch.empty(cp.max_bwd_send[k - 1], HV, K, V, dtype=torch.float32, device=device)
        if t["own_segs"].numel():
            only, se_own = _split_rows(se_own, t["own_segs"])
            buf[t["own_pos"]] = run_dh(only, dht if k > 1 else None, True).index_select(0, t["own_segs"])
        if t["extra_segs"].numel():
            buf[t["extra_pos"]] = run_dh(se.index_select(0, t["extra_segs"]), None, False)
        gathered = (yield buf).view(-1, HV, K, V)
        chain(gathered, kept_m, t["chain"], t["dest"], dht, V, trans=True)
    return dht, se_own


def route_plans(device="meta") -> list:
    """CP plans whose simulated ranks launch every CP specialization (an op's routes() runs them on meta tensors):
    one document over three ranks (a first, a middle and a last piece: the narrow state tiles), and 40 documents in
    zigzag over three ranks (the wide ones: first, middle, waiting and last pieces)."""
    from miles_ext_kernels.cake._runtime.cp import simulated_contexts

    return [simulated_contexts([0, 192], 3, device=device),
            simulated_contexts(list(range(0, 6 * 41, 6)), 3, layout="zigzag", device=device)]


def drive(stage):
    """The result of a stage generator that must not communicate (no CP context)."""
    try:
        next(stage)
    except StopIteration as done:
        return done.value
    raise RuntimeError("a delta-rule pass without a CP context tried to communicate")

