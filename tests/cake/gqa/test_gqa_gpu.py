"""gqa on the GPU: accuracy vs FP64 within FA2-varlen's error, edges, bits (det and fast), streams, pool, no sync,
checkpointing, CUDA graphs, torch.compile, packing invariance, fresh process, two GPUs."""
import json
import os
import subprocess
import sys
import textwrap
import zlib

import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels.cake import gqa as decl
from miles_ext_kernels.cake._impl.gqa import demo, reference
from miles_ext_kernels.cake._runtime.testing import check_budget, rel_rms
from tests._paths import ROOT

pytestmark = pytest.mark.gpu
BF = torch.bfloat16
D = 256
SCALE = D ** -0.5


def _cu(lens, dev="cuda"):
    return torch.tensor([0] + list(torch.tensor(lens, dtype=torch.int64).cumsum(0)), dtype=torch.int32, device=dev)


def _inputs(lens_q, lens_k, hq, hkv, pad_q=0, pad_k=0, seed=0, dev="cuda"):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q) + pad_q, sum(lens_k) + pad_k
    q = torch.randn(tq, hq, D, generator=g).to(dev, BF)
    k = torch.randn(tk, hkv, D, generator=g).to(dev, BF)
    v = torch.randn(tk, hkv, D, generator=g).to(dev, BF)
    do = torch.randn(tq, hq, D, generator=g).to(dev, BF)
    return q, k, v, do, _cu(lens_q, dev), _cu(lens_k, dev)


def _run(q, k, v, do, cq, ck, max_k=None):
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    if max_k is None:
        max_k = k.shape[0]
    out, lse = decl.varlen_gqa_attention(qr, kr, vr, cq, ck, max_seqlen_k=max_k, return_lse=True)
    dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), do)
    return out.detach(), lse, dq, dk, dv


def _fa2(q, k, v, do, cq, ck, lens_q, lens_k):
    mq, mk = max(lens_q), max(lens_k)
    res = torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, mq, mk, 0.0, True, False, scale=SCALE)
    o, lse, seed, off = res[0], res[1], res[2], res[3]
    dq, dk, dv = torch.ops.aten._flash_attention_backward(do, q, k, v, o, lse, cq, ck, mq, mk, 0.0, True, seed, off,
                                                          scale=SCALE)
    return o, dq, dk, dv


def _seen_rows(lens_q, lens_k, dev="cuda"):
    rows = []
    for lq, lk in zip(lens_q, lens_k):
        i = torch.arange(lq)
        rows.append(i + (lk - lq) >= 0)
    return torch.cat(rows).to(dev)


LAYOUTS = [
    ("ratio 8, 3 docs", [512, 300, 1000], [512, 300, 1000], 16, 2),
    ("ratio 3 (TP-8 rank), irregular", [777, 64, 1200, 1], [777, 64, 1200, 1], 3, 1),
    ("ratio 8/1", [256] * 4, [256] * 4, 8, 1),
    ("ratio 1", [1024, 100], [1024, 100], 2, 2),
    ("L_k < L_q", [600, 300], [200, 300], 4, 2),
    ("L_k > L_q", [200, 129], [700, 300], 6, 2),
]


@pytest.mark.parametrize("name,lq,lk,hq,hkv", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_accuracy_vs_fa2(name, lq, lk, hq, hkv):
    # crc32, not hash(): str hash() changes per process
    q, k, v, do, cq, ck = _inputs(lq, lk, hq, hkv, seed=zlib.crc32(name.encode()) % 1000)
    out, lse, dq, dk, dv = _run(q, k, v, do, cq, ck)
    ro, rl, rdq, rdk, rdv = reference.reference_grads(q, k, v, cq, ck, do)
    po, pdq, pdk, pdv = _fa2(q, k, v, do, cq, ck, lq, lk)
    seen = _seen_rows(lq, lk)  # FA2 is compared on rows that see a key; ours must give exact zeros elsewhere
    for tname, got, peer, ref, rows in (("out", out, po, ro, seen), ("dq", dq, pdq, rdq, seen),
                                        ("dk", dk, pdk, rdk, None), ("dv", dv, pdv, rdv, None)):
        sel = (lambda t: t[rows]) if rows is not None else (lambda t: t)  # noqa: E731
        budget = 1.1 * rel_rms(sel(peer), sel(ref))
        check_budget(f"{name}/{tname}", sel(got), sel(ref), budget)
    assert torch.equal(out[~seen], torch.zeros_like(out[~seen])) and torch.equal(dq[~seen], torch.zeros_like(dq[~seen]))
    lse, rl = lse.double().cpu(), rl.double().cpu()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(rl))
    fin = torch.isfinite(rl)
    assert torch.allclose(lse[fin], rl[fin], atol=2e-4, rtol=0)


