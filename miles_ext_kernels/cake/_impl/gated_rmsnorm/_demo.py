"""demo(device): a couple of cases of both variants against the FP64 reference (tiny through the interpreter)."""
from __future__ import annotations

import torch

# Accuracy budgets (relative RMS vs FP64), from our H200 run (bench/results/norms.json, 8k tokens):
# - bf16 outputs: ours 1.66e-3 = the peers' (Liger / fla / eager: same fp32 math, one rounding to bf16), so
#   min(peer x 1.1, 2 x ours) = 1.83e-3 on the GPU for tensors of >= 65536 elements; smaller tensors (too few
#   elements for that statistic) get one bf16 ulp-level error, 2^-8. Triton's interpreter truncates fp32 -> bf16
#   instead of rounding (measured ~3.3e-3 on CPU): 2^-7 there.
# - fp32 weight gradients: fp32 summation, measured <= 1.75e-7 (GPU and CPU): budget 3.5e-7 = 2 x ours (the peers
#   measured 1.6e-7 .. 1.75e-7 on the bench shapes).
# - bf16 weight gradients: one rounding of the fp32 sum, measured <= 1.76e-3 on the GPU: 3.5e-3 (2^-7 on CPU).
BF16_BUDGET = {"cuda": 1.83e-3, "cpu": 2.0 ** -7}
SMALL_BF16_BUDGET = {"cuda": 2.0 ** -8, "cpu": 2.0 ** -7}
BF16_DW_BUDGET = {"cuda": 3.5e-3, "cpu": 2.0 ** -7}
FP32_DW_BUDGET = 3.5e-7


def budgets(device: str, wdtype: torch.dtype, numel: int = 1 << 20) -> dict:
    kind = "cpu" if str(device).startswith("cpu") else "cuda"
    b = (BF16_BUDGET if numel >= 65536 else SMALL_BF16_BUDGET)[kind]
    out = {k: b for k in ("y", "dx", "dz")}
    out["dw"] = FP32_DW_BUDGET if wdtype == torch.float32 else BF16_DW_BUDGET[kind]
    return out


def demo(device: str) -> list[dict]:
    from miles_ext_kernels import configure
    from miles_ext_kernels.cake._runtime.testing import rel_rms

    from .ops import rmsnorm_silu_gate
    from .reference import grads_ref

    cpu = str(device).startswith("cpu")
    cases = [(9, 4, 128, torch.float32), (5, 2, 64, torch.bfloat16)] if cpu else \
        [(4096, 32, 128, torch.float32), (4096, 16, 256, torch.bfloat16)]
    gen = torch.Generator().manual_seed(0)
    rows = []
    try:
        for variant in ("det", "fast"):
            configure(gated_rmsnorm_variant=variant)
            for T, NH, D, wdt in cases:
                x = torch.randn(T, NH, D, generator=gen).to(torch.bfloat16).to(device)
                z = torch.randn(T, NH, D, generator=gen).to(torch.bfloat16).to(device)
                w = (1 + 0.1 * torch.randn(D, generator=gen)).to(wdt).to(device)
                dy = torch.randn(T, NH, D, generator=gen).to(torch.bfloat16).to(device)
                xr, zr, wr = (t.clone().requires_grad_(True) for t in (x, z, w))
                y = rmsnorm_silu_gate(xr, zr, wr, 1e-6)
                y.backward(dy)
                ref = dict(zip(("y", "dx", "dz", "dw"), grads_ref(x, z, w, dy, 1e-6)))
                got = {"y": y, "dx": xr.grad, "dz": zr.grad, "dw": wr.grad}
                bud = budgets(device, wdt, x.numel())
                case = f"{variant} T={T} H_v={NH} D={D} w={str(wdt).replace('torch.', '')}"
                for k in ("y", "dx", "dz", "dw"):
                    err = rel_rms(got[k], ref[k])
                    rows.append({"op": "gated_rmsnorm", "case": case, "tensor": k, "err": err, "budget": bud[k],
                                 "ok": err <= bud[k]})
    finally:
        configure()
    return rows
