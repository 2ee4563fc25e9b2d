"""kda through Triton's interpreter on tiny shapes, against the FP64 per-token recurrence (_impl/kda/reference.py)."""
import importlib

import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels.cake import kda
from tests.cake._delta_rule import assert_nonfinite_as_in_demo_reference, assert_views_read_in_place, checkpointed
from tests.cake._helpers import record_cu_seqlens_checks

pytestmark = pytest.mark.interpreter

demo_mod = importlib.import_module("miles_ext_kernels.cake._impl.kda.demo")
ops = importlib.import_module("miles_ext_kernels.cake._impl.kda.ops")
configs = importlib.import_module("miles_ext_kernels.cake._impl.kda.configs")
kernels = importlib.import_module("miles_ext_kernels.cake._impl.kda.kernels")

# Relative RMS budgets of the bf16 path on CPU (no peer runs here), per case: 2 x our errors measured through the
# interpreter, whose bf16 intermediates are rounded to nearest and tf32 products rounded like the GPU's operands
# (kernels._rnd, _tdot). dA_log / ddt_bias: over the root sum of squares of their terms (demo.error). Measured:
# "safe":     o 4.35e-3, ht 2.72e-3, dq 2.88e-3, dk 2.89e-3, dv 3.76e-3, dg 3.20e-3, dbeta 3.42e-3, dA_log 1.89e-3,
#             ddt_bias 4.52e-3, dh0 2.71e-3 (the demo case: [15, 70, 50], H1/HV2, K=V=32, L2, [V, K] states;
#             fp32 dq / dk partials, which lowered dq, dk, dg, dA_log, ddt_bias here; the cases below were
#             measured with them in bf16)
# "pre":      o 4.06e-3, ht 3.47e-3, dq 3.68e-3, dk 4.30e-3, dv 3.83e-3, dg 3.51e-3, dbeta 3.23e-3, dh0 2.59e-3
# "softplus": o 3.38e-3, dq 3.08e-3, dk 3.40e-3, dv 2.91e-3, dg 3.51e-3, dbeta 3.37e-3, dA_log 7.47e-3,
#             ddt_bias 7.54e-3 (B=2 without cu_seqlens, bf16 raw gate and beta, no L2, no states)
# "strong":   o 4.33e-3, ht 2.77e-3, dq 3.64e-3, dk 3.28e-3, dv 3.81e-3, dg 3.07e-3, dbeta 3.07e-3, dh0 2.81e-3
#             (one head, a -3 per-token decay, two g = -inf tokens)
# "floor":    o 3.97e-3, ht 1.95e-3, dq 3.37e-3, dk 3.31e-3, dv 4.05e-3, dg 3.01e-3, dbeta 3.65e-3, dh0 6.91e-6
#             (one head, the safe gate saturated at its floor -5; h0 is forgotten within a few tokens). At
#             saturation sigmoid' ~ 0: dA_log / ddt_bias are sums of tiny terms that cancel (||sum|| ~ 0.2 of their
#             root sum of squares), so a 2 % scaling moves them less than our error: only finiteness is checked
#             for them there.
# "mild":     o 6.11e-3, ht 5.83e-3, dq 5.33e-3, dk 6.66e-3, dv 5.61e-3, dg 6.09e-3, dbeta 6.16e-3, dh0 5.13e-3
#             (one head, a -0.005 per-token decay: the state keeps everything, its bf16 copies weigh more)
BUDGETS = {
    "safe": demo_mod.BUDGETS["cpu"],
    "pre": {"o": 8.2e-3, "ht": 7.0e-3, "dq": 7.4e-3, "dk": 8.6e-3, "dv": 7.7e-3, "dg": 7.1e-3, "dbeta": 6.5e-3,
            "dh0": 5.2e-3},
    "softplus": {"o": 6.8e-3, "dq": 6.2e-3, "dk": 6.8e-3, "dv": 5.9e-3, "dg": 7.1e-3, "dbeta": 6.8e-3,
                 "dA_log": 1.5e-2, "ddt_bias": 1.51e-2},
    "strong": {"o": 8.7e-3, "ht": 5.6e-3, "dq": 7.3e-3, "dk": 6.6e-3, "dv": 7.7e-3, "dg": 6.2e-3, "dbeta": 6.2e-3,
               "dh0": 5.7e-3},
    "floor": {"o": 8.0e-3, "ht": 3.9e-3, "dq": 6.8e-3, "dk": 6.7e-3, "dv": 8.1e-3, "dg": 6.1e-3, "dbeta": 7.3e-3,
              "dh0": 1.4e-5},
    "mild": {"o": 1.23e-2, "ht": 1.17e-2, "dq": 1.07e-2, "dk": 1.34e-2, "dv": 1.13e-2, "dg": 1.22e-2, "dbeta": 1.24e-2,
             "dh0": 1.03e-2},
}


