"""gdn under context parallelism, W simulated ranks in one process through Triton's interpreter: against the FP64
recurrence on the whole stream (fp32 operands: the algebra to fp32 rounding; bf16: the one-process budgets), det
bits on a repeat, and the argument rules of a CP call."""
import importlib

import pytest
import torch

from miles_ext_kernels.cake._runtime import cp as rcp
from miles_ext_kernels.cake._runtime.testing import check_budget, rel_rms

pytestmark = pytest.mark.interpreter

ops = importlib.import_module("miles_ext_kernels.cake._impl.gdn.ops")
demo_mod = importlib.import_module("miles_ext_kernels.cake._impl.gdn.demo")
reference = importlib.import_module("miles_ext_kernels.cake._impl.gdn.reference")
BUDGETS = importlib.import_module("tests.cake.gdn.test_gdn_cpu").BUDGETS_VARLEN

NAMES = ("q", "k", "v", "g", "beta")
# (layout, W, document lengths, state exchanges): documents straddling ranks, a rank inside one document only (no
# boundary: its transition M carries the state through), empty documents, chunk +- 1 pieces, zigzag pieces of 1
# token; waiting pieces (zigzag's default: rank W - 1's; more exchanges: several per document, contiguous too)
CASES = [
    ("contiguous", 2, [15, 70, 50, 1], None),
    ("contiguous", 3, [200, 0, 40], None),       # rank 1 holds the middle of the first document only
    ("contiguous", 4, [63, 65, 64, 64], None),
    ("zigzag", 2, [64, 128, 0, 4], None),        # the 4-token document: four 1-token pieces
    ("zigzag", 3, [132, 66, 6], None),
    ("zigzag", 4, [64, 136], None),              # chunks 3 - 4 (one piece) wait; 1, 2 and 5, 6 run the extra pass
    ("zigzag", 4, [64, 8], 4),                   # chunks 3 - 4, 5 and 6 wait, 1 and 2 run the extra pass
    ("contiguous", 4, [10, 190, 8], 2),          # the later of the second document's two equal middle pieces waits
    ("zigzag", 3, [132, 66, 6], 1),              # no piece waits
]


def _whole(inp, f64=False):
    return [inp[n].double() if f64 else inp[n] for n in NAMES]


def _fp64(inp, l2):
    leaves = [x.double().requires_grad_(True) for x in _whole(inp)]
    o, _ = reference.gdn_reference(*leaves, use_qk_l2norm_in_kernel=l2, cu_seqlens=inp["cu"])
    o.backward(inp["do"].double())
    return o.detach(), [x.grad for x in leaves]


def _cp(inp, layout, W, l2, keep=True, fp32=False, exchanges=None):
    ctxs = rcp.simulated_contexts(inp["cu"], W, layout=layout, state_exchanges=exchanges)
    xs = [x.float() for x in _whole(inp)] if fp32 else _whole(inp)
    do = inp["do"].float() if fp32 else inp["do"]
    K = inp["q"].shape[-1]
    return rcp.simulate(ops.cp_forward_stage, ops.cp_backward_stage, ctxs, xs, args=(K ** -0.5, l2, keep),
                        grad_out=do)


@pytest.mark.parametrize("layout, W, lens, exchanges", CASES)
def test_cp_algebra_exact_in_fp32(layout, W, lens, exchanges):
    """With fp32 operands every output and gradient of the CP pass (local passes, [u | 0] from [0 | I], the fp32
    chain, the reverse chain) matches the FP64 recurrence on the whole stream to fp32 rounding."""
    inp = demo_mod.make_inputs(lens, 1, 2, 16, 32, "cpu", h0=False)
    ro, rg = _fp64(inp, True)
    o, grads = _cp(inp, layout, W, True, keep=(W % 2 == 0), fp32=True, exchanges=exchanges)
    errs = {"o": rel_rms(o, ro)} | {"d" + n: rel_rms(gr, r) for n, gr, r in zip(NAMES, grads, rg)}
    for name, err in errs.items():
        assert err < 5e-6, (name, err, errs)


@pytest.mark.parametrize("layout, W, lens, exchanges", [CASES[0], CASES[3], CASES[5]])
def test_cp_bf16_within_the_one_process_budgets_and_det_bits(layout, W, lens, exchanges):
    """bf16: the CP pass's error against FP64 is within the budgets of the one-process call (each rejecting a 2 %
    error), and a repeat gives the same bits."""
    inp = demo_mod.make_inputs(lens, 1, 2, 32, 32, "cpu", h0=False)
    ro, rg = _fp64(inp, True)
    o, grads = _cp(inp, layout, W, True, exchanges=exchanges)
    check_budget("o", o, ro, BUDGETS["o"])
    for n, gr, r in zip(NAMES, grads, rg):
        check_budget("d" + n, gr, r, BUDGETS["d" + n])
    o2, grads2 = _cp(inp, layout, W, True, exchanges=exchanges)
    assert torch.equal(o, o2)
    for a, b in zip(grads, grads2):
        assert torch.equal(a, b)


