"""Per-kernel device time of kda fwd + bwd at 4 x 32768 tokens, H = HV = 32, K = V = 128, safe gate, L2 norm, [V, K]
states (torch.profiler, 5 steps after 3 warm-up steps; run from the repository root on a GPU).

    python bench/kda_profile.py [--cfg JSON ...] [--lens 2048x16] [--heads 12] [--gate safe|softplus] [--same-bits]

--cfg updates entries of the kda config table (as bench/kda_sass.py's, e.g. '{"intra": {"num_warps": 8}}'); given
several times, each is one variant of the same run, from the shipped table, in one process (only the kernels a
variant changes recompile; '{}' is the shipped table itself). --lens: the documents, LENxCOUNT. --gate: the safe
gate (Kimi-K3's) or the softplus gate (Kimi-Linear's). --same-bits: each variant's o, final state and gradients must
equal the first variant's (torch.equal; for variants that change the schedule, not the arithmetic). --fla: fla's
chunk_kda per kernel on the same inputs after the variants (fla installed; its autotune runs in the warm-up)."""
import argparse
import copy
import inspect
import json
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, "bench")
import kda as B  # bench/kda.py: make()

import miles_ext_kernels as mek
from miles_ext_kernels.cake import kda
from miles_ext_kernels.cake._impl.kda import configs

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--cfg", action="append")
ap.add_argument("--lens", default="32768x4")
ap.add_argument("--gate", choices=("safe", "softplus"), default="safe")
ap.add_argument("--same-bits", action="store_true")
ap.add_argument("--fla", action="store_true")
ap.add_argument("--heads", type=int, default=32, help="H = HV (Kimi-Linear 32, Kimi-K3 at TP8 12)")
args = ap.parse_args()
SHIPPED = copy.deepcopy(configs.CFG)
mek.configure(kda_variant="det")
length, count = (int(x) for x in args.lens.split("x"))
p = dict(H=args.heads, HV=args.heads, K=128, V=128, gate=args.gate, trans=True, lens=[length] * count)
x = B.make(p)
leaves = [x[n].requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")]
gate_kw = dict(safe_gate=True, lower_bound=-5.0) if args.gate == "safe" else {}


def step(keep=False, fla=False):
    if fla:
        from fla.ops.kda import chunk_kda as fla_kda
        params = inspect.signature(fla_kda).parameters  # the [V, K] layout's name differs between releases
        layout = {"state_v_first" if "state_v_first" in params else "transpose_state_layout": True}
        o, ht = fla_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                        use_qk_l2norm_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"], cu_seqlens=x["cu"].long(),
                        use_gate_in_kernel=True, **layout, **gate_kw)
        torch.autograd.backward((o, ht), (x["do"], x["dht"]))
        for t in leaves:
            t.grad = None
        return None
    o, ht = kda.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], output_final_state=True,
                          use_qk_l2norm_in_kernel=True, A_log=x["A_log"], dt_bias=x["dt_bias"],
                          transpose_state_layout=True, cu_seqlens=x["cu"], use_gate_in_kernel=True, **gate_kw)
    torch.autograd.backward((o, ht), (x["do"], x["dht"]))
    out = [o.detach(), ht.detach()] + [t.grad for t in leaves] if keep else None
    for t in leaves:
        t.grad = None
    return out


FIRST = []


def profile_variant(cfg, fla=False):
    for name in SHIPPED:
        configs.CFG[name] = dict(SHIPPED[name])
    for name, entry in json.loads(cfg).items():
        configs.CFG[name].update(entry)
    for _ in range(3):
        step(fla=fla)
    torch.cuda.synchronize()
    N = 5
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(N):
            step(fla=fla)
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / N / 1e3, e.count // N) for e in prof.key_averages()
            if e.device_time_total > 0]
    label = "fla" if fla else f"cfg {cfg}"
    print(f"{label} lens {args.lens} gate {args.gate}: total {sum(r[1] for r in rows):.3f} ms/step", flush=True)
    for name, ms, calls in sorted(rows, key=lambda r: -r[1])[:20]:
        print(f"{ms:9.3f} ms/step  x{calls:<3d} {name[:90]}", flush=True)
    if args.same_bits and not fla:
        out = step(keep=True)
        if not FIRST:
            FIRST.extend(out)
        else:
            same = [torch.equal(a, b) for a, b in zip(out, FIRST)]
            rel = [f"{((a.double() - b.double()).norm() / b.double().norm()).item():.1e}" for a, b in zip(out, FIRST)]
            diff = "" if all(same) else (" (relative RMS differences o, ht, dq, dk, dv, dg, dbeta, dA_log, ddt_bias, "
                                         "dh0: " + ", ".join(rel) + ")")
            print(f"cfg {cfg}: bits equal to the first variant's: {all(same)}{diff}", flush=True)


for cfg in args.cfg or ["{}"]:
    profile_variant(cfg)
if args.fla:
    profile_variant("{}", fla=True)
