"""kda under context parallelism, W simulated ranks in one process through Triton's interpreter: against the FP64
recurrence on the whole stream (fp32 operands: the algebra to fp32 rounding; bf16: the one-process budgets), the
gate parameters' gradients as the sum of the ranks' partials, det bits on a repeat, the argument rules."""
import importlib

import pytest
import torch

from miles_ext_kernels.cake._runtime import cp as rcp

pytestmark = pytest.mark.interpreter

ops = importlib.import_module("miles_ext_kernels.cake._impl.kda.ops")
demo_mod = importlib.import_module("miles_ext_kernels.cake._impl.kda.demo")
kda_cpu = importlib.import_module("tests.cake.kda.test_kda_cpu")

NAMES = ("q", "k", "v", "g", "beta")
CASES = [  # (layout, W, document lengths, gate, state exchanges)
    ("contiguous", 3, [200, 0, 40], "safe", None),  # rank 1 inside one document: its K x K transition carries the state
    ("contiguous", 2, [63, 65], "pre", None),
    ("zigzag", 2, [64, 128, 4], "softplus", None),   # the 4-token document: four 1-token pieces
    ("zigzag", 4, [64, 136], "safe", None),          # chunks 3 - 4 (one piece) wait; 1, 2 and 5, 6: extra passes
    ("contiguous", 4, [10, 190, 8], "pre", 3),       # both middle pieces of the second document wait
]


def _cp(inp, layout, W, l2, fp32=False, exchanges=None):
    f = {n: (x.float() if fp32 and isinstance(x, torch.Tensor) and x.is_floating_point() and n != "cu" else x)
         for n, x in inp.items()}
    ctxs = rcp.simulated_contexts(inp["cu"], W, layout=layout, state_exchanges=exchanges)
    gate = ops.gate_kind(inp["gate"] != "pre", inp["lower_bound"])
    lb = float(inp["lower_bound"] or 0.0)
    K = inp["q"].shape[-1]
    params = [f["A_log"], f["dt_bias"]] if gate else [None, None]
    o, grads = rcp.simulate(ops.cp_forward_stage, ops.cp_backward_stage, ctxs, [f[n] for n in NAMES], params=params,
                            args=(K ** -0.5, lb, gate, l2), grad_out=f["do"])
    out = {"o": o} | {"d" + n: gr for n, gr in zip(NAMES + ("A_log", "dt_bias"), grads) if gr is not None}
    return out


def _ref(inp, l2):
    ref = demo_mod.run_reference(dict(inp, h0=None), l2=l2, final=False)
    return ref


@pytest.mark.parametrize("layout, W, lens, gate, exchanges", CASES)
def test_cp_algebra_exact_in_fp32(layout, W, lens, gate, exchanges):
    """fp32 operands: every output and gradient of the CP pass matches the FP64 recurrence on the whole stream to
    fp32 rounding (dA_log / ddt_bias: the ranks' partials summed, as the caller's all-reduce does)."""
    inp = demo_mod.make_inputs(lens, 1, 2, 16, 32, "cpu", h0=False, gate=gate)
    ref = _ref({n: (x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x)
                for n, x in inp.items()}, True)
    ours = _cp(inp, layout, W, True, fp32=True, exchanges=exchanges)
    errs = {n: demo_mod.error(n, ours[n], ref) for n in ours}
    assert set(errs) == {n for n in ref if not n.startswith("rss_")}
    kda_cpu._exact(errs)


def test_cp_bf16_within_the_one_process_budgets_and_det_bits():
    """bf16, the safe gate (Kimi-K3's), zigzag over 2 ranks: within the one-process budgets, bits repeat."""
    inp = demo_mod.make_inputs([64, 128, 0, 4], 1, 2, 32, 32, "cpu", h0=False, gate="safe")
    ref = _ref(inp, True)
    ours = _cp(inp, "zigzag", 2, True)
    budgets = kda_cpu.BUDGETS["safe"]
    for n in ours:
        demo_mod.check_budget(n, ours[n], ref, budgets[n])
    again = _cp(inp, "zigzag", 2, True)
    for n in ours:
        assert torch.equal(ours[n], again[n]), n


