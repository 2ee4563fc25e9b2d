"""gdn through Triton's interpreter on tiny shapes, against the FP64 per-token recurrence."""
import importlib

import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels.cake import gdn
from miles_ext_kernels.cake._runtime import varlen
from miles_ext_kernels.cake._runtime.testing import check_budget, rel_rms
from tests.cake._delta_rule import assert_nonfinite_as_in_demo_reference, assert_views_read_in_place
from tests.cake._helpers import assert_raises_before_launch, record_cu_seqlens_checks

pytestmark = pytest.mark.interpreter

demo_mod = importlib.import_module("miles_ext_kernels.cake._impl.gdn.demo")
ops = importlib.import_module("miles_ext_kernels.cake._impl.gdn.ops")
reference = importlib.import_module("miles_ext_kernels.cake._impl.gdn.reference")

# Relative RMS budgets of the bf16 path on CPU (no peer runs here): 2 x our errors measured through the interpreter
# with fp32 dq / dk partials, whose bf16 intermediates are rounded to nearest like the GPU's (kernels._rnd; the
# interpreter's own downcast truncates). Measured (varlen): o 4.19e-3, ht 3.01e-3, dq 4.01e-3, dk 3.89e-3,
# dv 3.76e-3, dg 3.87e-3, dbeta 2.91e-3, dh0 2.38e-3; (batch): o 3.36e-3, dq 3.30e-3, dk 3.50e-3, dv 2.85e-3,
# dg 2.97e-3, dbeta 3.32e-3. With the default bf16 partials: varlen dq 4.32e-3, dk 4.53e-3; batch dk 3.80e-3.
BUDGETS_VARLEN = {"o": 8.4e-3, "ht": 6.1e-3, "dq": 8.1e-3, "dk": 7.8e-3, "dv": 7.6e-3, "dg": 7.8e-3,
                  "dbeta": 5.9e-3, "dh0": 4.8e-3}
BUDGETS_BATCH = {"o": 6.8e-3, "dq": 6.6e-3, "dk": 7.0e-3, "dv": 5.7e-3, "dg": 6.0e-3, "dbeta": 6.7e-3}


