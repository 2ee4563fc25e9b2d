"""gqa through Triton's interpreter on CPU tensors: accuracy vs FP64, edges, det bits, packing invariance, checks.

The interpreter runs the same kernels with small blocks (CONFIGS["interpret"]: 16-row tiles), so these tiny layouts
cross tile, key-block and causal-diagonal boundaries; tiles start at segment starts whatever the block size, which
is what the packing-invariance tests prove.
"""
import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels.cake import gqa as decl
from miles_ext_kernels.cake._impl.gqa import ops, reference
from miles_ext_kernels.cake._runtime.testing import check_budget
from tests.cake._helpers import assert_demo_passes

pytestmark = pytest.mark.interpreter
BF = torch.bfloat16
D = 256
BUDGET = 1.0e-2  # relative RMS vs FP64 on the interpreter (bf16 operands; measured ~4e-3 out, ~7e-3 grads)


def _cu(lens):
    return torch.tensor([0] + list(torch.tensor(lens, dtype=torch.int64).cumsum(0)), dtype=torch.int32)


def _inputs(lens_q, lens_k, hq, hkv, pad_q=0, pad_k=0, seed=0):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q) + pad_q, sum(lens_k) + pad_k
    q = torch.randn(tq, hq, D, generator=g).to(BF)
    k = torch.randn(tk, hkv, D, generator=g).to(BF)
    v = torch.randn(tk, hkv, D, generator=g).to(BF)
    do = torch.randn(tq, hq, D, generator=g).to(BF)
    return q, k, v, do, _cu(lens_q), _cu(lens_k)


def _run(q, k, v, do, cq, ck, max_k=None, **kw):
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if max_k is None:
        max_k = int((ck[1:] - ck[:-1]).max()) if ck.numel() > 1 else 0
    out, lse = decl.varlen_gqa_attention(qr, kr, vr, cq, ck, max_seqlen_k=max_k, return_lse=True, **kw)
    dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), do, allow_unused=True)
    return out.detach(), lse, dq, dk, dv