def test_padding_empty_segments_and_empty_calls():
    inp = _inputs([300, 0, 129, 0], [300, 0, 129, 0], 4, 1, pad_q=200, pad_k=77, seed=1)
    out, lse, dq, dk, dv = _run(*inp)
    ro, rl, rdq, rdk, rdv = reference.reference_grads(*inp[:3], inp[4], inp[5], inp[3])
    for name, g, r in (("out", out, ro), ("dq", dq, rdq), ("dk", dk, rdk), ("dv", dv, rdv)):
        check_budget(name, g, r, 1.0e-2)
    assert torch.equal(out[429:], torch.zeros_like(out[429:])) and torch.isneginf(lse[:, 429:]).all()
    assert torch.equal(dq[429:], torch.zeros_like(dq[429:])) and torch.equal(dk[429:], torch.zeros_like(dk[429:]))
    assert torch.equal(dv[429:], torch.zeros_like(dv[429:]))
    for lq, lk in (([0], [5]), ([6], [0]), ([], [])):
        inp = _inputs(lq, lk, 2, 1, seed=5)
        out, lse, dq, dk, dv = _run(*inp, max_k=8)
        assert torch.equal(out, torch.zeros_like(out)) and torch.equal(dk, torch.zeros_like(dk))
        assert torch.equal(dq, torch.zeros_like(dq)) and torch.equal(dv, torch.zeros_like(dv))


def test_strided_views_of_packed_qkv():
    g = torch.Generator().manual_seed(6)
    lens, hq, hkv = [700, 333], 6, 2
    qkv = torch.randn(sum(lens), hq + 2 * hkv, D, generator=g).to("cuda", BF)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    do = torch.randn(sum(lens), hq, D, generator=g).to("cuda", BF)
    cu = _cu(lens)
    a = _run(q, k, v, do, cu, cu)
    b = _run(q.contiguous(), k.contiguous(), v.contiguous(), do, cu, cu)
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    qq = q.detach().requires_grad_()
    out = decl.varlen_gqa_attention(qq, k, v, cu, cu, max_seqlen_k=700)  # in place: views are read as they are
    assert torch.equal(out, a[0])


def test_rejected_operands_gpu():
    q, k, v, do, cq, ck = _inputs([64], [64], 2, 1)
    with pytest.raises(ValueError, match="^cu_seqlens_q is on cpu but q is on cuda"):
        decl.varlen_gqa_attention(q, k, v, cq.cpu(), ck, max_seqlen_k=64)
    with pytest.raises(ValueError, match="^k is on cpu but q is on cuda"):
        decl.varlen_gqa_attention(q, k.cpu(), v, cq, ck, max_seqlen_k=64)
    with pytest.raises(TypeError, match="max_seqlen_k"):
        decl.varlen_gqa_attention(q, k, v, cq, ck, max_seqlen_k=torch.tensor(64))


def _bits(variant, layout=([900, 400, 1], 8, 2), seed=7, max_k=None, stream=None):
    mek.configure(gqa_variant=variant)
    lens, hq, hkv = layout
    inp = _inputs(lens, lens, hq, hkv, pad_q=50, pad_k=50, seed=seed)
    if stream is None:
        return _run(*inp, max_k=max_k)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        r = _run(*inp, max_k=max_k)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    return r


def _equal(a, b, names=("out", "lse", "dq", "dk", "dv"), skip=()):
    for n, x, y in zip(names, a, b):
        if n not in skip:
            assert torch.equal(x, y), n