@pytest.mark.parametrize("case", [CASES[0], CASES[3]])
def test_exchange_buffers_poisoned(case, monkeypatch):
    """Every torch.empty poisoned with NaN while the CP pass runs (the unfilled send buffers and chain scratch
    included): the same bits as without, for every output and gradient."""
    layout, W, lens, gate, exchanges = case
    inp = demo_mod.make_inputs(lens, 1, 2, 16, 32, "cpu", h0=False, gate=gate)
    ours = _cp(inp, layout, W, True, exchanges=exchanges)
    empty = torch.empty

    def poisoned(*args, **kw):
        x = empty(*args, **kw)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", poisoned)
    again = _cp(inp, layout, W, True, exchanges=exchanges)
    monkeypatch.undo()
    for n in ours:
        assert torch.equal(ours[n], again[n]), n

@pytest.mark.parametrize("layout, W, lens, gate", [
    ("contiguous", 3, [200, 0, 40], "safe"),
    ("zigzag", 2, [64, 128, 4], "softplus"),
    ("contiguous", 4, [10, 190, 8], "pre"),  # two middle pieces: several extra passes on one rank
])
def test_cp_decayed_route_gives_the_plain_routes_bits(layout, W, lens, gate, monkeypatch):
    """Under CP every state pass (the pieces' own and the extra passes of pieces that import and export, forward and
    reverse) reads the DECAYED operands where its entry says so (the narrow entries, shipped; V = 64 so that every
    pass takes them): the same bits as forming them on the chain, for every output and gradient."""
    configs = importlib.import_module("miles_ext_kernels.cake._impl.kda.configs")
    assert all(configs.CFG[n].get("DECAYED") for n in ("h_narrow", "dh_narrow"))
    inp = demo_mod.make_inputs(lens, 1, 2, 32, 64, "cpu", h0=False, gate=gate, seed=5)
    launched, passes = [], []
    real_operands, real_launch = ops._decayed_operands, ops.launch
    monkeypatch.setattr(ops, "_decayed_operands", lambda *a, **kw: launched.append((a[-1], kw.get("own")))
                        or real_operands(*a, **kw))
    monkeypatch.setattr(ops, "launch", lambda kernel, grid, **kw: passes.append((kernel.fn.__name__, kw.get(
        "DECAYED"))) or real_launch(kernel, grid, **kw))
    decayed = _cp(inp, layout, W, True)
    # the operands once per rank and stage (kd forward, kd and qg backward), in buffers of their own
    assert sorted(set(launched)) == [(False, True), (True, True)] and len(launched) == 2 * W
    states = [d for name, d in passes if name in ("fwd_h_kernel", "bwd_dh_kernel")]
    assert len(states) > 2 * W and all(states)  # more passes than ranks x stages: the extra ones, all DECAYED
    for n in ("h_narrow", "dh_narrow"):
        monkeypatch.setitem(configs.CFG, n, dict(configs.CFG[n], DECAYED=False))
    plain = _cp(inp, layout, W, True)
    assert set(decayed) == set(plain)
    for n in plain:
        assert torch.equal(decayed[n], plain[n]), n


def test_cp_call_argument_rules():
    inp = demo_mod.make_inputs([64], 1, 2, 16, 16, "cpu", h0=False)
    ctx = rcp.simulated_contexts(inp["cu"], 2)[0]
    x = [rcp.shard(inp[n], ctx) for n in NAMES]
    from miles_ext_kernels.cake import kda
    with pytest.raises(ValueError, match="not both"):
        kda.chunk_kda(*x, cu_seqlens=ctx.cu_seqlens, cp_context=ctx)
    with pytest.raises(ValueError, match="initial_state"):
        kda.chunk_kda(*x, initial_state=torch.zeros(1, 2, 16, 16), cp_context=ctx)
    with pytest.raises(TypeError, match="build_cp_context"):
        kda.chunk_kda(*x, cp_context="ctx")
