"""Benchmark of `gqa` (packed causal GQA attention, head dim 256, bf16) against its peers, in one run.

Peers: torch's FlashAttention-2 varlen ops, FlexAttention with a document-causal block mask (skip with --no-flex;
its compile is slow, so it runs on --flex-layouts only), cuDNN SDPA on equal-length dense batches. Ours through
the public entry point `cake.gqa.varlen_gqa_attention`, det and fast. Modes fwd and bwd (autograd.grad on a kept
graph; FA2: its aten backward on one forward's outputs), each synced (`median_ms`) and in device time
(`device_ms`). TFLOP/s by the FlashAttention convention (causal fwd = 2 L^2 H D per segment, bwd = 2.5 x fwd).
Accuracy: relative RMS of out, dq, dk, dv against FA2-varlen's on the same inputs, every layout. Writes
bench/results/gqa.json (see _common.py for the row format).

    python bench/gqa.py [--no-flex] [--only NAME] [--tune] [--dry-run] [harness options: --help]
"""
from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Autograd, Bench, Calls, Provider, Skip, median_ms, parser, rel_rms, run, write_results

from miles_ext_kernels.cake import gqa

D = 256
SCALE = D ** -0.5


def irregular_lengths():
    """The irregular layout of ANCHORS.md (same generator; bench/ab.py reads it too)."""
    g = torch.Generator().manual_seed(1)
    lens, tot = [], 0
    while tot < 32768:
        L = int(torch.randint(64, 8192, (1,), generator=g))
        L = min(L, 32768 - tot)
        lens.append(L)
        tot += L
    return lens


def layouts():
    """label -> (document lengths, H_q, H_kv)."""
    return {
        "16x2048 Hq16/Hkv2": ([2048] * 16, 16, 2),
        "16x2048 Hq8/Hkv1": ([2048] * 16, 8, 1),
        "12 irregular docs Hq24/Hkv4": (irregular_lengths(), 24, 4),
        "1x32768 Hq16/Hkv2": ([32768], 16, 2),
        "256x128 Hq16/Hkv2": ([128] * 256, 16, 2),
        "1024x32 Hq16/Hkv2": ([32] * 1024, 16, 2),  # 32-token documents: a quarter of a 128-row tile
        "4x8192 Hq32/Hkv4": ([8192] * 4, 32, 4),
        "16x2048 Hq24/Hkv4 (Qwen3.5-27B)": ([2048] * 16, 24, 4),
        "16x2048 Hq3/Hkv1 (27B, TP-8 rank)": ([2048] * 16, 3, 1),
    }


def flops(p, mode):
    fwd = sum(2.0 * L * L * p["hq"] * D for L in p["lens"])
    return {"fwd": fwd, "bwd": 2.5 * fwd}.get(mode)


def make(lens, hq, hkv, seed=0, device="cuda"):
    g = torch.Generator(device=device).manual_seed(seed)
    T = sum(lens)
    q = torch.randn(T, hq, D, device=device, dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, hkv, D, device=device, dtype=torch.bfloat16, generator=g)
    v = torch.randn(T, hkv, D, device=device, dtype=torch.bfloat16, generator=g)
    do = torch.randn(T, hq, D, device=device, dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), device=device, dtype=torch.int32)
    return q, k, v, do, cu


def inputs(p, device):
    q, k, v, do, cu = make(p["lens"], p["hq"], p["hkv"], device=device)
    return {"q": q, "k": k, "v": v, "do": do, "cu": cu, "L": max(p["lens"])}


# ---------------------------------------------------------------------------------------------------- providers
def ours(x, p):
    cu, L = x["cu"], x["L"]
    return Autograd(lambda q, k, v: gqa.varlen_gqa_attention(q, k, v, cu, cu, max_seqlen_k=L, softmax_scale=SCALE),
                    (x["q"], x["k"], x["v"]), wrt=(0, 1, 2), grad_outputs=x["do"])


