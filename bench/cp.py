"""Benchmark of context parallelism's compute cost on one GPU: gdn and kda over W simulated ranks against the plain
call on the same tokens, in one run.

4 x 32768 tokens (four documents); gdn at Qwen3-Next's heads (H 16, HV 32, K = V = 128, L2 norm in the kernel),
kda at Kimi-Linear's (H = HV = 32, K = V = 128, the safe gate with lower bound -5, in the kernel). The plain
provider is the public call with cu_seqlens (no state in or out); a "cp W=n" provider runs the n ranks' CP stages
one after another (`_runtime/cp.run_simulated`: the all_gather is a stack in one process), so its time is the sum
of the ranks' compute; "per-rank W=n" runs the plain call on each rank's tokens and local documents (no exchange),
one after another: the same split work without CP's extra state passes and chain kernels. The issue's bar: CP at
most 15 % over the plain device time (read against per-rank; the one call is printed too: a rank's shorter,
fewer sequences fill fewer SMs in the sequential state kernels, a cost of splitting that W real GPUs do not sum).
Zigzag runs with its default state exchanges (2) and with 1, 3 and 4 ("E=n": up to n - 1 pieces of each document
wait for their true state instead of running the extra pass; the per-rank baseline is the same). The all_gather
bytes per rank and layer call (sent, over every exchange; a rank receives W times as much) are printed beside it and
written in `overhead`. Modes fwd, bwd (the backward stages on the kept forward), full. Writes bench/results/cp.json
(see _common.py for the row format).

    python bench/cp.py [--quick] [--dry-run] [harness options: --help]
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS, Autograd, Bench, Calls, Provider, parser, print_table, run, write_results

from miles_ext_kernels.cake import gdn, kda
from miles_ext_kernels.cake._runtime import cp as rcp

NAMES = ("q", "k", "v", "g", "beta")
OPS = {"gdn": dict(H=16, HV=32, K=128, V=128), "kda": dict(H=32, HV=32, K=128, V=128)}
SAFE_LB = -5.0
BAR = 1.15  # the bar: CP time / plain time
# (layout, W, state exchanges; None: the default, the only one with a per-rank baseline, which does not depend on it)
PLANS = [("contiguous", 2, None), ("contiguous", 4, None), ("contiguous", 8, None), ("zigzag", 4, None),
         ("zigzag", 4, 1), ("zigzag", 4, 3), ("zigzag", 4, 4)]
PLAIN = "plain (one call)"


def make(p, device="cuda"):
    gen = torch.Generator(device="cpu").manual_seed(0)
    T = sum(p["lens"])

    def r(*s):
        return torch.randn(*s, generator=gen)

    H, HV, K, V = p["H"], p["HV"], p["K"], p["V"]
    x = {"q": r(1, T, H, K).bfloat16(), "k": r(1, T, H, K).bfloat16(), "v": r(1, T, HV, V).bfloat16(),
         "beta": torch.rand(1, T, HV, generator=gen).float(), "do": r(1, T, HV, V).bfloat16()}
    if p["op"] == "gdn":
        x["g"] = torch.nn.functional.logsigmoid(r(1, T, HV)).float()
    else:
        x["g"] = r(1, T, HV, K).float()
        x["A_log"] = (0.5 * r(HV)).float()
        x["dt_bias"] = (0.5 * r(HV * K)).float()
    x = {n: t.to(device) for n, t in x.items()}
    x["cu_list"] = [0] + torch.tensor(p["lens"]).cumsum(0).tolist()
    x["cu"] = torch.tensor(x["cu_list"], dtype=torch.int32, device=device)
    return x


def _ops(op):
    import importlib

    return importlib.import_module(f"miles_ext_kernels.cake._impl.{op}.ops")


def plain(x, p):
    if p["op"] == "gdn":
        return Autograd(lambda q, k, v, g, beta: gdn.chunk_gated_delta_rule(
            q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])[0], [x[n] for n in NAMES],
            wrt=range(5), grad_outputs=x["do"])
    return Autograd(lambda q, k, v, g, beta, A_log, dt_bias: kda.chunk_kda(
        q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
        safe_gate=True, lower_bound=SAFE_LB, cu_seqlens=x["cu"])[0],
        [x[n] for n in NAMES + ("A_log", "dt_bias")], wrt=range(7), grad_outputs=x["do"])


def _stage_args(x, p):
    ops = _ops(p["op"])
    scale = p["K"] ** -0.5
    if p["op"] == "gdn":
        return ops, [], (scale, True, True)
    gate = ops.gate_kind(True, SAFE_LB)
    return ops, [x["A_log"], x["dt_bias"]], (scale, SAFE_LB, gate, True)


def saved_m_bytes(ctxs, p) -> int:
    """The most bytes of transitions M one rank's forward keeps for its backward (the rows its chains fold)."""
    rows = max(sum(c.state_round(k)["keep"].numel() for k in range(1, c.state_exchanges + 1)) for c in ctxs)
    return rows * p["HV"] * p["K"] * p["K"] * 4


