"""Benchmark of rmsnorm (zero-centred) and gated_rmsnorm against their peers, in the same run, on the GPU.

    python bench/norms.py [--quick] [--no-sweep] [--skip torch.compile] [--dry-run] [harness options: --help]

Peers: the PyTorch eager reference, torch.compile of it, Liger's LigerRMSNormFunction (offset 1.0, casting mode
"gemma" = everything in fp32, as Qwen3NextRMSNorm) and fla's rms_norm_gated (FusedRMSNormGated's function, swish).
Shapes: Qwen3-Next (H 2048; 32 value heads x 128) and Qwen3.5-27B (H 5120); ours at 4k-64k tokens, peers at 32k.
Bytes = each input read once + each output written once (weights included); TB/s = bytes / time. Modes fwd and
bwd (autograd.grad on a kept graph), each in device time (`device_ms`), queued (`queued_ms`) and synced
(`median_ms`). Weights fp32. Accuracy: relative RMS vs an FP64 reference (computed on the GPU) at 8k tokens, for
every impl but torch.compile. Writes bench/results/norms.json (rows of both ops, `accuracy`, the config `sweep`).
"""
from __future__ import annotations

import os
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch
from _common import COPY_TBPS, Autograd, Bench, Provider, device_ms, parser, print_table, run

from miles_ext_kernels import cake

BF = torch.bfloat16
EPS = 1e-6
NH, HD = 32, 128  # the gated norm's value heads x head dim
TOKENS = (4096, 16384, 32768, 65536)
PEER_TOKENS = 32768


def peers_here(label, p):
    return p["T"] == PEER_TOKENS or p.get("peers", False)


def _gen(device, seed=0):
    return torch.Generator(device=device).manual_seed(seed)


# ---------------------------------------------------------------------------------------------------- rmsnorm
def rms_bytes(p, mode):
    T, H = p["T"], p["H"]
    return {"fwd": 2 * T * H * 2 + H * 4, "bwd": 3 * T * H * 2 + 2 * H * 4}.get(mode)


def rms_inputs(p, device):
    g = _gen(device)
    T, H = p["T"], p["H"]
    return {"x": torch.randn(T, H, device=device, generator=g).to(BF),
            "w": 0.1 * torch.randn(H, device=device, generator=g),
            "dy": torch.randn(T, H, device=device, generator=g).to(BF)}


def _rms(fn):
    return lambda x, p: Autograd(fn, (x["x"], x["w"]), wrt=(0, 1), grad_outputs=x["dy"])


def _eager_rms():
    from miles_ext_kernels.cake._impl.rmsnorm.reference import zero_centered_rmsnorm_eager

    return zero_centered_rmsnorm_eager


def _compiled(make_fn):
    compiled = {}

    def get():
        if not compiled:
            compiled["fn"] = torch.compile(make_fn(), dynamic=False)
        return compiled["fn"]
    return get


def rms_reference(x, p):
    from miles_ext_kernels.cake._impl.rmsnorm.reference import grads_ref

    return grads_ref(x["x"], x["w"], x["dy"], EPS)


def liger_rms(x, p):
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return _rms(lambda xx, w: LigerRMSNormFunction.apply(xx, w, EPS, 1.0, "gemma", False, None))(x, p)


