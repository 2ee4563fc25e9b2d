"""Benchmark of `gqa` (packed causal GQA attention, head dim 256, bf16) against its peers, in one run.

Peers: torch's FlashAttention-2 varlen ops, FlexAttention with a document-causal block mask (skip with --no-flex),
cuDNN SDPA on equal-length dense batches. TFLOP/s by the FlashAttention convention (causal fwd = 2 L^2 H D per
segment, bwd = 2.5 x fwd). Times: `median_ms` (one sync per call, the host's launch path included); the forward also
in device time (`device_ms`: the host's work hidden behind a GPU spin) for us, FA2 and cuDNN. Prints a table; writes
bench/results/gqa.json.

    python bench/gqa.py [--no-flex] [--only NAME] [--tune]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import device_ms, median_ms, print_table, write_results  # noqa: E402

D = 256
SCALE = D ** -0.5


def irregular_lengths():
    """The irregular layout of ANCHORS.md (same generator)."""
    g = torch.Generator().manual_seed(1)
    lens, tot = [], 0
    while tot < 32768:
        L = int(torch.randint(64, 8192, (1,), generator=g))
        L = min(L, 32768 - tot)
        lens.append(L)
        tot += L
    return lens


def layouts():
    return {
        "16x2048 Hq16/Hkv2": ([2048] * 16, 16, 2),
        "16x2048 Hq8/Hkv1": ([2048] * 16, 8, 1),
        "12 irregular docs Hq24/Hkv4": (irregular_lengths(), 24, 4),
        "1x32768 Hq16/Hkv2": ([32768], 16, 2),
        "256x128 Hq16/Hkv2": ([128] * 256, 16, 2),
        "4x8192 Hq32/Hkv4": ([8192] * 4, 32, 4),
        "16x2048 Hq24/Hkv4 (Qwen3.5-27B)": ([2048] * 16, 24, 4),
        "16x2048 Hq3/Hkv1 (27B, TP-8 rank)": ([2048] * 16, 3, 1),
    }


def fwd_flops(lens, hq):
    return sum(2.0 * L * L * hq * D for L in lens)


def make(lens, hq, hkv, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, hkv, D, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(T, hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device="cuda", dtype=torch.int32)
    return q, k, v, do, cu


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


def ours(lens, hq, hkv, variant, cfg=None, fused=None):
    from miles_ext_kernels.cake._impl.gqa import ops

    q, k, v, do, cu = make(lens, hq, hkv)
    out, lse = ops.gqa_forward(q, k, v, cu, cu, SCALE, cfg)
    tf = median_ms(lambda: ops.gqa_forward(q, k, v, cu, cu, SCALE, cfg))
    ours.fwd_device = device_ms(lambda: ops.gqa_forward(q, k, v, cu, cu, SCALE, cfg))
    # max_seqlen_k as the public entry point passes it (it lets the dK/dV grid run in rounds)
    tb = median_ms(lambda: ops.gqa_backward(do, q, k, v, out, lse, cu, cu, SCALE, variant, cfg, fused,
                                            max_seqlen_k=max(lens)))
    ours.bwd_device = device_ms(lambda: ops.gqa_backward(do, q, k, v, out, lse, cu, cu, SCALE, variant, cfg, fused,
                                                         max_seqlen_k=max(lens)))
    grads = ops.gqa_backward(do, q, k, v, out, lse, cu, cu, SCALE, variant, cfg, fused, max_seqlen_k=max(lens))
    return tf, tb, (out, lse) + tuple(grads)


def fa2(lens, hq, hkv):
    q, k, v, do, cu = make(lens, hq, hkv)
    L = max(lens)

    def fwd():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, L, L, 0.0, True, False, scale=SCALE)

    res = fwd()
    o, lse, seed, off = res[0], res[1], res[2], res[3]

    def bwd():
        return torch.ops.aten._flash_attention_backward(do, q, k, v, o, lse, cu, cu, L, L, 0.0, True, seed, off,
                                                        scale=SCALE)

    tf, tb = median_ms(fwd), median_ms(bwd)
    fa2.fwd_device, fa2.bwd_device = device_ms(fwd), device_ms(bwd)
    return tf, tb, (o,) + tuple(bwd())


def flex(lens, hq, hkv, limit_s):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    q, k, v, do, cu = make(lens, hq, hkv)
    T = sum(lens)
    doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))

    def mask_mod(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (qi >= ki)

    bm = create_block_mask(mask_mod, 1, 1, T, T, device="cuda")
    fa = torch.compile(flex_attention, dynamic=False)
    qb, kb, vb = (t.transpose(0, 1).unsqueeze(0).requires_grad_() for t in (q, k, v))
    dob = do.transpose(0, 1).unsqueeze(0)
    t0 = time.time()
    fa(qb, kb, vb, block_mask=bm, enable_gqa=True).backward(dob)
    if time.time() - t0 > limit_s:
        raise TimeoutError("flex compile too slow")

    def step():
        o = fa(qb, kb, vb, block_mask=bm, enable_gqa=True)
        torch.autograd.grad(o, (qb, kb, vb), dob)

    tf = median_ms(lambda: fa(qb, kb, vb, block_mask=bm, enable_gqa=True))
    tb = median_ms(step) - tf  # as ANCHORS.md: (forward + backward) - forward
    return tf, tb


def cudnn(lens, hq, hkv):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if len(set(lens)) != 1:
        return None
    B, L = len(lens), lens[0]
    q = torch.randn(B, hq, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(B, hkv, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(B, hkv, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    do = torch.randn(B, hq, L, D, device="cuda", dtype=torch.bfloat16)

    def fwd():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    tf = median_ms(fwd)
    cudnn.fwd_device = device_ms(fwd)
    o = fwd()
    tb = median_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    cudnn.bwd_device = device_ms(lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
    return tf, tb


def row(shape, impl, tf, tb, fl, **kw):
    r = {"shape": shape, "impl": impl, "fwd_ms": tf, "bwd_ms": tb,
         "fwd_tflops": fl / tf / 1e9 if tf else None, "bwd_tflops": 2.5 * fl / tb / 1e9 if tb else None}
    r.update(kw)
    return r


def _device(ms, fl, bwd_ms):
    """Forward and backward in device time (`device_ms`: the host's launch work hidden behind a GPU spin, as in a
    training step whose host runs ahead)."""
    return {"fwd_ms_device": ms, "fwd_tflops_device": fl / ms / 1e9,
            "bwd_ms_device": bwd_ms, "bwd_tflops_device": 2.5 * fl / bwd_ms / 1e9}


def tune(args):
    """Correctness of every candidate config vs an FP64 reference, then timings (one process, one GPU)."""
    from miles_ext_kernels.cake._impl.gqa import ops, reference

    base = ops.CONFIGS["sm_90a"]
    fwd_c = [dict(BM=128, BN=64, num_warps=8, num_stages=2, DIAG_ONLY=True),
             dict(BM=128, BN=64, num_warps=8, num_stages=2, DIAG_ONLY=False),
             dict(BM=128, BN=32, num_warps=8, num_stages=3, DIAG_ONLY=True)]
    dq_c = [dict(BM=128, BN=64, num_warps=8, num_stages=1)]
    kv_c = [dict(BM=128, BN=64, num_warps=8, num_stages=1, S_ROWS=True)]
    small = ([300, 129, 0, 64, 700], 8, 2)
    q, k, v, do, cu = make(*small, seed=3)
    ro, rl, rdq, rdk, rdv = reference.reference_grads(q, k, v, cu, cu, do)
    rows = []

    def cfg_with(**kw):
        c = dict(base)
        c.update(kw)
        return c

    for name, cands in (("fwd", fwd_c), ("dq", dq_c), ("dkdv", kv_c)):
        for cand in cands:
            key = "dkdv" if name.startswith("dkdv") else name
            cfg = cfg_with(**{key: cand})
            cfg.pop({"fwd": "fwd_gluon", "dq": "dq_gluon", "dkdv": "dkdv_gluon"}[key], None)  # time the Triton
            # config being tuned, not the Gluon kernel that replaces it on contiguous heads
            if key != "dq":
                cfg["dq"] = dq_c[0]
            fused = name == "dkdv_fused"
            try:
                out, lse = ops.gqa_forward(q, k, v, cu, cu, SCALE, cfg)
                dq, dk, dv = ops.gqa_backward(do, q, k, v, out, lse, cu, cu, SCALE, "fast", cfg, fused)
                errs = dict(out=rel(out, ro), dq=rel(dq, rdq), dk=rel(dk, rdk), dv=rel(dv, rdv))
                r = {"part": name, "cfg": str(cand), **{f"err_{a}": b for a, b in errs.items()}}
                for shape in ("16x2048 Hq16/Hkv2", "12 irregular docs Hq24/Hkv4"):
                    lens, hq, hkv = layouts()[shape]
                    qq, kk, vv, dd, cc = make(lens, hq, hkv)
                    if name == "fwd":
                        r[shape] = median_ms(lambda: ops.gqa_forward(qq, kk, vv, cc, cc, SCALE, cfg))
                    else:
                        oo, ll = ops.gqa_forward(qq, kk, vv, cc, cc, SCALE)
                        part = ("dq",) if name == "dq" else ("dkdv",) + (("dq",) if fused else ())
                        r[shape] = median_ms(lambda: ops.gqa_backward(dd, qq, kk, vv, oo, ll, cc, cc, SCALE,
                                                                      "fast", cfg, fused, parts=part,
                                                                      max_seqlen_k=max(lens)))
                        if name == "dq":
                            r["delta " + shape] = median_ms(lambda: ops.gqa_backward(
                                dd, qq, kk, vv, oo, ll, cc, cc, SCALE, "fast", cfg, fused, parts=("delta",)))
                    del qq, kk, vv, dd, cc
            except Exception as e:  # noqa
                r = {"part": name, "cfg": str(cand), "error": repr(e)[:200]}
            print(r, flush=True)
            rows.append(r)
    for shape in ("16x2048 Hq16/Hkv2",):
        lens, hq, hkv = layouts()[shape]
        tf, tb, _ = fa2(lens, hq, hkv)
        r = {"part": "FA2", "fwd": tf, "bwd": tb, "shape": shape}
        print(r, flush=True)
        rows.append(r)
    write_results(args.name + "_tune", rows)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--flex-limit-s", type=float, default=120.0)
    ap.add_argument("--flex-layouts", default="16x2048 Hq16/Hkv2,12 irregular docs Hq24/Hkv4",
                    help="comma-separated layouts FlexAttention runs on (its compile is slow); 'all' for every one")
    ap.add_argument("--only", default=None)
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--name", default="gqa")
    args = ap.parse_args()
    if args.tune:
        return tune(args)
    rows = []
    for shape, (lens, hq, hkv) in layouts().items():
        if args.only and args.only not in shape:
            continue
        fl = fwd_flops(lens, hq)
        res = {}
        for variant in ("det", "fast"):
            tf, tb, got = ours(lens, hq, hkv, variant)
            res[variant] = got
            rows.append(row(shape, f"cake {variant}", tf, tb, fl, **_device(ours.fwd_device, fl, ours.bwd_device)))
        tf, tb, ref = fa2(lens, hq, hkv)
        rows.append(row(shape, "FA2 varlen", tf, tb, fl, **_device(fa2.fwd_device, fl, fa2.bwd_device)))
        d, f = res["det"], res["fast"]
        rows[-3]["out_vs_fa2"] = rel(d[0], ref[0])
        rows[-3]["dq_vs_fa2"] = rel(d[2], ref[1])
        rows[-3]["dk_vs_fa2"] = rel(d[3], ref[2])
        rows[-3]["fast_dq_vs_det"] = rel(f[2], d[2])
        rows[-3]["fast_dkdv_equal_det"] = bool(torch.equal(f[3], d[3]) and torch.equal(f[4], d[4]))
        del res, d, f, ref
        if not args.no_flex and (args.flex_layouts == "all" or shape in args.flex_layouts.split(",")):
            try:
                tf, tb = flex(lens, hq, hkv, args.flex_limit_s)
                rows.append(row(shape, "FlexAttention", tf, tb, fl))
            except Exception as e:  # noqa
                print(f"flex {shape}: {e!r}"[:200], flush=True)
        try:
            r = cudnn(lens, hq, hkv)
            if r:
                rows.append(row(shape, "cuDNN SDPA (dense)", r[0], r[1], fl, **_device(cudnn.fwd_device, fl, cudnn.bwd_device)))
        except Exception as e:  # noqa
            print(f"cudnn {shape}: {e!r}"[:200], flush=True)
        torch.cuda.empty_cache()
        print(shape, "done", flush=True)
    path = write_results(args.name, rows)
    print_table(rows, ["shape", "impl", "fwd_ms", "bwd_ms", "fwd_tflops", "bwd_tflops", "fwd_tflops_device",
                       "bwd_tflops_device"])
    print(path)


if __name__ == "__main__":
    main()
