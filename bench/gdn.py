"""Benchmark of `gdn` (chunked Gated DeltaNet, bf16) against fla 0.6.0's chunk_gated_delta_rule, in one run.

Qwen3-Next's shape: q, k H 16 x K 128, v HV 32 x V 128, L2 norm of q, k in the kernel, 32768 tokens as packed
documents (16 x 2048; also 1 x 32768 and 8 irregular documents), with an initial state and the final state.
Modes fwd, bwd (autograd.grad on a kept graph), full (forward + backward), each synced (`median_ms`) and in
device time (`device_ms`, behind a 5 ms spin: the host queues a whole forward + backward behind it). FLOPs: the
matmuls of our chunked algorithm (the same count is used for fla's rows, so TFLOP/s compare times). det bits
checked to repeat. fla refuses triton 3.4 - 3.7.0 on Hopper for its gated backward (a codegen bug): its guard is
lifted for timing only. Writes bench/results/gdn.json (see _common.py for the row format).

    python bench/gdn.py [--no-fla] [--quick] [--rep N] [--dry-run] [harness options: --help]
"""
from __future__ import annotations

import sys
from itertools import pairwise
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MATMUL_TFLOPS, Autograd, Bench, Provider, parse_peer_args, run

from miles_ext_kernels.cake import gdn

H, HV, K, V, BT = 16, 32, 128, 128, 64
DIMS = {"H": H, "HV": HV, "K": K, "V": V}


def layouts(quick: bool):
    """(label, document lengths) of the benchmark (bench/ab.py reads them too)."""
    out = [("16x2048", [2048] * 16)]
    if not quick:
        out.append(("1x32768", [32768]))
        g = torch.Generator().manual_seed(1)
        cuts = sorted(torch.randperm(32767, generator=g)[:7].add(1).tolist())
        b = [0] + cuts + [32768]
        out.append(("8 irregular docs", [y - x for x, y in pairwise(b)]))
    return out


def flops(p, mode):
    """Matmul FLOPs of the chunked algorithm (forward; backward without recomputation)."""
    k, v = p["K"], p["V"]
    chunks = sum((n + BT - 1) // BT for n in p["lens"]) * p["HV"]
    if mode == "fwd":
        return chunks * BT * (2 * BT * k + 2 * BT * (k + v) + 4 * k * v + 2 * k * v + 2 * BT * k + 2 * BT * v)
    if mode == "bwd":
        return chunks * BT * (2 * BT * k + 2 * BT * v               # dv local
                              + 6 * k * v                           # state backward
                              + 6 * k * v + 4 * BT * v + 4 * BT * k  # dq, dk, dw
                              + 4 * BT * k + 4 * BT * v + 8 * BT * BT + 6 * BT * k)  # WY backward
    return None  # full: fwd + bwd


def make(lens, device="cuda", dims=None):
    """The inputs of one layout (bench/ab.py reads them too): q, k, v, g, beta, h0, cu, do, dht."""
    d = dims or DIMS
    g = torch.Generator(device="cpu").manual_seed(0)
    T, N = sum(lens), len(lens)

    def r(*s):
        return torch.randn(*s, generator=g)

    q = r(1, T, d["H"], d["K"]).to(torch.bfloat16).to(device)
    k = r(1, T, d["H"], d["K"]).to(torch.bfloat16).to(device)
    v = r(1, T, d["HV"], d["V"]).to(torch.bfloat16).to(device)
    gg = torch.nn.functional.logsigmoid(r(1, T, d["HV"])).float().to(device)
    beta = torch.rand(1, T, d["HV"], generator=g).float().to(device)
    h0 = (0.1 * r(N, d["HV"], d["K"], d["V"])).float().to(device)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    do = r(1, T, d["HV"], d["V"]).to(torch.bfloat16).to(device)
    dht = (0.1 * r(N, d["HV"], d["K"], d["V"])).float().to(device)
    return {"q": q, "k": k, "v": v, "g": gg, "beta": beta, "h0": h0, "cu": cu, "do": do, "dht": dht}


def _call(fn, x):
    """fn(q, k, v, g, beta, h0) -> (o, final state), differentiated w.r.t. all six."""
    args = [x[n] for n in ("q", "k", "v", "g", "beta", "h0")]
    return Autograd(fn, args, wrt=range(6), grad_outputs=(x["do"], x["dht"]))


def ours(x, p):
    cu = x["cu"]
    return _call(lambda q, k, v, g, beta, h0: gdn.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu), x)


def fla(x, p):
    from fla.ops.common import chunk_o
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    chunk_o.TRITON_ABOVE_3_7_1 = True  # lift the Hopper guard (timing only)
    cu = x["cu"].long()
    return _call(lambda q, k, v, g, beta, h0: chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        cu_seqlens=cu), x)


def declare(quick: bool = False) -> Bench:
    return Bench(
        name="gdn",
        shapes={label: dict(DIMS, lens=lens) for label, lens in layouts(quick)},
        dry_shapes={"2 docs H1/HV2 K16/V16": {"H": 1, "HV": 2, "K": 16, "V": 16, "lens": [9, 14]}},
        inputs=lambda p, device: make(p["lens"], device, p),
        providers=[
            Provider("cake det", ours, config={"gdn_variant": "det"}, det=True, ours=True),
            Provider("cake det, recompute-state", ours, config={"gdn_variant": "det", "gdn_recompute_state": True},
                     det=True, ours=True),
            Provider("fla 0.6.0", fla, requires=("fla",), on_cpu=False),
        ],
        modes=("fwd", "bwd", "full"),
        flops=flops,
        warmup=3,
        lead_ms=5.0,
    )


def main(argv=None) -> int:
    args = parse_peer_args(__doc__, argv, "fla 0.6.0", "main layout only")
    return run(declare(args.quick), args, extra={"floors_note": f"matmul {MATMUL_TFLOPS} TFLOP/s"})


if __name__ == "__main__":
    sys.exit(main())