def rmsnorm_bench(tokens) -> Bench:
    compiled = _compiled(_eager_rms)
    return Bench(
        name="rmsnorm",
        shapes={f"rmsnorm H{H} T{T // 1024}k": {"T": T, "H": H} for H in (2048, 5120) for T in tokens},
        dry_shapes={"rmsnorm H256 T37": {"T": 37, "H": 256, "peers": True}},
        inputs=rms_inputs,
        providers=[
            Provider(f"cake {v}", _rms(lambda xx, w: cake.rmsnorm.zero_centered_rmsnorm(xx, w, EPS)),
                     config={"rmsnorm_variant": v}, det=v == "det", ours=True) for v in ("det", "fast")
        ] + [
            Provider("eager", lambda x, p: _rms(lambda xx, w: _eager_rms()(xx, w, EPS))(x, p), when=peers_here),
            Provider("torch.compile", lambda x, p: _rms(lambda xx, w: compiled()(xx, w, EPS))(x, p),
                     when=peers_here, on_cpu=False, accuracy=False),
            Provider("liger", liger_rms, requires=("liger_kernel",), on_cpu=False, when=peers_here),
        ],
        io_bytes=rms_bytes, timers=("device", "queued", "synced"),
        reference=rms_reference, result_names=("y", "dx", "dw"),
        accuracy={f"rmsnorm H{H} T8k": {"T": 8192, "H": H, "peers": True} for H in (2048, 5120)},
        dry_accuracy={"rmsnorm H320 T5": {"T": 5, "H": 320, "peers": True}},
    )


# ---------------------------------------------------------------------------------------------------- gated_rmsnorm
def gated_bytes(p, mode):
    N, D = p["T"] * p["NH"], p["D"]
    return {"fwd": 3 * N * D * 2 + D * 4, "bwd": 5 * N * D * 2 + 2 * D * 4}.get(mode)


def gated_inputs(p, device):
    g = _gen(device)
    s = (p["T"], p["NH"], p["D"])
    return {"x": torch.randn(*s, device=device, generator=g).to(BF),
            "z": torch.randn(*s, device=device, generator=g).to(BF),
            "w": 1 + 0.1 * torch.randn(p["D"], device=device, generator=g),
            "dy": torch.randn(*s, device=device, generator=g).to(BF)}


def _gated(fn):
    return lambda x, p: Autograd(fn, (x["x"], x["z"], x["w"]), wrt=(0, 1, 2), grad_outputs=x["dy"])


def _eager_gated():
    from miles_ext_kernels.cake._impl.gated_rmsnorm.reference import rmsnorm_silu_gate_eager

    return rmsnorm_silu_gate_eager


def gated_reference(x, p):
    from miles_ext_kernels.cake._impl.gated_rmsnorm.reference import grads_ref

    return grads_ref(x["x"], x["z"], x["w"], x["dy"], EPS)


def fla_gated(x, p):
    from fla.modules.norm.fused_norm_gate import rms_norm_gated

    d = p["D"]  # fla takes rows of one head: [T * NH, D]
    return _gated(lambda xx, z, w: rms_norm_gated(xx.view(-1, d), z.view(-1, d), w, None, "swish",
                                                  eps=EPS).view(xx.shape))(x, p)


def gated_bench(tokens) -> Bench:
    compiled = _compiled(_eager_gated)
    return Bench(
        name="gated_rmsnorm",
        shapes={f"gated {NH}x{HD} T{T // 1024}k": {"T": T, "NH": NH, "D": HD} for T in tokens},
        dry_shapes={"gated 4x128 T9": {"T": 9, "NH": 4, "D": 128, "peers": True}},
        inputs=gated_inputs,
        providers=[
            Provider(f"cake {v}", _gated(lambda xx, z, w: cake.gated_rmsnorm.rmsnorm_silu_gate(xx, z, w, EPS)),
                     config={"gated_rmsnorm_variant": v}, det=v == "det", ours=True) for v in ("det", "fast")
        ] + [
            Provider("eager", lambda x, p: _gated(lambda xx, z, w: _eager_gated()(xx, z, w, EPS))(x, p),
                     when=peers_here),
            Provider("torch.compile", lambda x, p: _gated(lambda xx, z, w: compiled()(xx, z, w, EPS))(x, p),
                     when=peers_here, on_cpu=False, accuracy=False),
            Provider("fla", fla_gated, requires=("fla",), on_cpu=False, when=peers_here),
        ],
        io_bytes=gated_bytes, timers=("device", "queued", "synced"),
        reference=gated_reference, result_names=("y", "dx", "dz", "dw"),
        accuracy={f"gated {NH}x{HD} T8k": {"T": 8192, "NH": NH, "D": HD, "peers": True}},
        dry_accuracy={"gated 2x64 T5": {"T": 5, "NH": 2, "D": 64, "peers": True}},
    )


