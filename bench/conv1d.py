"""Benchmark of `conv1d` (causal depthwise conv, width 4, SiLU, packed documents, bf16) against its peers, in one run.

Peers: fla's `causal_conv1d` (Triton, backend="triton") and a PyTorch reference (F.conv1d per document in bf16 +
SiLU, autograd backward). Qwen3-Next's shape: D = 2*16*128 + 2*32*128 = 12288 channels, 32768 tokens.
Bytes: fwd reads x and writes y; bwd reads x and dy and writes dx (weights are negligible). Modes fwd and bwd
(autograd.grad on a kept graph), each in device time (`device_ms`), queued back to back (`queued_ms`) and synced
(`median_ms`). Accuracy: relative RMS of y, dx, dw against the FP64 reference on the main shape; det bits
checked to repeat. Writes bench/results/conv1d.json (see _common.py for the row format).

    python bench/conv1d.py [--no-fla] [--no-torch] [--prebuild] [--sweep [--write-config]] [--dry-run] [--help]
"""
from __future__ import annotations

import json
import os
import sys
from itertools import pairwise
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import COPY_TBPS, Autograd, Bench, Provider, Timed, device_ms, parser, print_table, run

from miles_ext_kernels import cake
from miles_ext_kernels.cake import conv1d

D = 12288
W = 4


def irregular_lengths():
    g = torch.Generator().manual_seed(1)
    lens, tot = [], 0
    while tot < 32768:
        L = min(int(torch.randint(64, 8192, (1,), generator=g)), 32768 - tot)
        lens.append(L)
        tot += L
    return lens


def layouts():
    """label -> document lengths (None: one sequence of 32768 tokens without cu_seqlens)."""
    return {
        "16x2048": [2048] * 16,
        "irregular": irregular_lengths(),
        "1x32768 (cu=None)": None,
    }


def shapes():
    out = {}
    for wdt in ("bfloat16", "float32"):
        for lname, lens in layouts().items():
            if wdt == "float32" and lname != "16x2048":
                continue
            out[f"{lname} D{D} W{W} w={wdt}"] = {"lens": lens, "T": 32768, "D": D, "W": W, "wdt": wdt}
    return out


def io_bytes(p, mode):
    return {"fwd": 2, "bwd": 3}.get(mode, 0) * p["T"] * p["D"] * 2 or None