def _fp32_case(lens, H, HV, K, V, l2, keep, h0=True):
    inp = demo_mod.make_inputs(lens, H, HV, K, V, "cpu", l2=l2, h0=h0)
    f = {n: (x.float() if x is not None and x.is_floating_point() else x) for n, x in inp.items()}
    scale = K ** -0.5
    o, ht, qn, kk, gc, A, w, h, vn, cu, table = ops.gdn_forward(f["q"], f["k"], f["v"], f["g"], f["beta"], f["h0"],
                                                                 f["cu"], scale, True, l2, keep)
    grads = ops.gdn_backward(f["do"], f["dht"], f["q"], f["k"], qn, kk, f["v"], f["g"], f["beta"], f["h0"], gc, A, w,
                             h, vn, cu, table, scale, l2, keep)
    leaves = {n: f[n].double().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    if h0:
        leaves["h0"] = f["h0"].double().requires_grad_(True)
    ro, rht = reference.gdn_reference(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                      initial_state=leaves.get("h0"), output_final_state=True,
                                      use_qk_l2norm_in_kernel=l2, cu_seqlens=f["cu"])
    (ro * f["do"].double()).sum().add((rht * f["dht"].double()).sum()).backward()
    errs = {"o": rel_rms(o, ro), "ht": rel_rms(ht, rht)}
    for name, got in zip(("q", "k", "v", "g", "beta", "h0"), grads):
        if name in leaves:
            errs["d" + name] = rel_rms(got, leaves[name].grad)
    return errs


@pytest.mark.parametrize("l2, keep, dims", [(True, True, (1, 2, 32, 32)), (False, False, (1, 2, 32, 32)),
                                            (True, False, (2, 4, 16, 64))])
def test_math_exact_in_fp32(l2, keep, dims):
    """The kernels' algebra (chunking, WY form, state recurrence, every gradient) with fp32 intermediates matches the
    FP64 recurrence to fp32 rounding: varlen with a document shorter than a chunk and one spanning chunk borders,
    initial and final states, GQA heads, the L2-norm mode, kept and recomputed states."""
    errs = _fp32_case([15, 70, 50], *dims, l2, keep)
    assert set(errs) == {"o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"}
    for name, err in errs.items():
        assert err < 5e-6, (name, err, errs)


@pytest.mark.parametrize("narrow_below", [0, 1 << 30])
def test_state_kernels_wide_and_narrow_tiles(narrow_below, monkeypatch):
    """Both tile configs of the sequential state kernels (wide: one V block of 64; narrow: two blocks of 32, used when
    few sequences x heads would leave SMs idle) match the FP64 recurrence, states kept and recomputed."""
    configs = importlib.import_module("miles_ext_kernels.cake._impl.gdn.configs")
    monkeypatch.setitem(configs.CFG, "h_narrow", dict(configs.CFG["h_narrow"], BV=32))
    monkeypatch.setitem(configs.CFG, "dh_narrow", dict(configs.CFG["dh_narrow"], BV=32))
    monkeypatch.setattr(configs, "NARROW_BELOW", narrow_below)
    want = ("h_narrow", 32) if narrow_below else ("h", 64)
    assert ops._state_cfg(configs.CFG, "h", 64, 3 * 4) == want
    assert ops._state_cfg(configs.CFG, "dh", 64, 3 * 4) == ("dh" + want[0][1:], want[1])
    for keep in (True, False):
        errs = _fp32_case([15, 70, 50], 2, 4, 16, 64, True, keep)
        for name, err in errs.items():
            assert err < 5e-6, (name, err, errs)


@pytest.mark.parametrize("bk, bk_dk, split", [(64, 32, True), (32, 64, True), (32, 32, True), (32, 32, False)])
def test_dqkw_in_k_slices(bk, bk_dk, split, monkeypatch):
    """The dq / dk / dw backward in K slices (each launch its own BK; the WY backward adds the partial dG slots in
    order) matches the FP64 recurrence in fp32, split into two launches or not."""
    configs = importlib.import_module("miles_ext_kernels.cake._impl.gdn.configs")
    monkeypatch.setitem(configs.CFG, "dqkw", dict(configs.CFG["dqkw"], BK=bk, BK_dk=bk_dk, SPLIT=split))
    launches, slots, direct = ops._dqkw_launches(configs.CFG, 64)
    assert slots == (64 // bk + 64 // bk_dk if split else 64 // bk) and slots > 1
    assert direct == 64 // (bk_dk if split else bk)
    errs = _fp32_case([15, 70, 50], 2, 4, 64, 32, True, True)
    for name, err in errs.items():
        assert err < 5e-6, (name, err, errs)


def test_partial_sum_dtypes(monkeypatch):
    """Each dtype choice of the per-value-head dq / dk partials (LOW_PARTIALS) and of dqkw's dk part (LOW_DK) other
    than the default (both bf16) stays within the budgets and changes the bits (so the option took effect)."""
    configs = importlib.import_module("miles_ext_kernels.cake._impl.gdn.configs")
    assert configs.CFG["final"]["LOW_PARTIALS"] and configs.CFG["final"]["LOW_DK"]
    inp = demo_mod.make_inputs([15, 70, 50], 1, 2, 32, 32, "cpu", l2=True, seed=0)
    ref = _reference(inp, l2=True)  # one reference and one default run for the three choices
    base = _public(inp, l2=True)
    for low_partials, low_dk in ((False, False), (False, True), (True, False)):
        monkeypatch.setitem(configs.CFG, "final", dict(configs.CFG["final"], LOW_PARTIALS=low_partials,
                                                       LOW_DK=low_dk))
        got = _public(inp, l2=True)
        for n in got:
            check_budget(n, got[n], ref[n], BUDGETS_VARLEN[n])
        assert not torch.equal(got["dk"], base["dk"]), (low_partials, low_dk)


def _public(inp, *, l2, cu=True, final=True, h0=True):
    leaves = {n: inp[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    if h0:
        leaves["h0"] = inp["h0"].clone().requires_grad_(True)
    o, ht = gdn.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                       initial_state=leaves.get("h0"), output_final_state=final,
                                       use_qk_l2norm_in_kernel=l2, cu_seqlens=inp["cu"] if cu else None)
    loss = (o.float() * inp["do"].float()).sum()
    if final:
        loss = loss + (ht * inp["dht"]).sum()
    loss.backward()
    out = {"o": o.detach()}
    if final:
        out["ht"] = ht.detach()
    else:
        assert ht is None
    out.update({"d" + n: t.grad for n, t in leaves.items()})
    return out


def _reference(inp, *, l2, cu=True, final=True, h0=True):
    leaves = {n: inp[n].detach().double().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    if h0:
        leaves["h0"] = inp["h0"].double().requires_grad_(True)
    o, ht = reference.gdn_reference(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                    initial_state=leaves.get("h0"), output_final_state=final,
                                    use_qk_l2norm_in_kernel=l2, cu_seqlens=inp["cu"] if cu else None)
    loss = (o * inp["do"].double()).sum()
    if final:
        loss = loss + (ht * inp["dht"].double()).sum()
    loss.backward()
    out = {"o": o.detach()}
    if final:
        out["ht"] = ht.detach()
    out.update({"d" + n: t.grad for n, t in leaves.items()})
    return out


def test_bf16_varlen_budgets_det_fast_recompute_bits():
    inp = demo_mod.make_inputs([15, 70, 50], 1, 2, 32, 32, "cpu", l2=True, seed=0)
    ref = _reference(inp, l2=True)
    det = _public(inp, l2=True)
    errs = {n: check_budget(n, det[n], ref[n], BUDGETS_VARLEN[n]) for n in det}
    print("gdn cpu varlen errors:", {n: f"{e:.2e}" for n, e in errs.items()})
    mek.configure(gdn_variant="fast", gdn_recompute_state=True)
    fast = _public(inp, l2=True)
    for n in det:
        assert torch.equal(det[n], fast[n]), n


def test_bf16_batch_without_cu_seqlens():
    """B > 1 without cu_seqlens, H == HV, K != V, no initial state, no final state, no L2 norm."""
    gen = torch.Generator().manual_seed(3)
    B, T, H, K, V = 2, 40, 2, 16, 32
    q = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(torch.bfloat16)
    k = torch.nn.functional.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).to(torch.bfloat16)
    v = torch.randn(B, T, H, V, generator=gen).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, generator=gen))
    beta = torch.rand(B, T, H, generator=gen).to(torch.bfloat16)  # bf16 beta: gradient comes back in bf16
    do = torch.randn(B, T, H, V, generator=gen).to(torch.bfloat16)
    inp = dict(q=q, k=k, v=v, g=g, beta=beta, do=do, cu=None, h0=None, dht=None)
    ours = _public(inp, l2=False, cu=False, final=False, h0=False)
    assert ours["dbeta"].dtype == torch.bfloat16 and ours["dg"].dtype == torch.float32
    ref = _reference(inp, l2=False, cu=False, final=False, h0=False)
    errs = {n: check_budget(n, ours[n], ref[n], BUDGETS_BATCH[n]) for n in ours}
    print("gdn cpu batch errors:", {n: f"{e:.2e}" for n, e in errs.items()})


def _args(T=8, H=1, HV=2, K=16, V=16, N=1):
    q = torch.randn(1, T, H, K).to(torch.bfloat16)
    return dict(q=q, k=q.clone(), v=torch.randn(1, T, HV, V).to(torch.bfloat16), g=torch.zeros(1, T, HV) - 0.1,
                beta=torch.rand(1, T, HV))


def _wide(heads, dim=None, T=2 ** 24, dtype=None):
    """A [1, T, heads(, dim)] operand of T tokens that holds one token's memory (a zero-stride view)."""
    shape = (1, 1, heads) if dim is None else (1, 1, heads, dim)
    dtype = dtype or (torch.float32 if dim is None else torch.bfloat16)
    return torch.zeros(shape, dtype=dtype).expand(1, T, *shape[2:])


@pytest.mark.parametrize("change, exc, word", [
    (dict(q=torch.randn(1, 8, 1, 16)), TypeError, "^q must be bfloat16"),
    (dict(k=torch.randn(1, 8, 1, 16).to(torch.bfloat16)[:, :4]), ValueError, "^k must have the shape of q"),
    (dict(v=torch.randn(1, 8, 3, 16).to(torch.bfloat16)), ValueError, "g must be"),
    (dict(q=torch.randn(1, 8, 1, 24).to(torch.bfloat16), k=torch.randn(1, 8, 1, 24).to(torch.bfloat16)), ValueError,
     "K=24"),
    (dict(g=torch.zeros(1, 8, 3)), ValueError, r"^g must be \[B, T, HV\]"),
    (dict(beta=torch.zeros(1, 8, 2, dtype=torch.int32)), TypeError, "^beta must be"),
    (dict(cu_seqlens=torch.tensor([0, 3, 8], dtype=torch.float32)), TypeError, "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 9], dtype=torch.int32)), ValueError, "cu_seqlens"),
    (dict(cu_seqlens=torch.tensor([0, 3, 8]), initial_state=torch.zeros(1, 2, 16, 16)), ValueError, "initial_state"),
    (dict(scale="x"), TypeError, "scale"),
    (dict(scale=float("nan")), ValueError, "^scale must be finite"),
    (dict(scale=float("inf")), ValueError, "^scale must be finite"),
    # every tensor on q's device (meta stands in for another GPU on a CPU machine)
    (dict(v=torch.zeros(1, 8, 2, 16, dtype=torch.bfloat16, device="meta")), ValueError,
     "^v is on meta but q is on cpu"),
    (dict(g=torch.zeros(1, 8, 2, device="meta")), ValueError, "^g is on meta but q is on cpu"),
    (dict(cu_seqlens=torch.tensor([0, 8], device="meta")), ValueError, "^cu_seqlens is on meta but q is on cpu"),
    (dict(initial_state=torch.zeros(1, 2, 16, 16, device="meta")), ValueError, "^initial_state is on meta"),
    (dict(output_final_state=1), TypeError, "output_final_state"),
    # 2**24 tokens x HV 2 x 64 (the chunk): per-token buffers past 32-bit offsets (zero-stride views, no memory)
    (dict(q=_wide(1, 16), k=_wide(1, 16), v=_wide(2, 16), g=_wide(2), beta=_wide(2)), ValueError,
     "^q holds B \\* T = 16777216 tokens"),
])
def test_bad_operands_raise_before_launch(change, exc, word, monkeypatch):
    monkeypatch.setattr(ops, "gdn_forward", lambda *a, **k: pytest.fail("launched"))
    assert_raises_before_launch(gdn.chunk_gated_delta_rule, _args(), change, exc, word, ("q", "k", "v", "g", "beta"))


def test_torch_compile_fullgraph_traces():
    inp = demo_mod.make_inputs([20, 30], 1, 1, 16, 16, "cpu", l2=True, seed=1)

    def f(q, k, v, g, beta, h0, cu):
        o, ht = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        return o, ht

    args = (inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], inp["h0"], inp["cu"])
    eager = f(*args)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*args)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1], compiled[1])