# ---------------------------------------------------------------------------------------------------- tuning
def sweep(deadline):
    """INTERNAL LAUNCHERS (tuning only): alternative fixed configs of our kernels at 32k tokens, the launchers in
    `_impl/*/ops` called directly with `cfg` / `programs` overrides (their signatures move with the
    implementation), to fill the table. Backward first (it matters most); `programs` is matched to how many CTAs
    fit on an SM. Device timing."""
    from miles_ext_kernels.cake._impl.gated_rmsnorm import configs as gconf
    from miles_ext_kernels.cake._impl.gated_rmsnorm import ops as gops
    from miles_ext_kernels.cake._impl.rmsnorm import configs as rconf
    from miles_ext_kernels.cake._impl.rmsnorm import ops as rops

    out = []
    T = 32768
    N, D = T * NH, HD

    def log(*a):
        print(*a, flush=True)

    def rec(kind, shape, cfg, P, ms, nbytes):
        out.append({"kernel": kind, "shape": shape, "cfg": list(cfg), "programs": P or "table", "ms": ms,
                    "tbps": nbytes / ms / 1e9})
        log(out[-1])

    data = {H: (torch.randn(T, H, device="cuda").to(BF), 0.1 * torch.randn(H, device="cuda"),
                torch.randn(T, H, device="cuda").to(BF)) for H in (2048, 5120)}
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
                p = {"T": T, "H": width}
                if kind == "rmsnorm.fwd":
                    ms = device_ms(partial(rops.rmsnorm_fwd, x, w, EPS, cfg=cfg))
                    rec(name, f"H{width}", cfg or rconf.fwd_config(width, "large"), P, ms, rms_bytes(p, "fwd"))
                else:
                    ms = device_ms(partial(rops.rmsnorm_bwd, dy, x, w, EPS, cfg=cfg, programs=P))
                    rec(name, f"H{width}", cfg or rconf.bwd_config(width, "large"), P, ms, rms_bytes(p, "bwd"))
            else:
                p = {"T": T, "NH": NH, "D": D}
                if kind == "gated.fwd":
                    ms = device_ms(partial(gops.gated_fwd, gx, gz, gw, EPS, cfg=cfg))
                    rec(name, f"{NH}x{D}", cfg or gconf.fwd_config(D, "large"), P, ms, gated_bytes(p, "fwd"))
                else:
                    ms = device_ms(partial(gops.gated_bwd, gdy, gx, gz, gw, EPS, cfg=cfg, programs=P))
                    rec(name, f"{NH}x{D}", cfg or gconf.bwd_config(D, "large"), P, ms, gated_bytes(p, "bwd"))
        except Exception as e:  # noqa: BLE001 - a candidate that does not compile or run is logged
            log(f"sweep {kind} {cfg} failed:", repr(e)[:300])
    return out


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="32k tokens only")
    ap.add_argument("--no-sweep", action="store_true", help="skip the config sweep")
    ap.add_argument("--sweep-seconds", type=float, default=float(os.environ.get("NORMS_SWEEP_S", "40")))
    args = ap.parse_args(argv)
    args.name = args.name or "norms"
    tokens = (PEER_TOKENS,) if args.quick else TOKENS
    if not args.dry_run:
        for h in (2048, 5120):
            print(cake.prebuild("rmsnorm", hidden_size=h), flush=True)
        print(cake.prebuild("gated_rmsnorm", head_dim=HD), flush=True)
    sw = [] if args.no_sweep or args.dry_run else sweep(time.time() + args.sweep_seconds)
    if sw:
        print_table(sw, ["kernel", "shape", "cfg", "programs", "ms", "tbps"])
    return run([rmsnorm_bench(tokens), gated_bench(tokens)], args, extra={"sweep": sw, "copy_tbps": COPY_TBPS})


if __name__ == "__main__":
    sys.exit(main())