def fa2(x, p):
    """torch's FlashAttention-2 varlen kernels called as aten ops (no autograd node in between)."""
    q, k, v, do, cu, L = x["q"], x["k"], x["v"], x["do"], x["cu"], x["L"]

    def fwd():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, L, L, 0.0, True, False, scale=SCALE)

    def bwd_of(res):
        o, lse, seed, off = res[0], res[1], res[2], res[3]
        return torch.ops.aten._flash_attention_backward(do, q, k, v, o, lse, cu, cu, L, L, 0.0, True, seed, off,
                                                        scale=SCALE)

    kept = fwd()

    def result():
        res = fwd()
        return (res[0], *bwd_of(res)[:3])

    return Calls(fwd=fwd, bwd=lambda: bwd_of(kept), full=lambda: bwd_of(fwd()), result=result)


def flex_provider(limit_s):
    def flex(x, p):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        lens = p["lens"]
        T = sum(lens)
        dev = x["q"].device
        doc = torch.repeat_interleave(torch.arange(len(lens), device=dev), torch.tensor(lens, device=dev))

        def mask_mod(b, h, qi, ki):
            return (doc[qi] == doc[ki]) & (qi >= ki)

        bm = create_block_mask(mask_mod, 1, 1, T, T, device=dev)
        fa = torch.compile(flex_attention, dynamic=False)
        args = [t.transpose(0, 1).unsqueeze(0) for t in (x["q"], x["k"], x["v"])]
        dob = x["do"].transpose(0, 1).unsqueeze(0)
        t0 = time.time()
        fa(*(a.detach().requires_grad_() for a in args), block_mask=bm, enable_gqa=True).backward(dob)
        if time.time() - t0 > limit_s:
            raise Skip(f"compile took {time.time() - t0:.0f} s > --flex-limit-s {limit_s:.0f}")
        return Autograd(lambda q, k, v: fa(q, k, v, block_mask=bm, enable_gqa=True), args, wrt=(0, 1, 2),
                        grad_outputs=dob)
    return flex


def cudnn(x, p):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    lens = p["lens"]
    if len(set(lens)) != 1:
        raise Skip("a dense batch needs equal document lengths")
    B, L = len(lens), lens[0]
    dense = [t.view(B, L, t.shape[1], D).transpose(1, 2).contiguous() for t in (x["q"], x["k"], x["v"], x["do"])]
    return Autograd(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                                     enable_gqa=True),
                    dense[:3], wrt=(0, 1, 2), grad_outputs=dense[3],
                    context=lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION))


def declare(flex=True, flex_layouts="", flex_limit_s=120.0) -> Bench:
    shapes = {label: {"lens": lens, "hq": hq, "hkv": hkv} for label, (lens, hq, hkv) in layouts().items()}
    dry = {"2 docs Hq4/Hkv1": {"lens": [40, 24], "hq": 4, "hkv": 1}}
    flex_on = set(flex_layouts.split(","))
    providers = [
        Provider("cake det", ours, config={"gqa_variant": "det"}, det=True, ours=True),
        Provider("cake fast", ours, config={"gqa_variant": "fast"}, ours=True),
        Provider("FA2 varlen", fa2, on_cpu=False),
    ]
    if flex:
        providers.append(Provider("FlexAttention", flex_provider(flex_limit_s), on_cpu=False, accuracy=False,
                                  when=lambda label, p: flex_layouts == "all" or label in flex_on))
    providers.append(Provider("cuDNN SDPA (dense)", cudnn, on_cpu=False, accuracy=False))
    return Bench(name="gqa", shapes=shapes, dry_shapes=dry, inputs=inputs, providers=providers, modes=("fwd", "bwd"),
                 flops=flops, reference="FA2 varlen", result_names=("out", "dq", "dk", "dv"), accuracy=shapes,
                 dry_accuracy=dry)