def test_check_seqlens_option_checks_on_the_host(monkeypatch):
    """With gdn_check_seqlens the boundaries go through the shared host check (exactly at T) before any launch."""
    seen = record_cu_seqlens_checks(monkeypatch)
    d = importlib.import_module("miles_ext_kernels.cake._impl.gdn.demo")
    inp = d.make_inputs([5, 3], 1, 1, 16, 16, "cpu", seed=2, h0=False)
    mek.configure(gdn_check_seqlens=True)
    try:
        gdn.chunk_gated_delta_rule(inp["q"], inp["k"], inp["v"], inp["g"], inp["beta"], cu_seqlens=inp["cu"])
    finally:
        mek.configure()
    assert seen == [("cu_seqlens", 8, {"must_end_at_total": True})]


@pytest.mark.parametrize("lens", [[1], [64], [65, 0, 130], [0, 0, 15], [63, 64, 1, 300, 0, 7, 128, 129], [5] * 33,
                                  [64] * 200 + [1, 0, 65]])  # the last: 404 slots, four programs
def test_chunk_table_kernel(lens):
    """The chunk-slot table (one launch, vectorised binary search) names the right (sequence, chunk) for every used
    slot and -1 for every unused one, with empty sequences and sequences of exactly one chunk."""
    BT = ops.BT
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    N, T = len(lens), int(cu[-1])
    P = (T + BT - 1) // BT + N
    got, se = varlen.chunk_table(cu, N, P, T, BT)
    assert torch.equal(se, torch.stack([cu[:-1], cu[1:]], 1))
    want = torch.full((P,), -1, dtype=torch.int32)
    want_ic = torch.zeros(P, dtype=torch.int32)
    for n, L in enumerate(lens):
        s = int(cu[n]) // BT + n
        for c in range((L + BT - 1) // BT):
            want[s + c], want_ic[s + c] = n, c
    assert torch.equal(got[:, 0], want)
    used = want >= 0
    assert torch.equal(got[used, 1], want_ic[used])
    assert int(used.sum()) == sum((L + BT - 1) // BT for L in lens)


@pytest.mark.parametrize("lens, decay, full_forget", [
    ([63], -1.5, False),            # one partial chunk: G reaches -94 (exp(-G) overflows fp32 past -88.7)
    ([64, 63], -3.0, False),        # a full chunk, then a partial one under a -3 per-token decay
    ([1, 65, 0, 63], -1.5, True),   # documents of length 1, chunk + 1, 0, chunk - 1; two g = -inf tokens
])
def test_strong_decay_and_full_forget_give_finite_results(lens, decay, full_forget):
    """Finite inputs give finite outputs and gradients within the budgets under strong decays (padding rows past a
    document's end must not enter an exp), and g = -inf (a full forget) gives the exact, finite result."""
    inp = demo_mod.make_inputs(lens, 1, 2, 32, 32, "cpu", l2=True, seed=4)
    gen = torch.Generator().manual_seed(5)
    inp["g"] = decay + 0.1 * torch.rand(inp["g"].shape, generator=gen)
    if full_forget:
        inp["g"][0, 5, 0] = float("-inf")
        inp["g"][0, 40, :] = float("-inf")
    ours = demo_mod.run_impl(inp)
    ref = demo_mod.run_reference(inp)
    for n in ours:
        assert torch.isfinite(ours[n]).all(), n
        check_budget(n, ours[n], ref[n], BUDGETS_VARLEN[n])


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", ["q", "k", "v", "g", "beta"])
def test_nonfinite_token_reaches_only_later_rows(name, value):
    """A NaN or an inf in q, k, v, g or beta at one token (in the middle of a chunk: of the first document, which
    spans two chunks, and of the second, in the pack) makes o and the final states non-finite exactly where the FP64
    per-token recurrence is: rows at and after it in its document (later chunks through the state; only its own row
    for q; only its value head for v, g, beta), never an earlier row of its chunk (the in-chunk products with causally
    masked matrices would spread it through 0 * NaN = NaN) nor the other document; every other row keeps its bits."""
    inp = demo_mod.make_inputs([70, 50], 1, 2, 16, 16, "cpu", l2=True, seed=6)
    assert_nonfinite_as_in_demo_reference("gdn", inp, name, value, (20, 70 + 30))


@pytest.mark.parametrize("l2", [True, False])
def test_views_of_a_wider_projection(l2):
    """q, k, v as views of a packed projection (Qwen3-Next's split conv output) are read in place (every kernel
    that reads them takes their row strides), with the L2 norm in the kernel or without; bits equal to contiguous
    operands either way."""
    from miles_ext_kernels.cake.gdn import chunk_gated_delta_rule

    inp = demo_mod.make_inputs([1, 63, 65, 0, 20], 1, 2, 16, 32, "cpu", seed=3)
    assert_views_read_in_place("gdn", demo_mod.run_impl, inp, chunk_gated_delta_rule, ("q", "k", "v"), l2,
                               {"q", "k", "v"})


def test_routes_are_the_launchers_launches():
    """routes() runs the launchers on meta tensors over every flag: 34 distinct specializations (the table kernel for
    int32 and int64 cu_seqlens; the state kernels with and without initial / final state, wide and narrow; context
    parallelism's final-state-only passes (forward over V + K columns, backward storing only dh0; a document's first
    and last pieces take the plain routes), wide and narrow, and its chain, both directions),
    each recorded from a real launch site, so none can drift from what a call launches."""
    rs = ops.routes(128, 128)
    labels = [r.label for r in rs]
    assert len(labels) == len(set(labels)) == 34
    assert sum(lab.startswith("chunk_table_kernel[") for lab in labels) == 2
    assert sum(lab.startswith("fwd_h_kernel[") for lab in labels) == 10
    assert sum(lab.startswith("chain_kernel[") for lab in labels) == 2
    assert sum(lab.startswith("bwd_dh_kernel[") for lab in labels) == 10
    assert sum("STORE_DHE=False" in lab for lab in labels) == 2
    with pytest.raises(ValueError, match="head dims"):
        ops.routes(24, 128)