def _check(inp, got, scale=None):
    q, k, v, do, cq, ck = inp
    ro, rl, rdq, rdk, rdv = reference.reference_grads(q, k, v, cq, ck, do, scale)
    out, lse, dq, dk, dv = got
    assert out.dtype == BF and lse.dtype == torch.float32 and lse.shape == (q.shape[1], q.shape[0])
    check_budget("out", out, ro, BUDGET)
    for name, g, r in (("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        if r.abs().max() > 0:
            check_budget(name, g, r, BUDGET)
        else:
            assert torch.equal(g, torch.zeros_like(g)), name
    # LSE: -inf exactly where the reference has it, close elsewhere
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert torch.allclose(lse.double()[fin], rl[fin], atol=1e-4, rtol=0)


@pytest.mark.parametrize("hq,hkv", [(2, 2), (4, 2), (3, 1), (8, 1)])
def test_group_ratios(hq, hkv):
    inp = _inputs([37, 20], [37, 20], hq, hkv, seed=hq)
    _check(inp, _run(*inp))


def test_padding_and_empty_segments():
    inp = _inputs([17, 0, 30, 0], [17, 0, 30, 0], 2, 1, pad_q=9, pad_k=5, seed=1)
    got = _run(*inp)
    _check(inp, got)
    out, lse, dq, dk, dv = got
    assert torch.equal(out[47:], torch.zeros_like(out[47:])) and torch.isneginf(lse[:, 47:]).all()
    assert torch.equal(dq[47:], torch.zeros_like(dq[47:]))
    assert torch.equal(dk[47:], torch.zeros_like(dk[47:])) and torch.equal(dv[47:], torch.zeros_like(dv[47:]))


def test_lk_less_than_lq_rows_without_keys():
    # L_q = 40, L_k = 18: the first 22 queries of segment 0 see no key -> out 0, LSE -inf, no gradient
    inp = _inputs([40, 12], [18, 33], 2, 1, seed=2)
    got = _run(*inp)
    _check(inp, got)
    out, lse, dq, _, _ = got
    assert torch.equal(out[:22], torch.zeros_like(out[:22])) and torch.isneginf(lse[:, :22]).all()
    assert torch.equal(dq[:22], torch.zeros_like(dq[:22]))


def test_lk_greater_than_lq_and_scale():
    inp = _inputs([9, 25], [40, 30], 4, 1, seed=3)
    _check(inp, _run(*inp, softmax_scale=0.05), scale=0.05)


def test_segments_without_keys_or_queries():
    inp = _inputs([10, 0, 12], [0, 14, 12], 2, 2, seed=4)
    got = _run(*inp)
    _check(inp, got)
    assert torch.equal(got[0][:10], torch.zeros_like(got[0][:10]))
    assert torch.equal(got[3][:14], torch.zeros_like(got[3][:14]))  # keys no query sees: dK 0


def test_empty_calls():
    for lq, lk in (([0], [5]), ([6], [0]), ([], [])):
        inp = _inputs(lq, lk, 2, 1, seed=5)
        out, lse, dq, dk, dv = _run(*inp, max_k=8)
        assert out.shape == inp[0].shape and torch.equal(out, torch.zeros_like(out))
        assert dq.shape == inp[0].shape and dk.shape == inp[1].shape
        assert torch.equal(dk, torch.zeros_like(dk)) and torch.equal(dv, torch.zeros_like(dv))


def test_strided_views_of_packed_qkv():
    g = torch.Generator().manual_seed(6)
    lens, hq, hkv = [21, 30], 4, 2
    qkv = torch.randn(sum(lens), hq + 2 * hkv, D, generator=g).to(BF)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    assert not q.is_contiguous()
    do = torch.randn(sum(lens), hq, D, generator=g).to(BF)
    inp = (q, k, v, do, _cu(lens), _cu(lens))
    qq, kk, vv = (t.detach().requires_grad_() for t in (q, k, v))
    out = decl.varlen_gqa_attention(qq, kk, vv, inp[4], inp[5], max_seqlen_k=30)
    got_c = _run(q.contiguous(), k.contiguous(), v.contiguous(), do, inp[4], inp[5])
    assert torch.equal(out, got_c[0])
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), do)
    assert torch.equal(dq, got_c[2]) and torch.equal(dk, got_c[3]) and torch.equal(dv, got_c[4])


def test_offsets_past_int32_are_copied_first():
    # the kernels form head * head_stride and row_in_tile * token_stride in int32: a layout where either reaches 2^31
    # elements must be copied before a launch, or the reads wrap around (meta: the layout without the 4 GB)
    def view(strides, H=3):
        return torch.empty_strided((4, H, D), strides, dtype=BF, device="meta")

    head_major = view((D, 2 ** 30, 1))  # a [H, T, D] buffer at 2^22 tokens, viewed as [T, H, D]
    assert ops._ready(head_major, "q").stride() == (3 * D, D, 1)
    wide_rows = view((2 ** 24, D, 1))  # 128 rows of a tile span 2^31 elements
    assert ops._ready(wide_rows, "q").stride() == (3 * D, D, 1)
    for fine in (view((D, 2 ** 29, 1)), view((2 ** 23, D, 1)), view((D, 2 ** 30, 1), H=1)):
        assert ops._ready(fine, "q") is fine  # read in place: every offset fits


def test_det_bits_repeat_and_max_seqlen_k():
    inp = _inputs([33, 19], [33, 19], 3, 1, seed=7)
    a = _run(*inp)
    for max_k in (33, 50, inp[1].shape[0]):
        b = _run(*inp, max_k=max_k)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