def test_det_bits_repeat_streams_pool_max_seqlen():
    ref = _bits("det")
    _equal(ref, _bits("det"))
    _equal(ref, _bits("det", stream=torch.cuda.Stream()))
    for mk in (900, 4096, 1401):
        _equal(ref, _bits("det", max_k=mk))
    mek.configure(gqa_variant="det", workspace_pool_bytes=1 << 30)
    _run(*_inputs([4000], [4000], 8, 2, seed=3))  # a larger call sizes the pooled buffer first
    inp = _inputs([900, 400, 1], [900, 400, 1], 8, 2, pad_q=50, pad_k=50, seed=7)
    _equal(ref, _run(*inp))
    _equal(ref, _run(*inp))


def test_fast_bits_repeat():
    a = _bits("fast")
    b = _bits("fast")
    _equal(a, b, skip=("dq",))
    assert rel_rms(a[2], b[2]) < 1e-2


def test_packing_invariance():
    g = torch.Generator().manual_seed(9)
    hq, hkv, L = 6, 2, 1000
    doc = [torch.randn(L, h, D, generator=g).to("cuda", BF) for h in (hq, hkv, hkv, hq)]
    ref = None
    for before, after in ((0, 0), (0, 700), (333, 0), (129, 2048)):
        parts = [torch.cat([torch.randn(before, h, D, generator=g).to("cuda", BF), d,
                            torch.randn(after + 17, h, D, generator=g).to("cuda", BF)])
                 for d, h in zip(doc, (hq, hkv, hkv, hq))]
        lens = [n for n in (before, L, after) if n]
        cu = _cu(lens)
        out, lse, dq, dk, dv = _run(*parts, cu, cu, max_k=max(lens))
        s = before
        got = (out[s:s + L], lse[:, s:s + L], dq[s:s + L], dk[s:s + L], dv[s:s + L])
        if ref is None:
            ref = got
        else:
            _equal(ref, got)


def test_gluon_forward_matches_triton_forward_bits(monkeypatch):
    """The sm_90a forward runs the Gluon kernel (a loader warp and one partition per 64-row warpgroup); the Triton
    kernel remains the route for operands whose heads are not contiguous within a row. Both give the same out and LSE
    bits, on edge layouts: padding rows, an empty segment, fewer keys than queries (and more), partial tiles of 1, 63,
    64, 65 and 127 rows (warpgroup 1 with no valid row; warpgroup 0 stopping a key block early, or running none while
    warpgroup 1 runs one: 200 queries over 100 keys), partial key blocks (warpgroup 1 zeroes V's rows past the keys
    for both), NaN in the padding rows of q, k, v (past cu_seqlens[-1]: the Gluon kernel reads them by TMA and must
    not let them reach a real row)."""
    from miles_ext_kernels.cake._impl.gqa import ops

    for hq, hkv, lens_q, lens_k in ((6, 2, [200, 0, 129, 64, 700, 1], [50, 10, 300, 64, 700, 1]),
                                    (3, 1, [1, 63, 64, 65, 127, 128, 191, 200], [1, 100, 64, 70, 127, 128, 150, 100])):
        q, k, v, _, cq, ck = _inputs(lens_q, lens_k, hq, hkv, pad_q=77, pad_k=40, seed=23)
        q[sum(lens_q):] = float("nan")
        k[sum(lens_k):] = float("nan")
        v[sum(lens_k):] = float("nan")
        assert ops.G is not None and ops._gluon_fwd_fits(q, k, v)  # the Gluon route is the one under test
        spy = _Launches(ops.G.fwd_kernel)
        monkeypatch.setattr(ops.G, "fwd_kernel", spy)
        gl_out, gl_lse = ops.gqa_forward(q, k, v, cq, ck, SCALE)
        assert spy.count == 1
        triton_cfg = {key: val for key, val in ops.CONFIGS["sm_90a"].items() if key != "fwd_gluon"}
        tr_out, tr_lse = ops.gqa_forward(q, k, v, cq, ck, SCALE, cfg=triton_cfg)
        assert spy.count == 1
        assert torch.equal(gl_out, tr_out) and torch.equal(gl_lse, tr_lse)
        # the short-document route (the self-loading 64-row kernel), taken by max_seqlen_k alone (the kernels read
        # every key block whatever it says), and the loader-warp kernel at 64-row tiles (one and two K / V stages):
        # same bits
        short = ops.configs.SHORT_MAX_SEQLEN_K
        spy_short = _Launches(ops.G.fwd_short_kernel)
        monkeypatch.setattr(ops.G, "fwd_short_kernel", spy_short)
        sh_out, sh_lse = ops.gqa_forward(q, k, v, cq, ck, SCALE, max_seqlen_k=short)
        assert spy.count == 1 and spy_short.count == 1 and spy_short.constexprs["BM"] == 64
        assert torch.equal(sh_out, gl_out) and torch.equal(sh_lse, gl_lse)
        ops.gqa_forward(q, k, v, cq, ck, SCALE, max_seqlen_k=short + 1)
        assert spy.count == 2 and spy.constexprs["BM"] == 128 and spy_short.count == 1
        for stages in (1, 2):
            bm64 = dict(ops.CONFIGS["sm_90a"], fwd=ops.CONFIGS["sm_90a"]["fwd_short"],
                        fwd_gluon=dict(BM=64, BN=64, STAGES=stages, num_warps=4, maxnreg=168))
            s_out, s_lse = ops.gqa_forward(q, k, v, cq, ck, SCALE, cfg=bm64)
            assert spy.constexprs["BM"] == 64 and spy.constexprs["STAGES"] == stages
            assert torch.equal(s_out, gl_out) and torch.equal(s_lse, gl_lse)
        assert bool(gl_out.isfinite().all())
        assert torch.equal(gl_out[sum(lens_q):], torch.zeros_like(gl_out[sum(lens_q):]))
        # a head stride other than D: the Triton route, same bits
        wide = torch.zeros(q.shape[0], q.shape[1], 2 * D, dtype=BF, device="cuda")
        wide[:, :, :D] = q
        assert not ops._gluon_fwd_fits(wide[:, :, :D], k, v)
        st_out, st_lse = ops.gqa_forward(wide[:, :, :D], k, v, cq, ck, SCALE)
        assert torch.equal(st_out, gl_out) and torch.equal(st_lse, gl_lse)
        ref_out, ref_lse = reference.varlen_gqa_reference(q, k, v, cq, ck, SCALE)
        seen = torch.isfinite(ref_lse)
        assert torch.equal(seen, torch.isfinite(gl_lse))
        assert rel_rms(gl_out[:sum(lens_q)], ref_out[:sum(lens_q)]) < 1e-2
        monkeypatch.undo()