# fp32 runs: every tensor within EXACT of FP64, dA_log / ddt_bias within EXACT_SUMS of their terms' scale. Those two
# sum, over the tokens of a head, each token's d(log decay), itself the reverse in-chunk scan of dG: every dG error
# (uncorrelated, ~1.3e-6 of dG, a difference of larger terms) reaches every earlier token of its chunk, so the sums
# collect ~chunk-length times more of it (measured 1.0e-5 - 1.3e-5; dG's own errors: 1.3e-6).
EXACT, EXACT_SUMS = 5e-6, 3e-5


def _exact(errs):
    for name, err in errs.items():
        assert err < (EXACT_SUMS if name in demo_mod.SUM_TERMS else EXACT), (name, err, errs)


def _fp32_case(inp, l2):
    """The launchers on fp32 operands (every intermediate fp32, every in-chunk product exact) against FP64."""
    f = {n: (x.float() if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in inp.items()}
    K = f["q"].shape[-1]
    gate = ops.gate_kind(f["gate"] != "pre", f["lower_bound"])
    lb = float(f["lower_bound"] or 0.0)
    res = ops.kda_forward(f["q"], f["k"], f["v"], f["g"], f["beta"], f["A_log"], f["dt_bias"], f["h0"], f["cu"],
                          K ** -0.5, lb, gate, True, l2, f["trans"])
    grads = ops.kda_backward(f["do"], f["dht"], f["q"], f["k"], *res[2:4], f["v"], f["g"], f["beta"], f["A_log"],
                             f["dt_bias"], f["h0"], *res[4:], K ** -0.5, lb, gate, l2, f["trans"])
    ref = demo_mod.run_reference(f, l2=l2)
    errs = {"o": demo_mod.error("o", res[0], ref), "ht": demo_mod.error("ht", res[1], ref)}
    for name, got in zip(("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0"), grads):
        if "d" + name in ref:
            errs["d" + name] = demo_mod.error("d" + name, got, ref)
    return errs


EXACT_CASES = [  # (gate, lens, H, HV, K, V, L2, transposed states)
    ("pre", [1, 63, 65, 0], 1, 2, 16, 32, True, False),     # documents of 1, chunk - 1, chunk + 1 and 0 tokens; GVA
    ("softplus", [64, 15], 1, 1, 32, 16, False, True),      # one chunk exactly, then a partial one; [V, K] states
    ("safe", [15, 70], 1, 2, 32, 32, True, True),           # Kimi-K3's gate, a document across a chunk border
]


@pytest.mark.parametrize("gate, lens, H, HV, K, V, l2, trans", EXACT_CASES, ids=[c[0] for c in EXACT_CASES])
def test_math_exact_in_fp32(gate, lens, H, HV, K, V, l2, trans):
    """The kernels' algebra (gate, chunking, sub-block products, WY form, state recurrence, every gradient incl. the
    gate parameters') with fp32 intermediates matches the FP64 recurrence to fp32 rounding, for every gate mode."""
    inp = demo_mod.make_inputs(lens, H, HV, K, V, "cpu", gate=gate, trans=trans, l2=l2, seed=2)
    errs = _fp32_case(inp, l2)
    want = {"o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"} | ({"dA_log", "ddt_bias"} if gate != "pre" else set())
    assert set(errs) == want
    _exact(errs)


@pytest.mark.parametrize("decay", [-6.0, -4.5])
def test_diagonal_sub_blocks_elementwise_past_the_span_exact_in_fp32(decay):
    """A per-token decay of -6 puts every diagonal sub-block past kernels.DIAG_SPAN (G falls by 48 over the 8 rows
    about its middle row): the elementwise path, exact for any decay; -4.5 (36) stays inside it but near the edge,
    with factors up to exp(36) on tensor cores. Both match FP64 in fp32; dg within 2 x EXACT (at -6 its reverse scan
    sums terms of very different sizes: 6.4e-6, as the elementwise kernels gave before the tensor-core path)."""
    inp = demo_mod.make_inputs([64, 50], 1, 2, 32, 32, "cpu", gate="pre", decay=decay, seed=9)
    errs = _fp32_case(inp, True)
    assert errs.pop("dg") < 2 * EXACT, errs
    _exact(errs)


@pytest.mark.parametrize("mode", ["elementwise", "fma"])
def test_diagonal_block_modes(mode, monkeypatch):
    """The grams' and the in-chunk backward's other DIAG modes (the mode reaches both launches): exact in fp32 against
    FP64, with a decay inside the span (the mode's own path) and past it (its elementwise fallback), and the bf16 demo
    case within its budgets."""
    for name in ("grams", "intra"):
        monkeypatch.setitem(configs.CFG, name, dict(configs.CFG[name], DIAG=mode))
    code = kernels.DIAG_MODES[mode]
    labels = [r.label for r in ops.routes(32, 32)]
    for kernel in ("fwd_grams_kernel[", "bwd_intra_kernel["):
        own = [lab for lab in labels if lab.startswith(kernel)]
        assert own and all(f"DIAG={code}," in lab for lab in own), own
    for decay in (-0.5, -6.0):
        inp = demo_mod.make_inputs([64, 50], 1, 2, 32, 32, "cpu", gate="pre", decay=decay, seed=9)
        errs = _fp32_case(inp, True)
        assert errs.pop("dg") < 2 * EXACT, errs  # at -6: the reverse scan's terms of very different sizes
        _exact(errs)
    inp = demo_mod.make_inputs([15, 70, 50], 1, 2, 32, 32, "cpu", gate="safe", trans=True, seed=0)
    ours, ref = demo_mod.run_case(inp)
    _check_all(ours, ref, BUDGETS["safe"])


@pytest.mark.parametrize("bk, narrow", [(16, False), (8, True)])
def test_k_slices_and_narrow_state_tiles(bk, narrow, monkeypatch):
    """The gate, the grams, the dense backward, the in-chunk backward and the dg backward in K slices (each slice
    its own key dimensions; the grams, dbeta, dA and dA_log's terms add up over them), the state kernels' narrow
    tiles (two V blocks), the output kernel in two V slices and the inverse's products through the 3xTF32 route
    (exact in the interpreter: this checks the route's indexing) match FP64 in fp32."""
    for name in ("gate", "grams"):
        monkeypatch.setitem(configs.CFG, name, dict(configs.CFG[name], BK=bk))
    monkeypatch.setitem(configs.CFG, "dense", dict(configs.CFG["dense"], BK=bk))
    monkeypatch.setitem(configs.CFG, "intra", dict(configs.CFG["intra"], BK=bk))
    monkeypatch.setitem(configs.CFG, "dg", dict(configs.CFG["dg"], BK=bk))
    monkeypatch.setitem(configs.CFG, "h_narrow", dict(configs.CFG["h_narrow"], BV=16))
    monkeypatch.setitem(configs.CFG, "dh_narrow", dict(configs.CFG["dh_narrow"], BV=16))
    monkeypatch.setitem(configs.CFG, "o", dict(configs.CFG["o"], BV=16))
    monkeypatch.setitem(configs.CFG, "inv", dict(configs.CFG["inv"], TC=True))
    labels = [r.label for r in ops.routes(32, 32)]  # the switches reach the launches
    assert any(lab.startswith("fwd_o_kernel[") and "BV=16" in lab for lab in labels)
    assert any(lab.startswith("fwd_inv_kernel[") and "TC=True" in lab for lab in labels)
    monkeypatch.setattr(configs, "NARROW_BELOW", 1 << 30 if narrow else 0)
    assert ops._state_cfg(configs.CFG, "h", 32, 2) == (("h_narrow", 16) if narrow else ("h", 32))
    inp = demo_mod.make_inputs([70], 1, 2, 32, 32, "cpu", gate="softplus", seed=3)
    _exact(_fp32_case(inp, True))


@pytest.mark.parametrize("narrow", [False, True])
def test_decayed_state_route_same_bits(narrow, monkeypatch):
    """The state kernels' DECAYED route (k * exp(G_last - G) and q * exp(G) * scale read from decayed_kernel's
    scratch instead of formed on the sequential path) gives the bits of the default route in bf16: o, the final
    state and every gradient; documents of 1, chunk - 1, chunk + 1 and 0 tokens, GVA, the safe gate, [V, K] states."""
    monkeypatch.setattr(configs, "NARROW_BELOW", 1 << 30 if narrow else 0)
    # V = 64: the narrow entries' BV 32 is below V, so they are taken (at V = 32 both would run the wide ones)
    inp = demo_mod.make_inputs([1, 63, 65, 0, 70], 1, 2, 32, 64, "cpu", gate="safe", trans=True, seed=5)
    states = ("h", "h_narrow", "dh", "dh_narrow")
    for name in states:
        monkeypatch.setitem(configs.CFG, name, dict(configs.CFG[name], DECAYED=False))
    plain = demo_mod.run_impl(inp)
    for name in states:
        monkeypatch.setitem(configs.CFG, name, dict(configs.CFG[name], DECAYED=True))
    launched = []
    monkeypatch.setattr(ops, "_decayed_operands",
                        lambda *a, f=ops._decayed_operands, **kw: launched.append(a[-1]) or f(*a, **kw))
    tiles = []
    monkeypatch.setattr(ops, "launch", lambda kernel, grid, f=ops.launch, **kw: (
        kernel.fn.__name__ in ("fwd_h_kernel", "bwd_dh_kernel") and tiles.append(kw["BV"])) or f(kernel, grid, **kw))
    decayed = demo_mod.run_impl(inp)
    assert launched == [False, True]  # kd for the forward's recurrence, kd and qg for the reverse one
    assert tiles == [32, 32] if narrow else tiles == [64, 64]
    for n in plain:
        assert torch.equal(plain[n], decayed[n]), n


@pytest.mark.parametrize("gate, l2, pad, in_place", [("softplus", True, 16, {"q", "k", "v", "g"}),
                                                     ("pre", False, 16, {"q", "k", "v", "g"}),
                                                     ("safe", True, 3, set())])
def test_views_of_a_wider_projection(gate, l2, pad, in_place):
    """q, k, v and g as views of wider projections are read in place (every kernel that reads them takes their row
    strides), with the L2 norm in the kernel or without; every operand whose row stride is not a multiple of 16
    elements is copied; o, the final state and every gradient (dg through the view
    included) equal the contiguous operands' bits. bf16 raw gate, fp32 log decay."""
    inp = demo_mod.make_inputs([1, 63, 65, 0, 20], 1, 2, 16, 32, "cpu", gate=gate, trans=True, seed=7,
                               gate_dtype=torch.bfloat16)
    assert_views_read_in_place("kda", demo_mod.run_impl, inp, kda.chunk_kda, ("q", "k", "v", "g"), l2, in_place,
                               pad)


def _check_all(ours, ref, budgets):
    errs = {n: demo_mod.check_budget(n, ours[n], ref, budgets[n]) for n in ours if n in budgets}
    print("kda cpu errors:", {n: f"{e:.2e}" for n, e in errs.items()})
    return errs


def test_bf16_safe_gate_budgets_and_det_bits():
    """The demo case (Kimi-K3's call: safe gate, L2 norm, [V, K] states, GVA, varlen) within its budgets (each
    rejecting a 2 % error); det repeats bit for bit, and fast (which runs det's kernels) with the pool on gives the
    same bits."""
    inp = demo_mod.make_inputs([15, 70, 50], 1, 2, 32, 32, "cpu", gate="safe", trans=True, seed=0)
    ours, ref = demo_mod.run_case(inp)
    _check_all(ours, ref, BUDGETS["safe"])
    mek.configure(kda_variant="fast", workspace_pool_bytes=1 << 26)
    again = demo_mod.run_impl(inp)
    for n in ours:
        assert torch.equal(ours[n], again[n]), n


def test_bf16_pre_gated_varlen():
    inp = demo_mod.make_inputs([15, 70, 50], 1, 2, 32, 32, "cpu", gate="pre", seed=1)
    ours, ref = demo_mod.run_case(inp)
    _check_all(ours, ref, BUDGETS["pre"])


def test_bf16_softplus_gate_batch_without_cu_seqlens():
    """B = 2 without cu_seqlens, H == HV, K != V, the softplus gate on a bf16 raw g, bf16 beta (gradients in their
    dtypes), no L2 norm, no states."""
    inp = demo_mod.make_inputs([40, 40], 2, 2, 16, 32, "cpu", gate="softplus", l2=False, h0=False, seed=3,
                               gate_dtype=torch.bfloat16, beta_dtype=torch.bfloat16)
    for n in ("q", "k", "v", "g", "beta", "do"):
        inp[n] = inp[n].view(2, 40, *inp[n].shape[2:])
    ours = demo_mod.run_impl(inp, l2=False, cu=False, final=False)
    assert ours["dg"].dtype == torch.bfloat16 and ours["dbeta"].dtype == torch.bfloat16
    assert ours["dA_log"].dtype == torch.float32 and ours["ddt_bias"].shape == (2 * 16,)
    ref = demo_mod.run_reference(inp, l2=False, cu=False, final=False)
    _check_all(ours, ref, BUDGETS["softplus"])


@pytest.mark.parametrize("case", ["strong", "floor", "mild"])
def test_strong_and_mild_decays(case):
    """Finite inputs give finite outputs and gradients within the budgets: a -3 per-token decay (a chunk's G reaches
    -192: exp(-G) would overflow fp32) with two g = -inf tokens (a full forget: the exact, finite result); the safe
    gate saturated at its floor -5 (documents of 1, chunk + 1, 0, chunk - 1 tokens); a mild -0.005 decay."""
    if case == "strong":
        inp = demo_mod.make_inputs([64, 63], 1, 1, 32, 32, "cpu", gate="pre", decay=-3.0, seed=4)
        inp["g"][0, 5, 0] = float("-inf")
        inp["g"][0, 40, :] = float("-inf")
    elif case == "floor":
        inp = demo_mod.make_inputs([1, 65, 0, 63], 1, 1, 32, 32, "cpu", gate="safe", seed=4)
        inp["g"] = inp["g"] + 8.0  # sigmoid(exp(A_log) (g + dt_bias)) ~ 1: g_eff ~ -5 on every key dimension
    else:
        inp = demo_mod.make_inputs([65, 30], 1, 1, 32, 32, "cpu", gate="pre", decay=-0.005, seed=6)
    ours, ref = demo_mod.run_case(inp)
    for n in ours:
        assert torch.isfinite(ours[n]).all(), n
    _check_all(ours, ref, BUDGETS[case])


def _nonfinite_case(name, value, gate, seed):
    inp = demo_mod.make_inputs([70, 50], 1, 2, 16, 16, "cpu", gate=gate, trans=gate == "safe", seed=seed)
    assert_nonfinite_as_in_demo_reference("kda", inp, name, value, (20, 70 + 30))


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_nonfinite_token_reaches_only_later_rows(name, value):
    """A NaN or an inf in q, k, v, g (the raw gate of the safe in-kernel gate: +inf saturates it, a finite decay) or
    beta at one token in the middle of a chunk (of a document spanning two chunks, and of the second document) makes
    o and the final states non-finite exactly where the FP64 per-token recurrence is, never at an earlier row of its
    chunk (the in-chunk products with causally masked matrices would spread it through 0 * NaN = NaN) nor in the
    other document; every row the change does not reach keeps its bits."""
    _nonfinite_case(name, value, "safe", 7)


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_nonfinite_pre_gated_decay_reaches_only_later_rows(value):
    """The same for a pre-gated log decay g (no in-kernel gate): NaN or +inf at one token and key dimension."""
    _nonfinite_case("g", value, "pre", 8)


def test_torch_compile_fullgraph_traces():
    inp = demo_mod.make_inputs([20, 30], 1, 1, 16, 16, "cpu", gate="safe", trans=True, seed=1)

    def f(q, k, v, g, beta, A_log, dt_bias, h0, cu):
        return kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                             use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                             safe_gate=True, lower_bound=-5.0, transpose_state_layout=True, cu_seqlens=cu)

    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["A_log"], inp["dt_bias"], inp["h0"], inp["cu"])
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_activation_checkpointing_gives_the_same_bits():
    """Under torch.utils.checkpoint o, the final state and every gradient equal the plain call's bit for bit."""
    inp = demo_mod.make_inputs([20, 0, 65], 1, 2, 16, 16, "cpu", gate="safe", trans=True, seed=4)
    plain = demo_mod.run_impl(inp)
    ckpt = demo_mod.run_impl(inp, impl=checkpointed(ops.chunk_kda))
    assert set(plain) == set(ckpt) and len(plain) == 10
    for n in plain:
        assert torch.equal(plain[n], ckpt[n]), n


