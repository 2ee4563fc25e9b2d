"""Benchmark of `conv1d` (causal depthwise conv, width 4, SiLU, packed documents, bf16) against its peers, in one run.

Peers: fla's `causal_conv1d` (Triton, backend="triton") and a PyTorch reference (F.conv1d per document in bf16 +
SiLU, autograd backward). Qwen3-Next's shape: D = 2*16*128 + 2*32*128 = 12288 channels, 32768 tokens.
Bytes: fwd reads x and writes y; bwd reads x and dy and writes dx (weights are negligible). Times are medians of
calls queued back to back (`*_synced`: one sync per call, `_common.median_ms`, which adds the host launch time).
Also reports each implementation's relative RMS error against the FP64 reference on the main shape, and whether det
repeats bits.
Prints a table; writes bench/results/conv1d.json.

    python bench/conv1d.py [--no-fla] [--no-torch] [--sweep]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import COPY_TBPS, median_ms, print_table, queued_ms, write_results  # noqa: E402

import miles_ext_kernels as mek  # noqa: E402
from miles_ext_kernels import cake  # noqa: E402
from miles_ext_kernels.cake import conv1d  # noqa: E402
from miles_ext_kernels.cake._impl.conv1d import configs, ops  # noqa: E402
from miles_ext_kernels.cake._impl.conv1d.reference import causal_conv1d_ref_shift  # noqa: E402


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
    return {
        "16x2048": [2048] * 16,
        "irregular": irregular_lengths(),
        "1x32768 (cu=None)": None,
    }


def make(lens, wdt, seed=0):
    T = 32768 if lens is None else sum(lens)
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(D, W, device="cuda", generator=g) * 0.5).to(wdt)
    dy = torch.randn(T, D, device="cuda", generator=g).to(torch.bfloat16)
    cu = None
    if lens is not None:
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    return x, w, dy, cu


# ---------------------------------------------------------------------------------------------------- impls
def ours(x, w, cu):
    return conv1d.causal_conv1d(x, w, cu_seqlens=cu, activation="silu")


def fla_fn():
    from fla.modules.causal_conv1d import causal_conv1d as fla_conv

    def fwd(x, w, cu):
        y, _ = fla_conv(x[None], w, activation="silu", backend="triton",
                        cu_seqlens=None if cu is None else cu.to(torch.int64))
        return y[0]
    return fwd


def torch_fn(lens_holder):
    def fwd(x, w, cu):
        lens = lens_holder[0]
        bounds = [0] + torch.tensor(lens).cumsum(0).tolist() if lens is not None else [0, x.shape[0]]
        wt = w.to(x.dtype).unsqueeze(1)
        outs = []
        for s, e in zip(bounds[:-1], bounds[1:]):
            seg = x[s:e].t().unsqueeze(0)
            outs.append(F.conv1d(F.pad(seg, (W - 1, 0)), wt, groups=D)[0].t())
        return F.silu(torch.cat(outs, 0))
    return fwd


def time_impl(fn, x, w, dy, cu, synced=True):
    """(fwd_ms, bwd_ms, fwd_ms_queued, bwd_ms_queued); backward = autograd.grad of one forward (graph retained)."""
    with torch.no_grad():
        f = lambda: fn(x, w, cu)  # noqa: E731
        fwd_ms = median_ms(f, rep=30) if synced else None
        fwd_q = queued_ms(f)
    xr = x.detach().requires_grad_(True)
    wr = w.detach().requires_grad_(True)
    y = fn(xr, wr, cu)
    b = lambda: torch.autograd.grad(y, (xr, wr), dy, retain_graph=True)  # noqa: E731
    bwd_ms = median_ms(b, rep=30) if synced else None
    bwd_q = queued_ms(b)
    return fwd_ms, bwd_ms, fwd_q, bwd_q


def rel_rms(got, ref):
    """||got - ref|| / ||ref|| in FP64, on the device (the tensors are GBs)."""
    r = ref.to(torch.float64)
    return float(torch.linalg.vector_norm(got.to(torch.float64) - r) / torch.linalg.vector_norm(r))


def grads(fn, x, w, dy, cu):
    xr = x.detach().requires_grad_(True)
    wr = w.detach().requires_grad_(True)
    y = fn(xr, wr, cu)
    dx, dw = torch.autograd.grad(y, (xr, wr), dy)
    return y.detach(), dx, dw


FWD_CANDIDATES = [dict(BLOCK_D=256, CHUNK=128, ROWS=8, num_warps=1), dict(BLOCK_D=128, CHUNK=128, ROWS=8, num_warps=1),
                  dict(BLOCK_D=64, CHUNK=128, ROWS=8, num_warps=1), dict(BLOCK_D=128, CHUNK=256, ROWS=8, num_warps=1),
                  dict(BLOCK_D=128, CHUNK=64, ROWS=8, num_warps=1), dict(BLOCK_D=256, CHUNK=128, ROWS=4, num_warps=1)]
BWD_CANDIDATES = [dict(BLOCK_D=256, CHUNK=128, ROWS=8, num_warps=1), dict(BLOCK_D=128, CHUNK=128, ROWS=8, num_warps=1),
                  dict(BLOCK_D=64, CHUNK=128, ROWS=8, num_warps=1), dict(BLOCK_D=128, CHUNK=256, ROWS=8, num_warps=1),
                  dict(BLOCK_D=64, CHUNK=256, ROWS=8, num_warps=1), dict(BLOCK_D=64, CHUNK=128, ROWS=4, num_warps=1),
                  dict(BLOCK_D=128, CHUNK=128, ROWS=4, num_warps=1)]


def candidate_routes(shipped):
    """The routes the sweep's calls launch with each candidate config (W 4, SiLU, bf16 weight, aligned, with and
    without cu_seqlens): the launchers run on meta tensors under collect_routes, as `ops.routes` does."""
    from miles_ext_kernels.cake._runtime.launch import collect_routes

    meta = dict(device="meta")
    x = torch.empty(4096, 64, dtype=torch.bfloat16, **meta)
    w = torch.empty(64, W, dtype=torch.bfloat16, **meta)
    try:
        with collect_routes("sm_90a") as rs:
            for kind, cands in (("fwd", FWD_CANDIDATES), ("bwd", BWD_CANDIDATES)):
                for c in cands:
                    configs.CONFIGS["sm_90a"] = dict(shipped, **{kind: dict(c, num_stages=1)})
                    for cu in (None, torch.empty(17, dtype=torch.int32, **meta)):
                        if kind == "fwd":
                            ops.conv1d_forward(x, w, cu, 1)
                        else:
                            ops.conv1d_backward(x, x, w, cu, 1)
    finally:
        configs.CONFIGS["sm_90a"] = shipped
    return rs.routes


def run_sweep():
    """Time block configs of our det kernels on 16x2048 (bf16 weight) and keep the fastest fwd and bwd for the
    rest of the run (and in the JSON); candidates are compiled in parallel first."""
    from miles_ext_kernels.cake._runtime import build

    shipped = {k: dict(v) for k, v in configs.CONFIGS["sm_90a"].items()}
    routes = candidate_routes(shipped)
    t0 = time.time()
    build._compile_all(routes, None)
    print(f"sweep: compiled {len(routes)} candidates in {time.time() - t0:.0f} s", flush=True)
    x, w, dy, cu = make([2048] * 16, torch.bfloat16)
    T = x.shape[0]
    out, best = [], {}
    for kind, cands in (("fwd", FWD_CANDIDATES), ("bwd", BWD_CANDIDATES)):
        for c in cands:
            configs.CONFIGS["sm_90a"] = dict(shipped, **{kind: dict(c, num_stages=1)})
            _, _, f_ms, b_ms = time_impl(ours, x, w, dy, cu, synced=False)
            ms = f_ms if kind == "fwd" else b_ms
            nbytes = (2 if kind == "fwd" else 3) * T * D * 2
            out.append(dict(kind=kind, **c, ms=ms, tbps=nbytes / ms / 1e9))
            print(out[-1], flush=True)
            if kind not in best or ms < best[kind][0]:
                best[kind] = (ms, dict(c, num_stages=1))
    configs.CONFIGS["sm_90a"] = dict(shipped, fwd=best["fwd"][1], bwd=best["bwd"][1])
    print("picked", configs.CONFIGS["sm_90a"], flush=True)
    out_dir = os.environ.get("BENCH_OUT")
    if out_dir:
        Path(out_dir, "picked.json").write_text(json.dumps(configs.CONFIGS["sm_90a"]))
    del x, w, dy
    torch.cuda.empty_cache()
    return out


def write_config(cfg):
    """Rewrite the sm_90a "fwd"/"bwd" lines of the config table in configs.py (the first two such lines)."""
    import re

    path = Path(configs.__file__)
    src = path.read_text()
    for kind in ("fwd", "bwd"):
        c = cfg[kind]
        line = (f'"{kind}": dict(BLOCK_D={c["BLOCK_D"]}, CHUNK={c["CHUNK"]}, ROWS={c["ROWS"]}, '
                f'num_warps={c["num_warps"]}, num_stages={c["num_stages"]}),')
        src = re.sub(rf'"{kind}": dict\(BLOCK_D=\d+, CHUNK=\d+, ROWS=\d+, num_warps=\d+, num_stages=\d+\),', line, src,
                     count=1)
    path.write_text(src)
    print("wrote", path, flush=True)


def add_budgets(errs, peer="fla causal_conv1d"):
    """DESIGN.md budgets per tensor: min(peer error x 1.1, 2 x our error); `ok` says whether ours is within."""
    for e in errs:
        if not e["impl"].startswith("cake"):
            continue
        p = next((q for q in errs if q["impl"] == peer and q["shape"] == e["shape"]), None)
        if p is None:
            continue
        for t in ("y", "dx", "dw"):
            e[f"budget_{t}"] = min(1.1 * p[f"err_{t}"], 2.0 * e[f"err_{t}"])
        e["ok"] = all(e[f"err_{t}"] <= e[f"budget_{t}"] for t in ("y", "dx", "dw"))
    return errs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time a few alternative block configs")
    ap.add_argument("--prebuild", action="store_true", help="prebuild every route first (fills the cache)")
    ap.add_argument("--write-config", action="store_true",
                    help="with --sweep: write the picked sm_90a fwd/bwd configs into _impl/conv1d/configs.py")
    args = ap.parse_args()
    t_start = time.time()
    if args.prebuild:
        for wd in ("bfloat16", "float32"):
            print(cake.prebuild("conv1d", weight_dtype=wd), flush=True)
    sweep = []
    if args.sweep:
        sweep = run_sweep()
        if args.write_config:
            write_config(configs.CONFIGS["sm_90a"])
    rows, errs = [], []
    lens_holder = [None]
    impls = {"cake det": ours, "cake fast": ours}
    variant = {"cake det": "det", "cake fast": "fast"}  # configured before each of our runs
    if not args.no_fla:
        try:
            impls["fla causal_conv1d"] = fla_fn()
        except Exception as e:  # noqa: BLE001
            print(f"fla unavailable: {e!r}")
    if not args.no_torch:
        impls["torch F.conv1d/doc"] = torch_fn(lens_holder)
    for wdt in (torch.bfloat16, torch.float32):
        for lname, lens in layouts().items():
            if wdt == torch.float32 and lname != "16x2048":
                continue
            lens_holder[0] = lens
            x, w, dy, cu = make(lens, wdt)
            T = x.shape[0]
            fbytes, bbytes = 2 * T * D * 2, 3 * T * D * 2
            shape = f"{lname} D{D} W{W} w={str(wdt)[6:]}"
            for name, fn in impls.items():
                mek.configure(conv1d_variant=variant.get(name, "det"))
                try:
                    f_ms, b_ms, fq, bq = time_impl(fn, x, w, dy, cu)
                except Exception as e:  # noqa: BLE001
                    print(f"{name} on {shape}: {e!r}")
                    continue
                # fwd_ms/bwd_ms: queued (kernel throughput, host overhead hidden as in training);
                # *_synced: `_common.median_ms`, one sync per call (includes the host launch time)
                rows.append(dict(shape=shape, impl=name, fwd_ms=fq, bwd_ms=bq, fwd_tbps=fbytes / fq / 1e9,
                                 bwd_tbps=bbytes / bq / 1e9, fwd_ms_synced=f_ms, bwd_ms_synced=b_ms,
                                 fwd_tbps_synced=fbytes / f_ms / 1e9, bwd_tbps_synced=bbytes / b_ms / 1e9))
                print(rows[-1], flush=True)
            mek.configure()
            if lname == "16x2048":  # accuracy vs FP64 (exact SiLU') and bit repeatability, same inputs
                ref = causal_conv1d_ref_shift(x, w, dy, cu, "silu")
                for name, fn in impls.items():
                    mek.configure(conv1d_variant=variant.get(name, "det"))
                    try:
                        a = grads(fn, x, w, dy, cu)
                        b = grads(fn, x, w, dy, cu)
                    except Exception as e:  # noqa: BLE001
                        print(f"{name} accuracy: {e!r}")
                        continue
                    errs.append(dict(shape=shape, impl=name, err_y=rel_rms(a[0], ref[0]),
                                     err_dx=rel_rms(a[1], ref[1]), err_dw=rel_rms(a[2], ref[2]),
                                     bits_repeat=all(torch.equal(p, q) for p, q in zip(a, b))))
                    print(errs[-1], flush=True)
                del ref
                mek.configure()
            del x, w, dy
            torch.cuda.empty_cache()
    print()
    print_table(rows, ["shape", "impl", "fwd_ms", "bwd_ms", "fwd_tbps", "bwd_tbps", "fwd_ms_synced", "bwd_ms_synced"])
    add_budgets(errs)
    print()
    print_table(errs, ["shape", "impl", "err_y", "err_dx", "err_dw", "bits_repeat", "budget_y", "budget_dx",
                       "budget_dw", "ok"])
    if sweep:
        print()
        print_table(sweep, ["kind", "BLOCK_D", "CHUNK", "ROWS", "num_warps", "ms", "tbps"])
    path = write_results("conv1d", rows, extra={"accuracy": errs, "sweep": sweep, "copy_tbps": COPY_TBPS,
                                                "configs": configs.CONFIGS["sm_90a"]})
    print(f"wrote {path} ({time.time() - t_start:.0f} s)")


if __name__ == "__main__":
    main()