def inputs(p, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    T, d, lens = p["T"], p["D"], p["lens"]
    x = torch.randn(T, d, device=device, generator=g).to(torch.bfloat16)
    w = (torch.randn(d, p["W"], device=device, generator=g) * 0.5).to(getattr(torch, p["wdt"]))
    dy = torch.randn(T, d, device=device, generator=g).to(torch.bfloat16)
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return {"x": x, "w": w, "dy": dy, "cu": cu, "lens": lens}


# ---------------------------------------------------------------------------------------------------- providers
def _call(fn, x):
    return Autograd(fn, (x["x"], x["w"]), wrt=(0, 1), grad_outputs=x["dy"])


def ours(x, p):
    cu = x["cu"]
    return _call(lambda xx, w: conv1d.causal_conv1d(xx, w, cu_seqlens=cu, activation="silu"), x)


def fla(x, p):
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv

    cu = None if x["cu"] is None else x["cu"].to(torch.int64)
    return _call(lambda xx, w: fla_conv(xx[None], w, activation="silu", backend="triton", cu_seqlens=cu)[0][0], x)


def torch_conv(x, p):
    lens = x["lens"]
    bounds = [0] + torch.tensor(lens).cumsum(0).tolist() if lens is not None else [0, x["x"].shape[0]]

    def fwd(xx, w):
        wt = w.to(xx.dtype).unsqueeze(1)
        outs = []
        for s, e in pairwise(bounds):
            seg = xx[s:e].t().unsqueeze(0)
            outs.append(F.conv1d(F.pad(seg, (w.shape[1] - 1, 0)), wt, groups=xx.shape[1])[0].t())
        return F.silu(torch.cat(outs, 0))
    return _call(fwd, x)


def reference(x, p):
    from miles_ext_kernels.cake._impl.conv1d.reference import causal_conv1d_ref_shift

    return causal_conv1d_ref_shift(x["x"], x["w"], x["dy"], x["cu"], "silu")


def declare() -> Bench:
    main_shape = f"16x2048 D{D} W{W} w=bfloat16"
    dry = {"2 docs D24 W4 w=bfloat16": {"lens": [20, 17], "T": 37, "D": 24, "W": 4, "wdt": "bfloat16"}}
    s = shapes()
    return Bench(
        name="conv1d", shapes=s, dry_shapes=dry, inputs=inputs,
        providers=[
            Provider("cake det", ours, config={"conv1d_variant": "det"}, det=True, ours=True),
            Provider("cake fast", ours, config={"conv1d_variant": "fast"}, ours=True),
            Provider("fla causal_conv1d", fla, requires=("fla",), on_cpu=False),
            Provider("torch F.conv1d/doc", torch_conv),
        ],
        modes=("fwd", "bwd"), io_bytes=io_bytes, timers=("synced", "device", "queued"), rep=30,
        reference=reference, result_names=("y", "dx", "dw"), accuracy={main_shape: s[main_shape]}, dry_accuracy=dry)


# ---------------------------------------------------------------------------------------------------- tuning
def _candidates(*blocks) -> list[dict]:
    """Block configs of the sweep, one per (BLOCK_D, CHUNK, ROWS), each at one warp."""
    return [{"BLOCK_D": d, "CHUNK": c, "ROWS": r, "num_warps": 1} for d, c, r in blocks]


FWD_CANDIDATES = _candidates((256, 128, 8), (128, 128, 8), (64, 128, 8), (128, 256, 8), (128, 64, 8), (256, 128, 4))
BWD_CANDIDATES = _candidates((256, 128, 8), (128, 128, 8), (64, 128, 8), (128, 256, 8), (64, 256, 8), (64, 128, 4),
                             (128, 128, 4))


def sweep(write_config: bool):
    """INTERNAL CONFIG TABLE (tuning only): time block configs of our det kernels on 16x2048 (bf16 weight) by
    overriding `_impl/conv1d/configs.CONFIGS["sm_90a"]`, keep the fastest fwd and bwd for the rest of the run (and
    in the JSON; $BENCH_OUT/picked.json), and with `write_config` rewrite the sm_90a "fwd" / "bwd" lines of that
    table in configs.py. Device time, through the public entry point; each candidate compiles on its first call."""
    import re

    import miles_ext_kernels as mek
    from miles_ext_kernels.cake._impl.conv1d import configs

    p = {"lens": [2048] * 16, "T": 32768, "D": D, "W": W, "wdt": "bfloat16"}
    x = inputs(p, "cuda")
    shipped = {k: dict(v) for k, v in configs.CONFIGS["sm_90a"].items()}
    out, best = [], {}
    mek.configure(conv1d_variant="det")
    for kind, cands in (("fwd", FWD_CANDIDATES), ("bwd", BWD_CANDIDATES)):
        for c in cands:
            configs.CONFIGS["sm_90a"] = dict(shipped, **{kind: dict(c, num_stages=1)})
            ms = device_ms(Timed(ours(x, p)).builder(kind), rep=30)
            nbytes = io_bytes(p, kind)
            out.append(dict(kind=kind, **c, ms=ms, tbps=nbytes / ms / 1e9))
            print(out[-1], flush=True)
            if kind not in best or ms < best[kind][0]:
                best[kind] = (ms, dict(c, num_stages=1))
    mek.configure()
    picked = dict(shipped, fwd=best["fwd"][1], bwd=best["bwd"][1])
    configs.CONFIGS["sm_90a"] = picked
    print("picked", picked, flush=True)
    if os.environ.get("BENCH_OUT"):
        Path(os.environ["BENCH_OUT"], "picked.json").write_text(json.dumps(picked))
    if write_config:
        path = Path(configs.__file__)
        src = path.read_text()
        for kind in ("fwd", "bwd"):
            c = picked[kind]
            line = (f'"{kind}": dict(BLOCK_D={c["BLOCK_D"]}, CHUNK={c["CHUNK"]}, ROWS={c["ROWS"]}, '
                    f'num_warps={c["num_warps"]}, num_stages={c["num_stages"]}),')
            src = re.sub(rf'"{kind}": dict\(BLOCK_D=\d+, CHUNK=\d+, ROWS=\d+, num_warps=\d+, num_stages=\d+\),',
                         line, src, count=1)
        path.write_text(src)
        print("wrote", path, flush=True)
    del x
    torch.cuda.empty_cache()
    return out, picked


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--no-fla", action="store_true", help="leave fla out")
    ap.add_argument("--no-torch", action="store_true", help="leave the PyTorch per-document conv out")
    ap.add_argument("--sweep", action="store_true", help="first time alternative block configs and keep the fastest")
    ap.add_argument("--prebuild", action="store_true", help="prebuild every route first (fills the cache)")
    ap.add_argument("--write-config", action="store_true",
                    help="with --sweep: write the picked sm_90a fwd/bwd configs into _impl/conv1d/configs.py")
    args = ap.parse_args(argv)
    args.skip += "".join((",fla causal_conv1d" if args.no_fla else "", ",torch F.conv1d/doc" if args.no_torch else ""))
    if args.prebuild and not args.dry_run:
        for wd in ("bfloat16", "float32"):
            print(cake.prebuild("conv1d", weight_dtype=wd), flush=True)
    extra = {"copy_tbps": COPY_TBPS}
    if args.sweep and not args.dry_run:
        extra["sweep"], extra["configs"] = sweep(args.write_config)
        print_table(extra["sweep"], ["kind", "BLOCK_D", "CHUNK", "ROWS", "num_warps", "ms", "tbps"])
    return run(declare(), args, extra=extra)


if __name__ == "__main__":
    sys.exit(main())
