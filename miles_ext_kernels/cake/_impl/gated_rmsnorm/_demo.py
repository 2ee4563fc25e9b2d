"""demo(device): a couple of cases of both variants against the FP64 reference (tiny through the interpreter)."""
from __future__ import annotations

import torch

# Accuracy budgets (relative RMS vs FP64). bf16 outputs: one bf16 ulp-level error. On the GPU the fp32 -> bf16
# cast rounds to nearest (budget 2^-8 ~ 3.9e-3); Triton's interpreter truncates instead (measured ~ 3.3e-3 for
# y/dx/dz and 4.1e-3 for a bf16 dw on CPU, budget 2^-7). fp32 weight gradients: fp32 summation (measured <= 2e-7).
BF16_BUDGET = {"cuda": 2.0 ** -8, "cpu": 2.0 ** -7}
FP32_DW_BUDGET = 2e-6


def budgets(device: str, wdtype: torch.dtype) -> dict:
    kind = "cpu" if str(device).startswith("cpu") else "cuda"
    b = BF16_BUDGET[kind]
    return {"y": b, "dx": b, "dz": b, "dw": FP32_DW_BUDGET if wdtype == torch.float32 else b}


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
                bud = budgets(device, wdt)
                case = f"{variant} T={T} H_v={NH} D={D} w={str(wdt).replace('torch.', '')}"
                for k in ("y", "dx", "dz", "dw"):
                    err = rel_rms(got[k], ref[k])
                    rows.append({"op": "gated_rmsnorm", "case": case, "tensor": k, "err": err, "budget": bud[k],
                                 "ok": err <= bud[k]})
    finally:
        configure()
    return rows