def _seen_by(lens_q, lens_k, doc, j, hq, heads):
    """[T_q, H_q]: the rows of document `doc` that see its key j (j <= i + L_k - L_q), in the query heads `heads`."""
    seen = torch.zeros(sum(lens_q), hq, dtype=torch.bool)
    q0, L_q, L_k = sum(lens_q[:doc]), lens_q[doc], lens_k[doc]
    seen[q0:q0 + L_q, heads] = (j <= torch.arange(L_q) + (L_k - L_q))[:, None]
    return seen.cuda()


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("name", ["v", "k", "q"])
def test_nonfinite_token_reaches_only_the_rows_that_see_it(name, value):
    """A NaN or an inf in q, k or v at one token reaches only the rows that see it, on the Gluon forward and on the
    Triton one (a head stride other than D): every other row, earlier rows of its document and block included, and
    the other documents and kv head keep the bits of the run without it; the rows that see it are non-finite (v:
    each one; q, k: where the FP64 reference is); v leaves LSE as it was. Tokens on a warpgroup's diagonal key block
    (document 0, key 212: rows 192-211 of the tile's second warpgroup mask it out), in a document with 33 more keys
    than queries (a warpgroup with two masked key blocks; and at its key 5, which document 0's last key block reads by
    TMA), and in the last document's diagonal block, with NaN in the padding rows past the last document as well
    (read by TMA, zeroed before P V)."""
    from miles_ext_kernels.cake._impl.gqa import ops

    lens_q, lens_k, hq, hkv = [300, 200, 129], [300, 233, 129], 6, 2
    q, k, v, _, cq, ck = _inputs(lens_q, lens_k, hq, hkv, pad_q=40, pad_k=40, seed=26)
    for t, n in ((q, sum(lens_q)), (k, sum(lens_k)), (v, sum(lens_k))):
        t[n:] = float("nan")
    T = sum(lens_q)

    def routes(x):
        wide = torch.zeros(q.shape[0], hq, 2 * D, dtype=BF, device="cuda")
        wide[:, :, :D] = x["q"]
        assert ops._gluon_fwd_fits(x["q"], x["k"], x["v"]) and not ops._gluon_fwd_fits(wide[:, :, :D], k, v)
        return [(out[:T], lse[:, :T]) for out, lse in (ops.gqa_forward(x["q"], x["k"], x["v"], cq, ck, SCALE),
                                                       ops.gqa_forward(wide[:, :, :D], x["k"], x["v"], cq, ck, SCALE))]

    clean = routes({"q": q, "k": k, "v": v})
    for doc, j in ((0, 212), (1, 100), (1, 5), (2, 100)):
        x = {"q": q.clone(), "k": k.clone(), "v": v.clone()}
        row = (sum(lens_q[:doc]) if name == "q" else sum(lens_k[:doc])) + j
        x[name][row, 1, 77] = value  # query head 1, or kv head 1 (query heads 3-5)
        if name == "q":
            seen = torch.zeros(T, hq, dtype=torch.bool, device="cuda")
            seen[row, 1] = True
        else:
            seen = _seen_by(lens_q, lens_k, doc, j, hq, slice(3, 6))
        got = routes(x)
        ref_bad = None
        if name != "v":
            ref_out, _ = reference.varlen_gqa_reference(x["q"], x["k"], x["v"], cq, ck, SCALE)
            ref_bad = ~torch.isfinite(ref_out[:T]).all(-1)
        for (out, lse), (out0, lse0) in zip(got, clean):
            bad = ~torch.isfinite(out).all(-1)
            assert not bad[~seen].any(), (doc, bad.nonzero().tolist()[:8])
            assert torch.equal(out[~seen], out0[~seen]) and torch.equal(lse.T[~seen], lse0.T[~seen]), doc
            if name == "v":
                assert bad[seen].all() and torch.equal(lse, lse0), doc
            else:
                assert torch.equal(bad, ref_bad), doc
        assert torch.equal(torch.isfinite(got[0][0]), torch.isfinite(got[1][0]))  # both routes: the same entries