def test_packing_invariance():
    """A document's out, LSE, dQ, dK, dV are the same bits alone, first, middle, last, whatever the pack's size."""
    g = torch.Generator().manual_seed(8)
    hq, hkv = 4, 2
    L = 29
    doc = [torch.randn(L, h, D, generator=g).to(BF) for h in (hq, hkv, hkv, hq)]

    def pack(before, after):
        parts = []
        for i, h in enumerate((hq, hkv, hkv, hq)):
            parts.append(torch.cat([torch.randn(before, h, D, generator=g).to(BF), doc[i],
                                    torch.randn(after + 3, h, D, generator=g).to(BF)]))  # 3 padding tokens
        lens = [n for n in (before, L, after) if n]
        start = before
        return parts, lens, start

    ref = None
    for before, after in ((0, 0), (0, 18), (23, 0), (17, 40)):
        (q, k, v, do), lens, s = pack(before, after)
        cu = _cu(lens)
        out, lse, dq, dk, dv = _run(q, k, v, do, cu, cu)
        got = (out[s:s + L], lse[:, s:s + L], dq[s:s + L], dk[s:s + L], dv[s:s + L])
        if ref is None:
            ref = got
        else:
            for x, y in zip(ref, got):
                assert torch.equal(x, y), (before, after)


def test_transposed_score_dkdv_path(monkeypatch):
    """The dK/dV kernel's S^T path (S_ROWS=False: transposes only loaded tiles, the fallback if triton 3.6's
    tl.trans-of-a-dot-result bug bites a config) against the reference, padding rows included."""
    arch = ops.INTERPRETER_ARCH
    monkeypatch.setitem(ops.CONFIGS, arch, dict(ops.CONFIGS[arch], dkdv=dict(ops.CONFIGS[arch]["dkdv"], S_ROWS=False)))
    inp = _inputs([29, 0, 18], [29, 0, 18], 4, 2, pad_q=3, pad_k=2, seed=12)
    _check(inp, _run(*inp))


def test_variants_configured():
    inp = _inputs([20], [20], 2, 1, seed=10)
    a = _run(*inp)
    mek.configure(gqa_variant="fast")
    b = _run(*inp)
    for x, y in zip(a, b):  # fast runs det's kernels for out/LSE/dK/dV
        assert torch.equal(x, y) or x is y
    mek.configure(deterministic_mode=True)
    c = _run(*inp)
    assert torch.equal(a[2], c[2])


def _seen_by(lens_q, lens_k, doc, j, hq):
    """[T_q, H_q] (rows of the pack): the query rows of document `doc` that see its key j (j <= i + L_k - L_q)."""
    T_q = sum(lens_q)
    seen = torch.zeros(T_q, hq, dtype=torch.bool)
    q0, L_q, L_k = sum(lens_q[:doc]), lens_q[doc], lens_k[doc]
    seen[q0:q0 + L_q] = (j <= torch.arange(L_q) + (L_k - L_q))[:, None]
    return seen


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", ["v", "k", "q"])
def test_nonfinite_token_reaches_only_the_rows_that_see_it(name, value):
    """A NaN or an inf in q, k or v at one token (in the middle of a tile, inside a causal-diagonal key block; in the
    first document of a pack and in the second, which has more keys than queries) reaches only the rows that see it
    (q: its own row and head): every other row, earlier rows of its document included, and the other document keep
    the bits of the run without it (any finite value there gives those bits). The rows that see it are non-finite: a
    non-finite v row in each of them; for q and k where the FP64 reference is (an infinite score of -inf is a
    weight of 0). LSE does not depend on v."""
    lens_q, lens_k = [37, 29], [37, 35]
    q, k, v, _, cq, ck = _inputs(lens_q, lens_k, 2, 1, seed=14)
    scale = D ** -0.5
    out0, lse0 = ops.gqa_forward(q, k, v, cq, ck, scale)
    for doc, j in ((0, 8), (1, 20), (1, 2)):
        x = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
        row = (sum(lens_q[:doc]) if name == "q" else sum(lens_k[:doc])) + j
        x[name][row, 0, 5] = value
        out, lse = ops.gqa_forward(x["q"], x["k"], x["v"], cq, ck, scale)
        if name == "q":
            seen = torch.zeros(q.shape[:2], dtype=torch.bool)
            seen[row, 0] = True
        else:
            seen = _seen_by(lens_q, lens_k, doc, j, q.shape[1])
        bad = ~torch.isfinite(out).all(-1)  # [T_q, H_q]
        assert not bad[~seen].any(), (doc, bad.nonzero().tolist())
        assert torch.equal(out[~seen], out0[~seen]) and torch.equal(lse.T[~seen], lse0.T[~seen]), doc
        if name == "v":
            assert bad[seen].all() and torch.equal(lse, lse0), doc
        else:
            ref_out, _ = reference.varlen_gqa_reference(x["q"], x["k"], x["v"], cq, ck, scale)
            assert torch.equal(bad, ~torch.isfinite(ref_out).all(-1)), doc