def comm_bytes(ctx, p) -> dict:
    """all_gather bytes one rank sends per layer call (forward states, backward state gradients: every exchange)."""
    HV, K, V = p["HV"], p["K"], p["V"]
    return {"exchanges": ctx.state_exchanges, "fwd_bytes": sum(ctx.max_fwd_send) * HV * K * (V + K) * 4,
            "bwd_bytes": sum(ctx.max_bwd_send) * HV * K * V * 4}


def _name(kind, layout, W, exchanges=None):
    return f"{kind} W={W} {layout}" + (f" E={exchanges}" if exchanges else "")


def simulated(layout, W, exchanges=None):
    def make_calls(x, p):
        T = sum(p["lens"])
        if (layout == "contiguous" and T % W) or (layout == "zigzag" and any(n % (2 * W) for n in p["lens"])):
            from _common import Skip

            raise Skip(f"{layout} needs T / lengths divisible by the CP size")
        ctxs = rcp.simulated_contexts(x["cu_list"], W, layout=layout, state_exchanges=exchanges,
                                      device=x["q"].device)
        ops, params, args = _stage_args(x, p)
        shards = [[rcp.shard(x[n], c).contiguous() for n in NAMES] for c in ctxs]
        dos = [rcp.shard(x["do"], c).contiguous() for c in ctxs]
        kept = {}

        def fwd():
            kept["f"] = rcp.run_simulated([ops.cp_forward_stage(c, *s, *params, *args) for c, s in zip(ctxs, shards)])
            return kept["f"]

        def bwd():
            if "f" not in kept:
                fwd()
            return rcp.run_simulated([ops.cp_backward_stage(c, f[1], d) for c, f, d in zip(ctxs, kept["f"], dos)])

        def full():
            fwd()
            return bwd()

        def result():
            fwd()
            g = bwd()
            o = rcp.unshard([f[0] for f in kept["f"]], ctxs)
            return [o] + [rcp.unshard([b[i] for b in g], ctxs) for i in range(len(NAMES))]

        return Calls(fwd=fwd, bwd=bwd, full=full, result=result)

    return make_calls


def per_rank(layout, W):
    """The plain call (no exchange) on each rank's tokens with its local documents, one rank after another: the
    work of W ranks without CP's extra passes (splitting a document leaves fewer, shorter sequences per call; this
    baseline has that too, so `cp / per-rank` is CP's own cost)."""
    def make_calls(x, p):
        T = sum(p["lens"])
        if (layout == "contiguous" and T % W) or (layout == "zigzag" and any(n % (2 * W) for n in p["lens"])):
            from _common import Skip

            raise Skip(f"{layout} needs T / lengths divisible by the CP size")
        ctxs = rcp.simulated_contexts(x["cu_list"], W, layout=layout, device=x["q"].device)
        names = NAMES + (("A_log", "dt_bias") if p["op"] == "kda" else ())
        leaves = [[(rcp.shard(x[n], c) if n in NAMES else x[n]).detach().clone().requires_grad_(True) for n in names]
                  for c in ctxs]
        dos = [rcp.shard(x["do"], c).contiguous() for c in ctxs]
        kept = {}

        def call(c, args):
            if p["op"] == "gdn":
                return gdn.chunk_gated_delta_rule(*args, use_qk_l2norm_in_kernel=True, cu_seqlens=c.cu_seqlens)[0]
            return kda.chunk_kda(*args[:5], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=args[5],
                                 dt_bias=args[6], safe_gate=True, lower_bound=SAFE_LB, cu_seqlens=c.cu_seqlens)[0]

        def fwd():
            kept["o"] = [call(c, lv) for c, lv in zip(ctxs, leaves)]
            return kept["o"]

        def bwd():
            if "o" not in kept:
                fwd()
            return [torch.autograd.grad(o, lv, d, retain_graph=True) for o, lv, d in zip(kept["o"], leaves, dos)]

        def full():
            fwd()
            return bwd()

        return Calls(fwd=fwd, bwd=bwd, full=full)

    return make_calls


