"""Benchmark of `gdn` (chunked Gated DeltaNet, bf16) against fla 0.6.0's chunk_gated_delta_rule, in one run.

Qwen3-Next's shape: q, k H 16 x K 128, v HV 32 x V 128, L2 norm of q, k in the kernel, 32768 tokens as packed
documents (16 x 2048; also 1 x 32768 and 8 irregular documents), with an initial state and the final state.
Times (`median_ms`: one sync per call, so the host's launch work before the GPU is busy counts): forward; backward
alone (autograd.grad on a kept graph); forward + backward; and forward + backward in device time (`device_ms`: the
host's work hidden behind a GPU spin, what a step sees when its host runs ahead). FLOPs: the matmuls of our
chunked algorithm (the same count is used for fla's row, so TFLOP/s compare times). Also checks that det repeats
bit for bit. fla refuses triton 3.4 - 3.7.0 on Hopper for its gated backward (a codegen bug): its guard is lifted
for timing only. Prints a table; writes bench/results/gdn.json.

    python bench/gdn.py [--no-fla] [--quick]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MATMUL_TFLOPS, device_ms, median_ms, print_table, write_results  # noqa: E402

import miles_ext_kernels as mek  # noqa: E402
from miles_ext_kernels.cake import gdn  # noqa: E402

H, HV, K, V, BT = 16, 32, 128, 128, 64


def layouts(quick: bool):
    out = [("16x2048", [2048] * 16)]
    if not quick:
        out.append(("1x32768", [32768]))
        g = torch.Generator().manual_seed(1)
        cuts = sorted(torch.randperm(32767, generator=g)[:7].add(1).tolist())
        b = [0] + cuts + [32768]
        out.append(("8 irregular docs", [y - x for x, y in zip(b[:-1], b[1:])]))
    return out


def flops(lens):
    """Matmul FLOPs of the chunked algorithm (forward; backward without recomputation)."""
    chunks = sum((n + BT - 1) // BT for n in lens) * HV
    fwd = BT * (2 * BT * K + 2 * BT * (K + V) + 4 * K * V + 2 * K * V + 2 * BT * K + 2 * BT * V)
    bwd = BT * (2 * BT * K + 2 * BT * V          # dv local
                + 6 * K * V                      # state backward
                + 6 * K * V + 4 * BT * V + 4 * BT * K  # dq, dk, dw
                + 4 * BT * K + 4 * BT * V + 8 * BT * BT + 6 * BT * K)  # WY backward
    return chunks * fwd, chunks * bwd


def make(lens, device="cuda"):
    g = torch.Generator(device="cpu").manual_seed(0)
    T, N = sum(lens), len(lens)

    def r(*s):
        return torch.randn(*s, generator=g)

    q = r(1, T, H, K).to(torch.bfloat16).to(device)
    k = r(1, T, H, K).to(torch.bfloat16).to(device)
    v = r(1, T, HV, V).to(torch.bfloat16).to(device)
    gg = torch.nn.functional.logsigmoid(r(1, T, HV)).float().to(device)
    beta = torch.rand(1, T, HV, generator=g).float().to(device)
    h0 = (0.1 * r(N, HV, K, V)).float().to(device)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    do = r(1, T, HV, V).to(torch.bfloat16).to(device)
    dht = (0.1 * r(N, HV, K, V)).float().to(device)
    return dict(q=q, k=k, v=v, g=gg, beta=beta, h0=h0, cu=cu, do=do, dht=dht)


def ours_fn(q, k, v, g, beta, *, initial_state, cu_seqlens):
    return gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens)


def fla_fn():
    import fla.ops.common.chunk_o as chunk_o
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    chunk_o.TRITON_ABOVE_3_7_1 = True  # lift the Hopper guard (timing only)

    def run(q, k, v, g, beta, *, initial_state, cu_seqlens):
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu_seqlens.long())
    return run


def time_impl(fn, x, rep):
    leaves = [x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "h0")]

    def fwd():
        with torch.no_grad():
            return fn(*leaves[:5], initial_state=leaves[5], cu_seqlens=x["cu"])

    def both():
        o, ht = fn(*leaves[:5], initial_state=leaves[5], cu_seqlens=x["cu"])
        torch.autograd.grad((o, ht), leaves, (x["do"], x["dht"]))

    o, ht = fn(*leaves[:5], initial_state=leaves[5], cu_seqlens=x["cu"])

    def bwd():
        torch.autograd.grad((o, ht), leaves, (x["do"], x["dht"]), retain_graph=True)

    t_f = median_ms(fwd, warmup=3, rep=rep)
    t_b = median_ms(bwd, warmup=3, rep=rep)
    t_fb = median_ms(both, warmup=3, rep=rep)
    t_fb_dev = device_ms(both, warmup=3, rep=rep, lead_ms=5.0)  # the host queues a whole call behind the spin
    grads = torch.autograd.grad((o, ht), leaves, (x["do"], x["dht"]), retain_graph=True)
    return t_f, t_b, t_fb, t_fb_dev, [o.detach(), ht.detach()] + [gr.detach() for gr in grads]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--quick", action="store_true", help="main layout only")
    ap.add_argument("--rep", type=int, default=20)
    a = ap.parse_args()
    impls = [("cake det", ours_fn, dict()), ("cake det, recompute-state", ours_fn, dict(gdn_recompute_state=True))]
    if not a.no_fla:
        try:
            impls.append(("fla 0.6.0", fla_fn(), None))
        except Exception as e:  # noqa: BLE001
            print(f"fla unavailable: {e!r}")
    rows = []
    for shape, lens in layouts(a.quick):
        x = make(lens)
        f_fl, b_fl = flops(lens)
        for name, fn, cfg in impls:
            if cfg is not None:
                mek.configure(gdn_variant="det", **cfg)
            t_f, t_b, t_fb, t_fb_dev, res = time_impl(fn, x, a.rep)
            row = dict(shape=shape, impl=name, fwd_ms=t_f, bwd_ms=t_b, fwdbwd_ms=t_fb, fwdbwd_device_ms=t_fb_dev,
                       fwd_tflops=f_fl / t_f / 1e9, bwd_tflops=b_fl / t_b / 1e9)
            if cfg is not None:
                *_, res2 = time_impl(fn, x, 1)
                row["bits_repeat"] = all(torch.equal(p, q) for p, q in zip(res, res2))
            rows.append(row)
            print_table([row], list(row))
            write_results("gdn", rows, extra=dict(floors_note=f"matmul {MATMUL_TFLOPS} TFLOP/s"))
    mek.configure()
    print()
    print_table(rows, ["shape", "impl", "fwd_ms", "bwd_ms", "fwdbwd_ms", "fwdbwd_device_ms", "fwd_tflops", "bwd_tflops",
                       "bits_repeat"])


if __name__ == "__main__":
    main()