def test_check_seqlens_option():
    q, k, v, do, cq, ck = _inputs([10, 12], [10, 12], 2, 1, seed=11)
    mek.configure(gqa_check_seqlens=True)
    decl.varlen_gqa_attention(q, k, v, cq, ck, max_seqlen_k=12)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        decl.varlen_gqa_attention(q, k, v, cq, ck, max_seqlen_k=11)
    # (the boundaries changed, {index: value}, max_seqlen_k): a start not 0, falling boundaries, an end past T
    for which, edits, max_k in (("cu_seqlens_q", {0: 1}, 12), ("cu_seqlens_k", {1: 15, 2: 14}, 20),
                                ("cu_seqlens_k", {2: 40}, 40)):
        cu = dict(cu_seqlens_q=cq, cu_seqlens_k=ck)
        cu[which] = cu[which].clone()
        for i, value in edits.items():
            cu[which][i] = value
        with pytest.raises(ValueError, match=which):
            decl.varlen_gqa_attention(q, k, v, cu["cu_seqlens_q"], cu["cu_seqlens_k"], max_seqlen_k=max_k)


def _bad_calls():
    q, k, v, do, cq, ck = _inputs([8], [8], 2, 1, seed=12)
    ok = dict(q=q, k=k, v=v, cu_seqlens_q=cq, cu_seqlens_k=ck, max_seqlen_k=8)
    cases = [
        (dict(q=q.float()), TypeError, "^q must be bfloat16"),
        (dict(k=k.half()), TypeError, "^k must be bfloat16"),
        (dict(v=v[:, :, :128]), ValueError, "^v must have k's shape"),
        (dict(q=q[:, :, :128].contiguous()), ValueError, "^q: head dim must be 256"),
        (dict(k=k[:, :, :128].contiguous(), v=v[:, :, :128].contiguous()), ValueError, "^k: head dim must be 256"),
        (dict(q=q[0]), ValueError, "^q must have 3 dimensions"),
        (dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), ValueError, "^q must have a unit last stride"),
        (dict(q=torch.randn(8, 3, D).to(BF), k=torch.randn(8, 2, D).to(BF), v=torch.randn(8, 2, D).to(BF)), ValueError,
         "multiple"),
        (dict(cu_seqlens_q=cq.float()), TypeError, "cu_seqlens_q"),
        (dict(cu_seqlens_q=cq.long()), TypeError, "^cu_seqlens_k must have cu_seqlens_q's dtype"),
        (dict(cu_seqlens_k=ck[None]), ValueError, "cu_seqlens_k"),
        (dict(cu_seqlens_k=torch.tensor([0, 4, 8], dtype=torch.int32)), ValueError, "cu_seqlens_k"),
        (dict(cu_seqlens_q=torch.zeros(0, dtype=torch.int32)), ValueError, "cu_seqlens_q"),
        (dict(max_seqlen_k=True), TypeError, "max_seqlen_k"),
        (dict(max_seqlen_k=torch.tensor(8)), TypeError, "max_seqlen_k"),
        (dict(max_seqlen_k=-1), ValueError, "max_seqlen_k"),
        (dict(max_seqlen_k=8.0), TypeError, "max_seqlen_k"),
        (dict(softmax_scale="0.1"), TypeError, "softmax_scale"),
        (dict(softmax_scale=float("nan")), ValueError, "softmax_scale"),
        (dict(return_lse=1), TypeError, "return_lse"),
        (dict(q=q.float().numpy()), TypeError, "^q must be a torch.Tensor"),
        # every tensor on q's device (meta stands in for another GPU on a CPU machine)
        (dict(k=k.to("meta")), ValueError, "^k is on meta but q is on cpu"),
        (dict(v=v.to("meta")), ValueError, "^v is on meta but q is on cpu"),
        (dict(cu_seqlens_k=ck.to("meta")), ValueError, "^cu_seqlens_k is on meta but q is on cpu"),
    ]
    return ok, cases