def test_check_seqlens_option_checks_on_the_host(monkeypatch):
    """With kda_check_seqlens the boundaries go through the shared host check (exactly at T) before any launch."""
    seen = record_cu_seqlens_checks(monkeypatch)
    inp = demo_mod.make_inputs([5, 3], 1, 1, 16, 16, "cpu", seed=2, h0=False)
    mek.configure(kda_check_seqlens=True)
    kda.chunk_kda(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], cu_seqlens=inp["cu"])
    assert seen == [("cu_seqlens", 8, {"must_end_at_total": True})]


def test_routes_are_the_launchers_launches():
    """routes() runs the launchers on meta tensors over every flag: 63 distinct specializations at 128 / 128 (the
    table kernel for int32 and int64 cu_seqlens; gate and the dg backward per gate kind and raw-gate dtype; the state
    kernels with and without initial / final state, in both layouts, wide and narrow (the narrow ones on the shipped
    DECAYED route, with its operand kernel with and without q); context parallelism's
    final-state-only passes (forward over V + K columns, backward storing only dh0; a document's first and last
    pieces take the op's own routes), wide and narrow, and its chain, both directions), each recorded
    from a real launch site, so none can drift from what a call launches."""
    rs = ops.routes(128, 128)
    labels = [r.label for r in rs]
    assert len(labels) == len(set(labels)) == 63
    count = lambda prefix: sum(lab.startswith(prefix) for lab in labels)  # noqa: E731
    assert count("chunk_table_kernel[") == 2
    assert count("fwd_gate_kernel[") == count("bwd_dg_kernel[") == 5  # none; softplus, sigmoid x fp32, bf16 raw g
    assert count("fwd_h_kernel[") == 18 and count("bwd_dh_kernel[") == 18
    assert count("decayed_kernel[") == 2 and sum("DECAYED=True" in lab for lab in labels) == 18  # narrow, CP's too
    assert sum("STORE_DHE=False" in lab for lab in labels) == 2
    assert count("chain_kernel[") == 2
    assert count("gate_sum_kernel[") == count("bwd_dense_kernel[") == count("bwd_intra_kernel[") == 1
    assert count("fwd_grams_kernel[") == count("fwd_inv_kernel[") == 1
    assert any("TRANS_STATE=True" in lab for lab in labels) and any("GATE=2" in lab for lab in labels)
    with pytest.raises(ValueError, match="head dims"):
        ops.routes(24, 128)


def test_register_cap_reaches_the_launch_and_its_route(monkeypatch):
    """A config entry's maxnreg is a launch option of that kernel (and only where an entry has one): the route a
    prebuild compiles carries it, and a call with it runs."""
    monkeypatch.setitem(configs.CFG, "grams", dict(configs.CFG["grams"], maxnreg=128))
    assert ops._cfg(configs.CFG, "grams")["maxnreg"] == 128 and "maxnreg" not in ops._cfg(configs.CFG, "o")
    rs = ops.routes(128, 128)
    preps = [r for r in rs if r.label.startswith("fwd_grams_kernel[")]
    assert preps and all("maxnreg=128" in r.label for r in preps), [r.label for r in preps]
    # the shipped caps (intra, dg, wu) reach their routes too
    for kernel, cap in (("bwd_intra_kernel[", 168), ("bwd_dg_kernel[", 128), ("fwd_wu_kernel[", 128)):
        own = [r.label for r in rs if r.label.startswith(kernel)]
        assert own and all(f"maxnreg={cap}" in lab for lab in own), own
    inp = demo_mod.make_inputs([70], 1, 2, 32, 32, "cpu", gate="softplus", seed=3)
    _exact(_fp32_case(inp, True))