class _Launches:
    """Stands in for a kernel in `kernel[grid](...)`: counts the launches, keeps the last one's keyword arguments."""

    def __init__(self, kernel):
        self.kernel, self.count, self.constexprs = kernel, 0, {}

    def __getitem__(self, grid):
        self.count += 1

        def run(*args, **kwargs):
            self.constexprs = kwargs
            return self.kernel[grid](*args, **kwargs)

        return run


def test_gluon_backward_matches_triton_kernels(monkeypatch):
    """The sm_90a backward runs the Gluon dQ and dK/dV passes (gluon_bwd.py); the Triton kernels remain the route for
    operands whose heads are not contiguous within a row. Given the same delta, the Gluon dK/dV pass gives the Triton
    dK/dV kernel's bits; the Gluon dQ pass reduces delta in another order, so its dQ matches the Triton one closely, not
    bitwise. Edge layouts: NaN in the padding rows of q, k, v, dO and out (read by TMA, must not reach a real row), an
    empty segment, fewer keys than queries, partial query and key tiles, 3 query heads over 1. The dQ pass's
    short-document route (64-row tiles) gives the 128-row route's bits."""
    from miles_ext_kernels.cake._impl.gqa import ops

    for hq, hkv, lens_q, lens_k in ((6, 2, [200, 0, 129, 64, 700, 1], [50, 10, 300, 64, 700, 1]),
                                    (3, 1, [1, 2, 127, 128, 129, 255], [1, 2, 127, 128, 129, 255])):
        q, k, v, do, cq, ck = _inputs(lens_q, lens_k, hq, hkv, pad_q=77, pad_k=40, seed=24)
        out, lse = ops.gqa_forward(q, k, v, cq, ck, SCALE)
        for t, n in ((q, sum(lens_q)), (do, sum(lens_q)), (out, sum(lens_q)), (k, sum(lens_k)), (v, sum(lens_k))):
            t[n:] = float("nan")
        assert ops.GB is not None and ops._gluon_bwd_fits(q, k, v, do)  # the Gluon routes are the ones under test
        full = ops.CONFIGS["sm_90a"]
        gluon_dq_only = {key: val for key, val in full.items() if key != "dkdv_gluon"}
        triton_only = {key: val for key, val in gluon_dq_only.items() if key != "dq_gluon"}
        spies = {name: _Launches(getattr(ops.GB, name)) for name in ("dq_kernel", "dkdv_kernel")}
        for name, spy in spies.items():
            monkeypatch.setattr(ops.GB, name, spy)
        g = ops.gqa_backward(do, q, k, v, out, lse, cq, ck, SCALE, "det", cfg=full)
        assert spies["dq_kernel"].count == 1 and spies["dkdv_kernel"].count == 1
        m = ops.gqa_backward(do, q, k, v, out, lse, cq, ck, SCALE, "det", cfg=gluon_dq_only)
        t = ops.gqa_backward(do, q, k, v, out, lse, cq, ck, SCALE, "det", cfg=triton_only)
        assert spies["dq_kernel"].count == 2 and spies["dkdv_kernel"].count == 1
        # the dQ pass's short-document route (64-row tiles, 32-key blocks), taken by max_seqlen_k alone: same bits
        short = ops.configs.SHORT_DQ_MAX_SEQLEN_K
        s = ops.gqa_backward(do, q, k, v, out, lse, cq, ck, SCALE, "det", cfg=full, max_seqlen_k=short)
        assert spies["dq_kernel"].count == 3 and spies["dq_kernel"].constexprs["BM"] == 64
        _equal(g, s, names=("dq", "dk", "dv"))
        ops.gqa_backward(do, q, k, v, out, lse, cq, ck, SCALE, "det", cfg=full, max_seqlen_k=short + 1)
        assert spies["dq_kernel"].count == 4 and spies["dq_kernel"].constexprs["BM"] == 128
        monkeypatch.undo()
        assert torch.equal(g[1], m[1]) and torch.equal(g[2], m[2])  # dK, dV: Gluon pass == Triton kernel
        assert rel_rms(g[0][:sum(lens_q)], t[0][:sum(lens_q)]) < 1e-4
        for got, n in ((g[0], sum(lens_q)), (g[1], sum(lens_k)), (g[2], sum(lens_k))):
            assert bool(got.isfinite().all()) and torch.equal(got[n:], torch.zeros_like(got[n:]))