def test_rejected_operands(monkeypatch):
    monkeypatch.setattr(ops, "gqa_forward", lambda *a, **k: pytest.fail("launched"))
    monkeypatch.setattr(ops, "gqa_backward", lambda *a, **k: pytest.fail("launched"))
    ok, cases = _bad_calls()
    for change, err, match in cases:
        kw = dict(ok)
        kw.update(change)
        extra = {n: kw.pop(n) for n in ("softmax_scale", "return_lse") if n in kw}
        args = [kw.pop(n) for n in ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k")]
        with pytest.raises(err, match=match):
            decl.varlen_gqa_attention(*args, **kw, **extra)
    with pytest.raises(TypeError):
        decl.varlen_gqa_attention(ok["q"], ok["k"], ok["v"], ok["cu_seqlens_q"], ok["cu_seqlens_k"], 8)


def test_demo_rows():
    rows = assert_demo_passes(decl.OP, "cpu")
    assert {r["tensor"] for r in rows} == {"out", "dq", "dk", "dv"}


def test_paired_key_tiles_same_bits(monkeypatch):
    """dK/dV with paired key tiles (i, n-1-i per program) and with one tile per program: the same bits, padding rows
    0; odd and even tile counts, L_k != L_q, an empty segment; "auto" needs max_seqlen_k and near-equal documents."""
    arch = ops.INTERPRETER_ARCH
    inp = _inputs([37, 0, 16, 21], [45, 0, 16, 9], 4, 2, pad_q=5, pad_k=7, seed=13)
    q, k, v, do, cq, ck = inp
    got = {}
    for pair in (True, False):
        monkeypatch.setitem(ops.CONFIGS, arch, dict(ops.CONFIGS[arch], dkdv=dict(ops.CONFIGS[arch]["dkdv"],
                                                                                  PAIR=pair)))
        out, lse = ops.gqa_forward(q, k, v, cq, ck, D ** -0.5)
        got[pair] = ops.gqa_backward(do, q, k, v, out, lse, cq, ck, D ** -0.5, "det")
    for x, y in zip(got[True], got[False]):
        assert torch.equal(x, y)
    assert torch.equal(got[True][1][70:], torch.zeros_like(got[True][1][70:]))
    _check(inp, _run(*inp))
    c = ops.CONFIGS[arch]["dkdv"]
    assert not ops._use_pair("auto", 4, 100, None, 2, 2, None, c)  # no max_seqlen_k
    assert not ops._use_pair("auto", 4, 100, 60, 2, 2, None, c)  # documents far from equal
    assert ops._use_pair(True, 1, 10, None, 1, 1, None, c) and not ops._use_pair(False, 4, 64, 16, 1, 1, None, c)
    # the schedule model at the sm_90a blocks on 132 SMs (H200): 16 x 2048 with 3 query heads over 1 pairs (measured
    # -7.5 % dK/dV), 16 over 2 and 24 over 4 do not (measured +1 % and +7 % paired)
    assert ops._order_gain("pair", 16, 2048, 1, 3, 132, 64, 128) < ops.configs.PAIR_GAIN
    assert ops._order_gain("pair", 16, 2048, 2, 8, 132, 64, 128) > ops.configs.PAIR_GAIN
    assert ops._order_gain("pair", 16, 2048, 4, 6, 132, 64, 128) > ops.configs.PAIR_GAIN


def test_round_order_choice():
    """ROUND (Gluon dK/dV launch order, never the bits): needs max_seqlen_k and two segments; "auto" only on
    near-equal documents where the schedule model gains enough. At the sm_90a blocks on 132 SMs (H200): 16 x 2048 with
    16/2, 8/1 and 3/1 query/kv heads take rounds (measured -3.5, -16, -15 % dK/dV), 24/4 and 4 x 8192 with 32/4 do not
    (measured +10 and +5 % in rounds)."""
    from miles_ext_kernels.cake._impl.gqa import ops

    c = dict(BM=64, BN=64)
    assert not ops._use_round(True, 4, 100, None, 2, 2, None, c)
    assert not ops._use_round(True, 1, 100, 100, 2, 2, None, c)
    assert ops._use_round(True, 2, 100, 50, 1, 1, None, c) and not ops._use_round(False, 2, 100, 50, 1, 1, None, c)
    assert not ops._use_round("auto", 4, 100, 60, 2, 2, None, c)  # documents far from equal
    for h_kv, group in ((2, 8), (1, 8), (1, 3)):
        assert ops._order_gain("round", 16, 2048, h_kv, group, 132, 64, 64) < ops.configs.ROUND_GAIN
    assert ops._order_gain("round", 16, 2048, 4, 6, 132, 64, 64) > ops.configs.ROUND_GAIN
    assert ops._order_gain("round", 4, 8192, 4, 8, 132, 64, 64) > ops.configs.ROUND_GAIN


def test_gluon_forward_route_condition():
    """Which operands the sm_90a Gluon forward takes (shapes and strides only; the kernel itself runs on the GPU):
    contiguous and packed-QKV views yes; a head stride other than D, an expanded (token stride 0) k, or no tokens no."""
    D = 256
    q, k = torch.zeros(10, 4, D), torch.zeros(12, 2, D)
    assert ops._gluon_fwd_fits(q, k, k)
    qkv = torch.zeros(10, 4 + 2 * 2, D)
    assert ops._gluon_fwd_fits(qkv[:, :4], qkv[:, 4:6], qkv[:, 6:])
    assert not ops._gluon_fwd_fits(torch.zeros(10, 4, 2 * D)[:, :, :D], k, k)
    assert not ops._gluon_fwd_fits(q, torch.zeros(1, 2, D).expand(12, 2, D), k)
    assert not ops._gluon_fwd_fits(torch.zeros(0, 4, D), k, k)
    assert not ops._gluon_fwd_fits(q, torch.zeros(0, 2, D), torch.zeros(0, 2, D))
    assert ops._gluon_fwd_fits(torch.zeros(1, 4, D), k, k)  # one token: its token stride is not used


def test_routes_are_the_launchers_launches():
    """routes() runs the launchers on meta tensors (interpreter table here: the Triton kernels): the tile prefix for
    int32 and int64 boundaries, the forward and its second pass, the dQ pass, the dK/dV pass in both PAIR settings;
    all distinct."""
    rs = ops.routes()
    labels = [r.label for r in rs]
    assert len(labels) == len(set(labels)) == 7, labels
    assert sorted(lab.split("[")[0] for lab in labels) == sorted(
        ["tile_prefix_kernel"] * 2 + ["_fwd_kernel", "_fwd_fix_kernel", "_bwd_dq_kernel"] + ["_bwd_dkdv_kernel"] * 2)
    with pytest.raises(TypeError, match="no model parameters"):
        ops.routes(head_dim=256)


def test_torch_compile_fullgraph_one_cu_seqlens_for_both():
    """torch.compile(fullgraph=True) traces the op with one cu_seqlens tensor passed as both cu_seqlens_q and
    cu_seqlens_k (the usual call), forward and backward, with the eager path's values."""
    q, k, v, do, cq, _ = _inputs([9, 20], [9, 20], 2, 1, seed=3)

    def f(q, k, v):
        return decl.varlen_gqa_attention(q, k, v, cq, cq, max_seqlen_k=20)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = f(*leaves)
    ge = torch.autograd.grad(eager, leaves, do)
    leaves2 = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(*leaves2)
    gc = torch.autograd.grad(compiled, leaves2, do)
    assert torch.equal(eager, compiled)
    for a, b in zip(ge, gc):
        assert torch.equal(a, b)