@pytest.mark.parametrize("layout, W, lens, exchanges", [CASES[0], CASES[5], CASES[6]])
def test_exchange_buffers_poisoned(monkeypatch, layout, W, lens, exchanges):
    """The exchange's send buffers and the chain's scratch are left unfilled (their padding, and the M columns of a
    true state, are never read): with every torch.empty poisoned with NaN while the CP pass runs, it gives the same
    bits as without (a chain that reads a true state's M columns fails it)."""
    inp = demo_mod.make_inputs(lens, 1, 2, 16, 32, "cpu", h0=False)
    o, grads = _cp(inp, layout, W, True, exchanges=exchanges)
    core = importlib.import_module("miles_ext_kernels.cake._impl.delta_rule.cp")
    empty = torch.empty
    made = []

    def poisoned(*args, **kw):
        x = empty(*args, **kw)
        made.append(x.shape)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(core.torch, "empty", poisoned)
    o2, grads2 = _cp(inp, layout, W, True, exchanges=exchanges)
    monkeypatch.undo()
    assert made, "no buffer was poisoned"
    assert torch.equal(o, o2)
    for a, b in zip(grads, grads2):
        assert torch.equal(a, b)

def test_forward_keeps_only_the_transitions_its_backward_reads():
    """The forward saves for the backward the K x K transitions of the pieces its chains fold (zigzag W = 4, a
    document in pieces 0 - 6, piece 3 waiting: at most two per document), not the gathered buffers (W times a rank's
    sends per exchange)."""
    inp = demo_mod.make_inputs([64, 136], 1, 2, 16, 32, "cpu", h0=False)
    ctxs = rcp.simulated_contexts(inp["cu"], 4, layout="zigzag")
    K = inp["q"].shape[-1]
    fw = rcp.run_simulated([ops.cp_forward_stage(c, *[rcp.shard(x, c) for x in _whole(inp)], K ** -0.5, True, True)
                            for c in ctxs])
    for c, (_, saved) in zip(ctxs, fw):
        kept_m = saved[7]
        want = sum(c.state_round(k)["keep"].numel() for k in range(1, c.state_exchanges + 1))
        assert tuple(kept_m.shape) == (want, 2, K, K)
        gathered_rows = c.world * sum(c.max_fwd_send)
        assert want <= 2 * 2 < gathered_rows  # two documents
    # per document: piece 0 (rank 0) folds 3, 2, 1 (M of 2 and 1); piece 1 (rank 1) folds 3, 2; piece 4 (rank 2)
    # folds 6, 5; piece 3 (rank 3) folds 6, 5, 4; pieces 2 and 5 fold a true gradient only
    assert [r[1][7].shape[0] for r in fw] == [4, 2, 2, 4]

def test_plan_pieces_and_tables():
    """The plan's pieces tile every document in order; a contiguous rank inside one document exports and imports
    through its transition; zigzag gives each rank chunks r and 2W - 1 - r, rank W - 1's two as one piece."""
    pieces, T = rcp.plan([0, 200, 200, 240], 3, "contiguous")
    assert T == 240
    assert [(p.doc, p.start, p.end) for p in pieces[1]] == [(0, 80, 160)]
    assert pieces[1][0].imports and pieces[1][0].exports
    ranks = rcp.simulated_contexts([0, 200, 200, 240], 3)
    ctx = ranks[2]
    assert ctx.cu_seqlens.tolist() == [0, 40, 80]
    assert ctx.state_exchanges == 1
    # piece (doc 0, [160, 200)) folds pieces [0, 80) then [80, 160): slots of rank 0 then rank 1 (one per rank);
    # the document's first piece brings E only (no M: the state before it is zero)
    t = ctx.state_round(1)
    assert t["chain"].tolist() == [[[0, -1], [1, 1]]] and t["dest"].tolist() == [0]
    # E: rank 0's piece (a document's first) from its own pass, rank 1's (E and M) from the extra state pass
    t0, t1 = ranks[0].state_round(1), ranks[1].state_round(1)
    assert (t0["own_segs"].tolist(), t0["extra_segs"].tolist()) == ([0], [])
    assert (t1["own_segs"].tolist(), t1["extra_segs"].tolist()) == ([], [0])
    # the backward's D: rank 1's piece from the extra reverse pass, rank 2's (the document's last) from its own pass;
    # rank 0's piece folds rank 2's D (no M) then rank 1's with rank 1's M (forward slot 1, the one M rank 0 keeps)
    g0, g1, g2 = (r.grad_round(1) for r in ranks)
    assert [r.state_round(1)["keep"].tolist() for r in ranks] == [[1], [], []]
    assert (g1["own_segs"].tolist(), g1["extra_segs"].tolist()) == ([], [0])
    assert (g2["own_segs"].tolist(), g2["extra_segs"].tolist()) == ([0], [])
    assert g0["chain"].tolist() == [[[2, -1], [1, 0]]]
    assert g2["chain"].shape[0] == 0 and g2["dest"].numel() == 0
    zz, _ = rcp.plan([0, 8], 2, "zigzag")
    assert [(p.start, p.end) for p in zz[0]] == [(0, 2), (6, 8)]
    assert [(p.start, p.end) for p in zz[1]] == [(2, 6)]
    with pytest.raises(ValueError, match="multiple of the CP size"):
        rcp.plan([0, 7], 2, "contiguous")
    with pytest.raises(ValueError, match="multiple of 2 x CP size"):
        rcp.plan([0, 8, 14], 2, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        rcp.plan([0, 8], 2, "ring")
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="state_exchanges"):
            rcp.plan([0, 8], 2, "zigzag", bad)


