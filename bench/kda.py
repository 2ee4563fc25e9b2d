"""Benchmark of `kda` (chunked Kimi Delta Attention, bf16) against fla 0.6.0's chunk_kda, in one run.

Two models' calls, each on 32768 tokens as packed documents (16 x 2048; also 1 x 32768 and 8 irregular documents,
gdn's layouts), L2 norm of q, k in the kernel, the gate in the kernel (raw gate g fp32 [T, HV, K], A_log [HV],
dt_bias [HV * K] fp32, initialised as fla's KDA layer does), beta fp32 after the sigmoid, an initial state and the
final state (fp32):
  Kimi-Linear   H = HV = 32, K = V = 128, the softplus gate -exp(A_log) softplus(g + dt_bias), states [N, HV, K, V]
  Kimi-K3 TP8   H = HV = 12 (one rank of tensor parallel 8), K = V = 128, the safe gate (lower_bound -5:
                -5 sigmoid(exp(A_log) (g + dt_bias))), states [N, HV, V, K] (the call miles makes)
Modes fwd, bwd (autograd.grad on a kept graph), full (forward + backward), each synced (`median_ms`) and in device
time (`device_ms`, behind a 5 ms spin). FLOPs: the products of our chunked algorithm (`flops`; the same count for
fla's rows, so TFLOP/s compare times). det bits checked to repeat. After the table, fla's time over ours per shape
and mode (the issue's bar: >= 1.3, i.e. our det time <= fla's / 1.3), also written as `vs_fla` in the results.
fla's kda backward has its own dq / dk kernel, not the gated chunk_bwd_dqkwg that fla refuses on Hopper with
triton 3.4 - 3.7.0 (bench/gdn.py lifts that guard), so nothing is lifted here. Writes bench/results/kda.json (see
_common.py for the row format).

    python bench/kda.py [--no-fla] [--quick] [--rep N] [--dry-run] [harness options: --help]
"""
from __future__ import annotations

import inspect
import json
import math
import sys
import tempfile
from importlib import metadata
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MATMUL_TFLOPS, RESULTS, Autograd, Bench, Provider, parse_peer_args, print_table, run, write_results
from gdn import layouts

from miles_ext_kernels.cake import kda

BT = 64
SAFE_LB = -5.0  # Kimi-K3's lower bound (docs/kda.md)
# model label -> head counts, head dims, gate ("softplus", or "safe": the lower-bound gate), [V, K] states
MODELS = {
    "Kimi-Linear H32": dict(H=32, HV=32, K=128, V=128, gate="softplus", trans=False),
    "Kimi-K3 TP8 H12": dict(H=12, HV=12, K=128, V=128, gate="safe", trans=True),
}
OURS, FLA = "cake det", "fla 0.6.0"
BAR = 1.3  # the bar: fla's time / ours