def test_gluon_dkdv_round_order_same_bits():
    """The Gluon dK/dV pass in ROUND order (tile j of every segment before tile j + 1 of any; picked per call on
    near-equal documents) and segment by segment give the same bits; padding rows 0; a larger max_seqlen_k only adds
    programs that do nothing, and an understated one (a broken contract) still gives the same dK/dV: the per-tile
    programs after the rounds cover the tiles the rounds missed."""
    from miles_ext_kernels.cake._impl.gqa import ops

    lens_q, lens_k = [640, 600, 0, 700], [640, 650, 0, 700]
    q, k, v, do, cq, ck = _inputs(lens_q, lens_k, 8, 2, pad_q=30, pad_k=50, seed=25)
    out, lse = ops.gqa_forward(q, k, v, cq, ck, SCALE)
    got = []
    for rounds, max_k in ((True, 700), (True, 2000), (True, 300), (False, 700)):
        c = dict(ops.CONFIGS["sm_90a"])
        c["dkdv_gluon"] = dict(c["dkdv_gluon"], ROUND=rounds)
        assert ops._use_round(c["dkdv_gluon"]["ROUND"], 4, k.shape[0], max_k, 2, 4, q.device, c["dkdv_gluon"]) \
            == rounds
        got.append(ops.gqa_backward(do, q, k, v, out, lse, cq, ck, SCALE, "det", cfg=c, max_seqlen_k=max_k))
    for other in got[1:]:
        _equal(got[0], other, names=("dq", "dk", "dv"))
    dk = got[0][1]
    assert bool(dk.isfinite().all()) and torch.equal(dk[sum(lens_k):], torch.zeros_like(dk[sum(lens_k):]))


