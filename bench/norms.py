"""Benchmark of rmsnorm (zero-centred) and gated_rmsnorm against their peers, in the same run, on the GPU.

    python bench/norms.py [--quick] [--no-sweep]

Peers: the PyTorch eager reference, torch.compile of it, Liger's LigerRMSNormFunction (offset 1.0, casting mode
"gemma" = everything in fp32, as Qwen3NextRMSNorm) and fla's rms_norm_gated (FusedRMSNormGated's function, swish).
Shapes: Qwen3-Next (H 2048; 32 value heads x 128) and Qwen3.5-27B (H 5120); ours at 4k-64k tokens, peers at 32k.
Bytes = each input read once + each output written once (weights included); TB/s = bytes / median time.
Weights fp32. Accuracy: relative RMS vs an FP64 reference (computed on the GPU) at 8k tokens, for every impl.
Writes bench/results/norms.json (rows + `errors` + the config `sweep`).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

from _common import COPY_TBPS, device_ms, median_ms, print_table, queued_ms, write_results  # noqa: E402

import miles_ext_kernels as mek  # noqa: E402
from miles_ext_kernels import cake  # noqa: E402
from miles_ext_kernels.cake._impl.gated_rmsnorm import configs as gconf  # noqa: E402
from miles_ext_kernels.cake._impl.gated_rmsnorm import ops as gops  # noqa: E402
from miles_ext_kernels.cake._impl.gated_rmsnorm import reference as gref  # noqa: E402
from miles_ext_kernels.cake._impl.rmsnorm import configs as rconf  # noqa: E402
from miles_ext_kernels.cake._impl.rmsnorm import ops as rops  # noqa: E402
from miles_ext_kernels.cake._impl.rmsnorm import reference as rref  # noqa: E402

BF = torch.bfloat16
EPS = 1e-6
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


# ---------------------------------------------------------------------------------------------------------------
SKIP: set = set()


def peers_rms():
    out = {"eager": rref.zero_centered_rmsnorm_eager,
           "torch.compile": torch.compile(rref.zero_centered_rmsnorm_eager, dynamic=False)}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        out["liger"] = lambda x, w, eps: LigerRMSNormFunction.apply(x, w, eps, 1.0, "gemma", False, None)
    except Exception as e:  # noqa: BLE001
        log("liger unavailable:", repr(e)[:200])
    return {k: v for k, v in out.items() if k not in SKIP}


def peers_gated():
    out = {"eager": gref.rmsnorm_silu_gate_eager,
           "torch.compile": torch.compile(gref.rmsnorm_silu_gate_eager, dynamic=False)}
    try:
        from fla.modules.norm.fused_norm_gate import rms_norm_gated

        out["fla"] = lambda x, z, w, eps: rms_norm_gated(x, z, w, None, "swish", eps=eps)
    except Exception as e:  # noqa: BLE001
        log("fla unavailable:", repr(e)[:200])
    return {k: v for k, v in out.items() if k not in SKIP}


def gpu_rel_rms(got, ref):
    g = got.detach().double()
    r = ref.detach().double()
    return (torch.linalg.vector_norm(g - r) / torch.linalg.vector_norm(r)).item()


# ---------------------------------------------------------------------------------------------------------------
def time_fwd_bwd(fn, args, grad_idx, dy):
    """{timer: (fwd_ms, bwd_ms)} for the three timers (device, queued, synced): forward with autograd on;
    backward = autograd.grad of that output (graph retained)."""
    leaves = [a.detach().requires_grad_(i in grad_idx) if torch.is_tensor(a) else a for i, a in enumerate(args)]
    y = fn(*leaves)
    inputs = [leaves[i] for i in grad_idx]
    fwd = lambda: fn(*leaves)  # noqa: E731
    bwd = lambda: torch.autograd.grad(y, inputs, dy, retain_graph=True)  # noqa: E731
    return {name: (timer(fwd), timer(bwd))
            for name, timer in (("device", device_ms), ("queued", queued_ms), ("synced", median_ms))}


TIMER_NOTE = ("Times: GPU time with the host's launch work hidden (`device_ms`: each call queued behind a 2 ms GPU "
              "spin, as in a training step whose host runs ahead); the JSON also has `*_queued` (calls back to back, "
              "host-bound when a launch path is slower than its kernels) and `*_synced` (one sync per call).")


def row(op, shape, impl, t, fb, bb):
    out = {"op": op, "shape": shape, "impl": impl}
    for name, (f_ms, b_ms) in t.items():
        sfx = "" if name == "device" else f"_{name}"
        out.update({f"fwd_ms{sfx}": f_ms, f"bwd_ms{sfx}": b_ms,
                    f"fwd_tbps{sfx}": fb / f_ms / 1e9, f"bwd_tbps{sfx}": bb / b_ms / 1e9})
    return out


def rms_bytes(T, H):
    return 2 * T * H * 2 + H * 4, 3 * T * H * 2 + 2 * H * 4


def gated_bytes(N, D):
    return 3 * N * D * 2 + D * 4, 5 * N * D * 2 + 2 * D * 4


def bench_rows(quick):
    rows, errors = [], []
    rms_peers, gated_peers = peers_rms(), peers_gated()
    tokens = (32768,) if quick else (4096, 16384, 32768, 65536)
    for H in (2048, 5120):
        for T in tokens:
            x = torch.randn(T, H, device="cuda").to(BF)
            w = (0.1 * torch.randn(H, device="cuda"))
            dy = torch.randn(T, H, device="cuda").to(BF)
            fb, bb = rms_bytes(T, H)
            impls = [(f"cake {v}", v, lambda x, w, eps: cake.rmsnorm.zero_centered_rmsnorm(x, w, eps))
                     for v in ("det", "fast")]
            if T == 32768:
                impls += [(k, None, f) for k, f in rms_peers.items()]
            for name, variant, fn in impls:
                if variant:
                    mek.configure(rmsnorm_variant=variant)
                try:
                    t = time_fwd_bwd(fn, (x, w, EPS), (0, 1), dy)
                except Exception as e:  # noqa: BLE001
                    log(f"rmsnorm {name} failed:", repr(e)[:300])
                    continue
                rows.append(row("rmsnorm", f"rmsnorm H{H} T{T // 1024}k", name, t, fb, bb))
                log(rows[-1])
            mek.configure()
        # accuracy at 8k tokens, every impl, vs FP64 on the GPU
        T = 8192
        x = torch.randn(T, H, device="cuda").to(BF)
        w = 0.1 * torch.randn(H, device="cuda")
        dy = torch.randn(T, H, device="cuda").to(BF)
        ref = rref.grads_ref(x, w, dy, EPS)
        for name, variant, fn in [("cake det", "det", None), ("cake fast", "fast", None)] + \
                [(k, None, f) for k, f in rms_peers.items() if k != "torch.compile"]:
            mek.configure(rmsnorm_variant=variant or "det")
            fn = fn or (lambda x, w, eps: cake.rmsnorm.zero_centered_rmsnorm(x, w, eps))
            try:
                xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
                y = fn(xr, wr, EPS)
                gx, gw = torch.autograd.grad(y, (xr, wr), dy)
                errors.append({"op": "rmsnorm", "shape": f"H{H} T8k", "impl": name,
                               **{k: gpu_rel_rms(g, r) for k, g, r in zip(("y", "dx", "dw"), (y, gx, gw), ref)}})
                log(errors[-1])
            except Exception as e:  # noqa: BLE001
                log(f"rmsnorm accuracy {name} failed:", repr(e)[:300])
        mek.configure()
        del ref
    NH, D = 32, 128
    for T in tokens:
        N = T * NH
        x = torch.randn(T, NH, D, device="cuda").to(BF)
        z = torch.randn(T, NH, D, device="cuda").to(BF)
        w = 1 + 0.1 * torch.randn(D, device="cuda")
        dy = torch.randn(T, NH, D, device="cuda").to(BF)
        fb, bb = gated_bytes(N, D)
        impls = [(f"cake {v}", v, lambda x, z, w, eps: cake.gated_rmsnorm.rmsnorm_silu_gate(x, z, w, eps))
                 for v in ("det", "fast")]
        if T == 32768:
            impls += [(k, None, f) for k, f in gated_peers.items()]
        for name, variant, fn in impls:
            if variant:
                mek.configure(gated_rmsnorm_variant=variant)
            try:
                if name == "fla":
                    args, dyy = (x.view(N, D), z.view(N, D), w, EPS), dy.view(N, D)
                else:
                    args, dyy = (x, z, w, EPS), dy
                t = time_fwd_bwd(fn, args, (0, 1, 2), dyy)
            except Exception as e:  # noqa: BLE001
                log(f"gated {name} failed:", repr(e)[:300])
                continue
            rows.append(row("gated_rmsnorm", f"gated {NH}x{D} T{T // 1024}k", name, t, fb, bb))
            log(rows[-1])
        mek.configure()
    T = 8192
    N = T * NH
    x = torch.randn(N, D, device="cuda").to(BF)
    z = torch.randn(N, D, device="cuda").to(BF)
    w = 1 + 0.1 * torch.randn(D, device="cuda")
    dy = torch.randn(N, D, device="cuda").to(BF)
    ref = gref.grads_ref(x, z, w, dy, EPS)
    for name, variant, fn in [("cake det", "det", None), ("cake fast", "fast", None)] + \
            [(k, None, f) for k, f in gated_peers.items() if k != "torch.compile"]:
        mek.configure(gated_rmsnorm_variant=variant or "det")
        fn = fn or (lambda x, z, w, eps: cake.gated_rmsnorm.rmsnorm_silu_gate(x, z, w, eps))
        try:
            xr, zr, wr = (t.clone().requires_grad_(True) for t in (x, z, w))
            y = fn(xr, zr, wr, EPS)
            grads = torch.autograd.grad(y, (xr, zr, wr), dy)
            errors.append({"op": "gated_rmsnorm", "shape": f"{NH}x{D} T8k", "impl": name,
                           **{k: gpu_rel_rms(g, r) for k, g, r in zip(("y", "dx", "dz", "dw"), (y, *grads), ref)}})
            log(errors[-1])
        except Exception as e:  # noqa: BLE001
            log(f"gated accuracy {name} failed:", repr(e)[:300])
    mek.configure()
    return rows, errors


# ---------------------------------------------------------------------------------------------------------------
def sweep(deadline):
    """Alternative fixed configs of our kernels at 32k tokens (launchers called directly), to fill the table.
    Backward first (it matters most); `programs` is matched to how many CTAs fit on an SM. Device timing."""
    out = []
    T = 32768
    N, D = T * 32, 128

    def rec(kind, shape, cfg, P, ms, nbytes):
        out.append({"kernel": kind, "shape": shape, "cfg": list(cfg), "programs": P or "table", "ms": ms,
                    "tbps": nbytes / ms / 1e9})
        log(out[-1])

    data = {}
    for H in (2048, 5120):
        data[H] = (torch.randn(T, H, device="cuda").to(BF), 0.1 * torch.randn(H, device="cuda"),
                   torch.randn(T, H, device="cuda").to(BF))
    gx, gz, gdy = (torch.randn(N, D, device="cuda").to(BF) for _ in range(3))
    gw = 1 + 0.1 * torch.randn(D, device="cuda")
    # (kind, width, cfg or None = the table's, programs or None = the table's)
    plan = [("rmsnorm.bwd", 2048, None, None), ("rmsnorm.bwd", 2048, None, 396), ("rmsnorm.bwd", 5120, None, None),
            ("gated.bwd", D, None, None), ("gated.bwd", D, None, 264), ("rmsnorm.fwd", 2048, None, None),
            ("rmsnorm.fwd", 5120, None, None), ("gated.fwd", D, None, None)]
    for kind, width, cfg, P in plan:
        if time.time() > deadline:
            log("sweep: out of time")
            break
        name = kind
        try:
            if kind.startswith("rmsnorm"):
                x, w, dy = data[width]
                fb, bb = rms_bytes(T, width)
                if kind == "rmsnorm.fwd":
                    rec(name, f"H{width}", cfg or rconf.fwd_config(width, "large"), P,
                        device_ms(lambda: rops.rmsnorm_fwd(x, w, EPS, cfg=cfg)), fb)
                else:
                    rec(name, f"H{width}", cfg or rconf.bwd_config(width, "large"), P,
                        device_ms(lambda: rops.rmsnorm_bwd(dy, x, w, EPS, cfg=cfg, programs=P)), bb)
            else:
                fb, bb = gated_bytes(N, D)
                if kind == "gated.fwd":
                    rec(name, "32x128", cfg or gconf.fwd_config(D, "large"), P,
                        device_ms(lambda: gops.gated_fwd(gx, gz, gw, EPS, cfg=cfg)), fb)
                else:
                    rec(name, "32x128", cfg or gconf.bwd_config(D, "large"), P,
                        device_ms(lambda: gops.gated_bwd(gdy, gx, gz, gw, EPS, cfg=cfg, programs=P)), bb)
        except Exception as e:  # noqa: BLE001
            log(f"sweep {kind} {cfg} failed:", repr(e)[:300])
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="32k tokens only")
    ap.add_argument("--no-sweep", action="store_true", help="skip the config sweep")
    ap.add_argument("--sweep-seconds", type=float, default=float(os.environ.get("NORMS_SWEEP_S", 40)))
    ap.add_argument("--skip", default="", help="comma-separated peers to leave out (e.g. torch.compile)")
    ap.add_argument("--name", default="norms", help="results file stem (bench/results/<name>.json)")
    ns = ap.parse_args()
    SKIP.update(p for p in ns.skip.split(",") if p)
    torch.manual_seed(0)
    for h in (2048, 5120):
        log(cake.prebuild("rmsnorm", hidden_size=h))
    log(cake.prebuild("gated_rmsnorm", head_dim=128))
    rows, errors = bench_rows(ns.quick)
    print()
    print_table(rows, ["shape", "impl", "fwd_ms", "bwd_ms", "fwd_tbps", "bwd_tbps", "fwd_tbps_queued",
                       "bwd_tbps_queued", "fwd_tbps_synced", "bwd_tbps_synced"])
    print()
    print_table(errors, ["op", "shape", "impl", "y", "dx", "dz", "dw"])
    sw = [] if ns.no_sweep else sweep(time.time() + ns.sweep_seconds)
    if sw:
        print()
        print_table(sw, ["kernel", "shape", "cfg", "programs", "ms", "tbps"])
    path = write_results(ns.name, rows, {"errors": errors, "sweep": sw, "copy_tbps": COPY_TBPS,
                                         "timer_note": TIMER_NOTE})
    log("wrote", path)


if __name__ == "__main__":
    main()