def test_plan_waiting_pieces():
    """Zigzag W = 4 (a document in pieces 0, 1, 2, [3, 4], 5, 6, 7 of 8 chunks): by default rank 3's merged piece waits
    for its true state, so the forward's first exchange carries piece 0's E and pieces 1 - 2's (E, M), the second the
    merged piece's E and pieces 5 - 6's (E, M); with 4 exchanges pieces 5 and 6 wait as well. The backward mirrors
    it. W = 2: no extra pass is left."""
    ranks = rcp.simulated_contexts([0, 64], 4, layout="zigzag")
    assert [len(r.pieces) for r in ranks] == [2, 2, 2, 1] and ranks[3].pieces[0].waits
    assert ranks[0].state_exchanges == 2
    sends = [[(p.start // 8, p.fwd_send, p.bwd_send) for p in r.pieces] for r in ranks]
    assert sends == [[(0, 1, 0), (7, 0, 1)], [(1, 1, 2), (6, 2, 1)], [(2, 1, 2), (5, 2, 1)], [(3, 2, 2)]]
    own = [[r.state_round(k)["own_segs"].tolist() for k in (1, 2)] for r in ranks]
    extra = [[r.state_round(k)["extra_segs"].tolist() for k in (1, 2)] for r in ranks]
    assert own == [[[0], []], [[], []], [[], []], [[], [0]]]
    assert extra == [[[], []], [[0], [1]], [[0], [1]], [[], []]]
    # the merged piece's incoming state after exchange 1: pieces 0, 1, 2 (ranks 0, 1, 2); the last piece's after
    # exchange 2: the merged piece (rank 3, no M), then pieces 5 (rank 2) and 6 (rank 1)
    assert ranks[3].state_round(1)["chain"].tolist() == [[[0, -1], [1, 1], [2, 2]]]
    assert ranks[0].state_round(2)["chain"].tolist() == [[[3, -1], [2, 2], [1, 1]]]
    # backward, exchange 1: the merged piece's end gradient from pieces 7 (D only), 6, 5 with their M from the
    # forward's second exchange (flat slots 1 and 2 there), the only rows rank 3 keeps
    assert [ranks[3].state_round(k)["keep"].tolist() for k in (1, 2)] == [[], [1, 2]]
    assert ranks[3].grad_round(1)["chain"].tolist() == [[[0, -1], [1, 0], [2, 1]]]
    w4 = rcp.simulated_contexts([0, 64], 4, layout="zigzag", state_exchanges=4)
    assert w4[0].state_exchanges == 4
    assert [p.start // 8 for r in w4 for p in r.pieces if p.waits] == [6, 5, 3]
    assert [p.start // 8 for r in w4 for p in r.pieces
            if p.imports and p.exports and not p.waits] == [1, 2]
    w2 = rcp.simulated_contexts([0, 64], 2, layout="zigzag")
    assert all(r.state_round(k)["extra_segs"].numel() == 0 and r.grad_round(k)["extra_segs"].numel() == 0
               for r in w2 for k in (1, 2))
    one = rcp.simulated_contexts([0, 64], 4, layout="zigzag", state_exchanges=1)
    assert one[0].state_exchanges == 1 and not any(p.waits for r in one for p in r.pieces)


def test_cp_call_argument_rules():
    """cp_context combined with cu_seqlens, an initial state or the final state, a foreign object, or tensors that
    are not the rank's tokens: ValueError / TypeError before any launch."""
    inp = demo_mod.make_inputs([64], 1, 2, 16, 16, "cpu", h0=False)
    ctx = rcp.simulated_contexts(inp["cu"], 2)[0]
    x = [rcp.shard(t, ctx) for t in _whole(inp)]
    from miles_ext_kernels.cake import gdn
    with pytest.raises(ValueError, match="not both"):
        gdn.chunk_gated_delta_rule(*x, cu_seqlens=ctx.cu_seqlens, cp_context=ctx)
    with pytest.raises(ValueError, match="output_final_state"):
        gdn.chunk_gated_delta_rule(*x, output_final_state=True, cp_context=ctx)
    with pytest.raises(TypeError, match="build_cp_context"):
        gdn.chunk_gated_delta_rule(*x, cp_context=object())
    with pytest.raises(ValueError, match="rank's tokens"):
        gdn.chunk_gated_delta_rule(*_whole(inp), cp_context=ctx)