# ---------------------------------------------------------------------------------------------------- tuning
def tune(args):
    """INTERNAL LAUNCHERS (tuning only): correctness of every candidate config vs an FP64 reference, then timings
    of each part with the config overridden (`_impl/gqa/ops`: their signatures move with the implementation)."""
    from miles_ext_kernels.cake._impl.gqa import ops, reference

    base = ops.CONFIGS["sm_90a"]
    fwd_c = [{"BM": 128, "BN": 64, "num_warps": 8, "num_stages": 2, "DIAG_ONLY": True},
             {"BM": 128, "BN": 64, "num_warps": 8, "num_stages": 2, "DIAG_ONLY": False},
             {"BM": 128, "BN": 32, "num_warps": 8, "num_stages": 3, "DIAG_ONLY": True}]
    dq_c = [{"BM": 128, "BN": 64, "num_warps": 8, "num_stages": 1}]
    kv_c = [{"BM": 128, "BN": 64, "num_warps": 8, "num_stages": 1, "S_ROWS": True}]
    q, k, v, do, cu = make([300, 129, 0, 64, 700], 8, 2, seed=3)
    ro, _, rdq, rdk, rdv = reference.reference_grads(q, k, v, cu, cu, do)
    rows = []
    for name, cands in (("fwd", fwd_c), ("dq", dq_c), ("dkdv", kv_c)):
        for cand in cands:
            cfg = dict(base, **{name: cand})
            # time the Triton config being tuned, not the Gluon kernel that replaces it on contiguous heads
            cfg.pop(f"{name}_gluon", None)
            if name != "dq":
                cfg["dq"] = dq_c[0]
            try:
                out, lse = ops.gqa_forward(q, k, v, cu, cu, SCALE, cfg)
                dq, dk, dv = ops.gqa_backward(do, q, k, v, out, lse, cu, cu, SCALE, "fast", cfg)
                r = {"part": name, "cfg": str(cand), "err_out": rel_rms(out, ro), "err_dq": rel_rms(dq, rdq),
                     "err_dk": rel_rms(dk, rdk), "err_dv": rel_rms(dv, rdv)}
                for shape in ("16x2048 Hq16/Hkv2", "12 irregular docs Hq24/Hkv4"):
                    lens, hq, hkv = layouts()[shape]
                    qq, kk, vv, dd, cc = make(lens, hq, hkv)
                    if name == "fwd":
                        r[shape] = median_ms(partial(ops.gqa_forward, qq, kk, vv, cc, cc, SCALE, cfg))
                    else:
                        oo, ll = ops.gqa_forward(qq, kk, vv, cc, cc, SCALE)
                        part = partial(ops.gqa_backward, dd, qq, kk, vv, oo, ll, cc, cc, SCALE, "fast", cfg)
                        r[shape] = median_ms(partial(part, parts=(name,), max_seqlen_k=max(lens)))
                    del qq, kk, vv, dd, cc
            except Exception as e:  # noqa: BLE001 - a candidate that does not compile or run is recorded
                r = {"part": name, "cfg": str(cand), "error": repr(e)[:200]}
            print(r, flush=True)
            rows.append(r)
    shape = "16x2048 Hq16/Hkv2"
    lens, hq, hkv = layouts()[shape]
    peer = fa2(inputs({"lens": lens, "hq": hq, "hkv": hkv}, "cuda"), None)
    rows.append({"part": "FA2", "shape": shape, "fwd": median_ms(peer.fwd), "bwd": median_ms(peer.bwd)})
    print(rows[-1], flush=True)
    write_results((args.name or "gqa") + "_tune", rows)


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--no-flex", action="store_true", help="leave FlexAttention out")
    ap.add_argument("--flex-limit-s", type=float, default=120.0, help="skip FlexAttention where compiling takes longer")
    ap.add_argument("--flex-layouts", default="16x2048 Hq16/Hkv2,12 irregular docs Hq24/Hkv4",
                    help="comma-separated layouts FlexAttention runs on (its compile is slow); 'all' for every one")
    ap.add_argument("--tune", action="store_true", help="time candidate configs of our kernels instead")
    args = ap.parse_args(argv)
    if args.tune:
        tune(args)
        return 0
    return run(declare(not args.no_flex, args.flex_layouts, args.flex_limit_s), args)


if __name__ == "__main__":
    sys.exit(main())