def products(p, mode):
    """(bf16, tf32) FLOPs of the products of our chunked algorithm (chunk C = 64, per chunk and value head), as the
    kernels compute them: the in-chunk decay-weighted products go by 16-row sub-blocks (the forward: one [16, K] x
    [K, C] product per sub-block and operand, its columns from the sub-block on zero; the backward: one [16, 16] x
    [16, K] product per pair of sub-blocks, matrix and side). Left out: the diagonal sub-blocks (elementwise fp32,
    no tensor cores), the 16 x 16 block inverse (< 1 %) and the elementwise work (gate, L2 norm, decays)."""
    k, v, c = p["K"], p["V"], BT
    chunks = sum((n + c - 1) // c for n in p["lens"]) * p["HV"]
    if mode == "fwd":
        bf16 = (2 * c * c * k + 2 * c * c * v  # w = A X, u = A Y
                + 4 * c * k * v                # state recurrence: dlt = u - w h, h' += (decayed k)^T dlt
                + 2 * c * k * v + 2 * c * c * v)  # o = (q exp G) h + Aqk dlt
        tf32 = 2 * 2 * c * c * k               # Aqk and L: 4 sub-blocks x 2 operands x 2 (16 C k)
    elif mode == "bwd":
        bf16 = (4 * c * c * v                  # in-chunk d(dlt) = Aqk^T do, dAqk = do dlt^T
                + 6 * c * k * v                # reverse state recurrence: dd, dh
                + 6 * c * k * v                # dq, dw, dk's state terms
                + 4 * c * c * v + 4 * c * c * k + 4 * c * c * c)  # through w, u and A: dY, dA, dX, dL
        tf32 = 6 * 2 * 2 * 2 * 16 * 16 * k     # 6 sub-block pairs x (dAqk, dL) x (rows, columns) x 2 (16 16 k)
    else:
        return None
    return chunks * bf16, chunks * tf32


def flops(p, mode):
    """FLOPs of our chunked algorithm (bf16 + tf32 products, `products`); full: fwd + bwd."""
    parts = products(p, mode)
    return None if parts is None else float(sum(parts))


def make(p, device="cuda"):
    """The inputs of one shape: q, k, v, g (raw gate), beta, A_log, dt_bias, h0, cu, do, dht."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    lens, H, HV, K, V = p["lens"], p["H"], p["HV"], p["K"], p["V"]
    T, N = sum(lens), len(lens)

    def r(*s):
        return torch.randn(*s, generator=gen)

    q = r(1, T, H, K).to(torch.bfloat16)
    k = r(1, T, H, K).to(torch.bfloat16)
    v = r(1, T, HV, V).to(torch.bfloat16)
    g = r(1, T, HV, K).float()
    beta = torch.rand(1, T, HV, generator=gen).float()
    # fla's KDA layer: A_log = log U(1, 16) (zeros with the safe gate), dt_bias = softplus^-1 of dt ~ logU(1e-3, 0.1)
    if p["gate"] == "safe":
        A_log = torch.zeros(HV)
    else:
        A_log = torch.empty(HV).uniform_(1, 16, generator=gen).log()
    dt = torch.exp(torch.rand(HV * K, generator=gen) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    state = (N, HV, V, K) if p["trans"] else (N, HV, K, V)
    h0 = 0.1 * r(*state)
    do = r(1, T, HV, V).to(torch.bfloat16)
    dht = 0.1 * r(*state)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    x = dict(q=q, k=k, v=v, g=g, beta=beta, A_log=A_log.float(), dt_bias=dt_bias.float(), h0=h0.float(), cu=cu,
             do=do, dht=dht.float())
    return {n: t.to(device) for n, t in x.items()}


ARGS = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")


def _gate_kwargs(p):
    safe = p["gate"] == "safe"
    return dict(use_gate_in_kernel=True, safe_gate=safe, lower_bound=SAFE_LB if safe else None)


def _call(fn, x):
    """fn(q, k, v, g, beta, A_log, dt_bias, h0) -> (o, final state), differentiated w.r.t. all eight."""
    return Autograd(fn, [x[n] for n in ARGS], wrt=range(len(ARGS)), grad_outputs=(x["do"], x["dht"]))


def ours(x, p):
    cu, gate, trans = x["cu"], _gate_kwargs(p), p["trans"]
    return _call(lambda q, k, v, g, beta, A_log, dt_bias, h0: kda.chunk_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, A_log=A_log,
        dt_bias=dt_bias, transpose_state_layout=trans, cu_seqlens=cu, **gate), x)


def fla(x, p):
    from fla.ops.kda import chunk_kda

    cu, gate = x["cu"].long(), _gate_kwargs(p)
    # the [V, K] state layout: `state_v_first`, named `transpose_state_layout` in releases before the rename
    params = inspect.signature(chunk_kda).parameters
    layout = {"state_v_first" if "state_v_first" in params else "transpose_state_layout": p["trans"]}
    return _call(lambda q, k, v, g, beta, A_log, dt_bias, h0: chunk_kda(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, A_log=A_log,
        dt_bias=dt_bias, cu_seqlens=cu, **gate, **layout), x)


def shapes(quick: bool) -> dict:
    return {f"{model} {label}": dict(dims, lens=lens) for model, dims in MODELS.items()
            for label, lens in layouts(quick)}


# tiny: both gates and both state layouts, documents shorter and longer than a chunk, through the interpreter
DRY_SHAPES = {
    "softplus gate, 2 docs H1/HV2 K16/V16": dict(H=1, HV=2, K=16, V=16, gate="softplus", trans=False, lens=[9, 70]),
    "safe gate, [V, K] states, 2 docs H1/HV1 K16/V32": dict(H=1, HV=1, K=16, V=32, gate="safe", trans=True,
                                                            lens=[14, 5]),
}


def declare(quick: bool = False) -> Bench:
    return Bench(
        name="kda",
        shapes=shapes(quick),
        dry_shapes=DRY_SHAPES,
        inputs=make,
        providers=[
            Provider(OURS, ours, config={"kda_variant": "det"}, det=True, ours=True),
            Provider(FLA, fla, requires=("fla",), on_cpu=False),
        ],
        modes=("fwd", "bwd", "full"),
        flops=flops,
        warmup=3,
        lead_ms=5.0,
    )


def ratios(rows, timers, ours=OURS, peer=FLA) -> list[dict]:
    """Per shape and mode where both ran: `<timer> fla/ours` = peer's time / ours in each timer, and whether the
    first timer's meets BAR."""
    by = {(r["shape"], r["mode"], r["provider"]): r for r in rows}
    out = []
    for (shape, mode, prov), mine in by.items():
        theirs = by.get((shape, mode, peer))
        if prov != ours or theirs is None:
            continue
        row = {"shape": shape, "mode": mode}
        for t in timers:
            if mine.get(f"{t}_ms") and theirs.get(f"{t}_ms"):
                row[f"{t} fla/ours"] = theirs[f"{t}_ms"] / mine[f"{t}_ms"]
        key = f"{timers[0]} fla/ours"
        if key in row:
            row[f"bar >= {BAR}"] = row[key] >= BAR
        out.append(row)
    return out


def _fla_version():
    for dist in ("flash-linear-attention", "fla-core"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return None


def write_ratios(path: Path) -> list[dict]:
    """Print fla's time over ours per shape and mode from the results file at `path` and add them to it as `vs_fla`
    (nothing where fla did not run); the device timer first, the bar is read there."""
    doc = json.loads(path.read_text())
    timers = sorted(doc["timers"], key=lambda t: t != "device")
    vs = ratios(doc["rows"], timers)
    if vs:
        print()
        print(f"{FLA} time / ours (>= {BAR}: our det within the issue's bar)")
        print_table(vs, list(dict.fromkeys(k for r in vs for k in r)))
        rows = doc.pop("rows")
        write_results(path.stem, rows, dict(doc, vs_fla=vs), out_dir=path.parent)  # doc's environment is kept
    return vs


def main(argv=None) -> int:
    args = parse_peer_args(__doc__, argv, FLA, "main layout (16 x 2048) only, both models")
    extra = {"floors_note": f"matmul {MATMUL_TFLOPS} TFLOP/s", "fla_version": _fla_version()}
    rc = run(declare(args.quick), args, extra=extra)
    # where run wrote the results (_common.run's default folders)
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "mek-bench-dry-run" if args.dry_run
                                           else RESULTS)
    write_ratios(out / f"{args.name or 'kda'}.json")
    return rc


if __name__ == "__main__":
    sys.exit(main())