def shapes(quick: bool) -> dict:
    out = {}
    for op, dims in OPS.items():
        out[f"{op} 4x32768"] = dict(dims, op=op, lens=[32768] * 4)
        if not quick:  # rank boundaries inside documents for every plan (4 x 32768 aligns them for W = 2, 4)
            out[f"{op} 1x131072"] = dict(dims, op=op, lens=[131072])
            out[f"{op} 6 irregular"] = dict(dims, op=op, lens=[40960, 8192, 24576, 16384, 32768, 8192])
    return out


DRY = {"gdn 2 docs": dict(op="gdn", H=1, HV=2, K=16, V=16, lens=[32, 32]),
       "kda 2 docs": dict(op="kda", H=1, HV=2, K=16, V=16, lens=[32, 32])}


def declare(quick: bool = False) -> Bench:
    providers = [Provider(PLAIN, plain, det=True, ours=True)]
    for layout, W, exchanges in PLANS:
        providers.append(Provider(_name("cp", layout, W, exchanges), simulated(layout, W, exchanges), ours=True,
                                  accuracy=False))
        if exchanges is None:
            providers.append(Provider(_name("per-rank", layout, W), per_rank(layout, W), ours=True, accuracy=False))
    return Bench(name="cp", shapes=shapes(quick), dry_shapes=DRY, inputs=make, providers=providers,
                 modes=("fwd", "bwd", "full"), warmup=2, rep=10, lead_ms=5.0)


def overheads(rows: list, params: dict) -> list:
    """Per shape, plan and mode (device timer when present): CP time over the per-rank plain calls' (CP's own cost:
    the extra state passes, the chain and the exchange's copies; the bar) and over the one call's, with the bytes."""
    out = []
    timer = "device_ms" if any("device_ms" in r for r in rows) else "synced_ms"
    t = {(r["shape"], r["provider"], r["mode"]): r[timer] for r in rows if timer in r}
    for (shape, prov, mode), ms in t.items():
        if not prov.startswith("cp "):
            continue
        _, w, layout, *rest = prov.split()
        exchanges = int(rest[0][2:]) if rest else None
        base = t.get((shape, f"per-rank {w} {layout}", mode))
        one = t.get((shape, PLAIN, mode))
        if base is None:
            continue
        p = params[shape]
        ctxs = rcp.simulated_contexts([0] + torch.tensor(p["lens"]).cumsum(0).tolist(), int(w[2:]), layout=layout,
                                      state_exchanges=exchanges)
        out.append({"shape": shape, "provider": prov, "mode": mode, "vs_per_rank": round(ms / base, 3),
                    "bar_ok": ms / base <= BAR, "vs_one_call": round(ms / one, 3) if one else None,
                    **comm_bytes(ctxs[0], p), "saved_m_bytes": saved_m_bytes(ctxs, p)})
    return out


def main(argv=None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--quick", action="store_true", help="4 x 32768 only")
    args = ap.parse_args(argv)
    bench = declare(args.quick)
    rc = run(bench, args)
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "mek-bench-dry-run" if args.dry_run
                                           else RESULTS)
    path = out / f"{args.name or 'cp'}.json"
    doc = json.loads(path.read_text())
    params = bench.dry_shapes if args.dry_run else bench.shapes
    ov = overheads(doc["rows"], params)
    if ov:
        print()
        print(f"CP time / the per-rank plain calls' (bar <= {BAR}) and / the one call's; all_gather bytes one rank "
              "sends per layer call; the most bytes of transitions a rank's forward keeps for its backward")
        print_table(ov, list(ov[0]))
        rows = doc.pop("rows")
        write_results(path.stem, rows, dict(doc, overhead=ov), out_dir=path.parent)
    return rc


if __name__ == "__main__":
    sys.exit(main())