def test_paired_key_tiles_same_bits(monkeypatch):
    """The Triton dK/dV kernel (the route for operands the Gluon pass cannot read) with paired key tiles (i, n-1-i per
    program: chosen per call on near-equal documents) and with one tile per program give the same bits at the sm_90a
    blocks; padding rows 0; and "auto" on near-equal documents."""
    from miles_ext_kernels.cake._impl.gqa import ops

    triton_dkdv = {key: val for key, val in ops.CONFIGS["sm_90a"].items() if key != "dkdv_gluon"}
    lens_q, lens_k = [700, 300, 0, 513], [700, 300, 0, 600]
    inp = _inputs(lens_q, lens_k, 8, 2, pad_q=100, pad_k=70, seed=21)
    got = {}
    for pair in (True, False):
        monkeypatch.setitem(ops.CONFIGS, "sm_90a", dict(triton_dkdv, dkdv=dict(triton_dkdv["dkdv"], PAIR=pair)))
        got[pair] = _run(*inp, max_k=max(lens_k))
    _equal(got[True], got[False])
    dk = got[True][3]
    assert torch.equal(dk[sum(lens_k):], torch.zeros_like(dk[sum(lens_k):])) and bool(dk.isfinite().all())
    monkeypatch.undo()
    uni = _inputs([1024] * 16, [1024] * 16, 3, 1, seed=22)
    assert ops._use_pair("auto", 16, 16 * 1024, 1024, 1, 3, "cuda", triton_dkdv["dkdv"])  # "auto" pairs here
    monkeypatch.setitem(ops.CONFIGS, "sm_90a", triton_dkdv)
    a = _run(*uni, max_k=1024)
    monkeypatch.setitem(ops.CONFIGS, "sm_90a", dict(triton_dkdv, dkdv=dict(triton_dkdv["dkdv"], PAIR=False)))
    _equal(a, _run(*uni, max_k=1024))


def test_no_sync():
    inp = _inputs([700, 300], [700, 300], 4, 2, seed=10)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in inp[:3])
    _run(*inp)  # warm (compile outside the guard)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = decl.varlen_gqa_attention(qr, kr, vr, inp[4], inp[5], max_seqlen_k=700)
        out.backward(inp[3])
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_checkpoint_compile_and_graph():
    inp = _inputs([500, 211], [500, 211], 4, 1, seed=11)
    q, k, v, do, cq, ck = inp
    ref = _run(*inp)

    def f(q, k, v):
        return decl.varlen_gqa_attention(q, k, v, cq, ck, max_seqlen_k=500, return_lse=True)

    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = torch.utils.checkpoint.checkpoint(f, qr, kr, vr, use_reentrant=False)
    out.backward(do)
    _equal(ref, (out.detach(), lse, qr.grad, kr.grad, vr.grad))

    cf = torch.compile(f, fullgraph=True)
    qr, kr, vr = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, lse = cf(qr, kr, vr)
    out.backward(do)
    _equal(ref, (out.detach(), lse, qr.grad, kr.grad, vr.grad))

    sq, sk, sv = (t.detach().clone().requires_grad_() for t in (q, k, v))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on the capture stream
        for _ in range(2):
            o, _ = f(sq, sk, sv)
            torch.autograd.grad(o, (sq, sk, sv), do)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        go, glse = f(sq, sk, sv)
        gq, gk, gv = torch.autograd.grad(go, (sq, sk, sv), do)
    graph.replay()
    torch.cuda.synchronize()
    _equal(ref, (go, glse, gq, gk, gv))


def _fresh_bits_script(path, device="cuda:0"):
    return textwrap.dedent(f"""
        import torch
        torch.cuda.set_device({device!r})
        from tests.cake.gqa.test_gqa_gpu import _bits
        torch.save([t.cpu() for t in _bits("det")], {path!r})
    """)


def test_det_bits_fresh_process(tmp_path):
    ref = [t.cpu() for t in _bits("det")]
    path = str(tmp_path / "bits.pt")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", _fresh_bits_script(path)], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    _equal(ref, torch.load(path))


@pytest.mark.multi_gpu
def test_det_bits_two_gpus():
    """Same bits on cuda:0 and cuda:1; the second call's tensors sit on cuda:1 while cuda:0 is current."""
    a = [t.cpu() for t in _bits("det")]
    assert torch.cuda.current_device() == 0
    mek.configure(gqa_variant="det")
    lens, hq, hkv = [900, 400, 1], 8, 2
    inp = _inputs(lens, lens, hq, hkv, pad_q=50, pad_k=50, seed=7, dev="cuda:1")
    b = [t.cpu() for t in _run(*inp)]
    _equal(a, b)


def test_demo_rows():
    rows = demo("cuda")
    assert rows and all(r["ok"] for r in rows), rows
    print(json.dumps(rows))
