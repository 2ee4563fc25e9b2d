"""demo(device): a couple of cases of both variants against the FP64 reference (tiny through the interpreter)."""
from __future__ import annotations

import torch

from .. import _norms


def budgets(device: str, wdtype: torch.dtype, numel: int = 1 << 20) -> dict:
    """{y, dx, dz, dw: relative-RMS budget vs FP64} (`_norms.budgets`: where the numbers come from)."""
    return _norms.budgets(device, wdtype, numel, ("y", "dx", "dz"))


def demo(device: str) -> list[dict]:
    from .ops import rmsnorm_silu_gate
    from .reference import grads_ref

    cpu = str(device).startswith("cpu")
    cases = [(9, 4, 128, torch.float32), (5, 2, 64, torch.bfloat16)] if cpu else \
        [(4096, 32, 128, torch.float32), (4096, 16, 256, torch.bfloat16)]

    def run_case(case, gen):
        T, NH, D, wdt = case
        x = torch.randn(T, NH, D, generator=gen).to(torch.bfloat16).to(device)
        z = torch.randn(T, NH, D, generator=gen).to(torch.bfloat16).to(device)
        w = (1 + 0.1 * torch.randn(D, generator=gen)).to(wdt).to(device)
        dy = torch.randn(T, NH, D, generator=gen).to(torch.bfloat16).to(device)
        xr, zr, wr = (t.clone().requires_grad_(True) for t in (x, z, w))
        y = rmsnorm_silu_gate(xr, zr, wr, 1e-6)
        y.backward(dy)
        ref = dict(zip(("y", "dx", "dz", "dw"), grads_ref(x, z, w, dy, 1e-6)))
        got = {"y": y, "dx": xr.grad, "dz": zr.grad, "dw": wr.grad}
        return f"T={T} H_v={NH} D={D} w={str(wdt).replace('torch.', '')}", got, ref, budgets(device, wdt, x.numel())

    return _norms.demo_rows("gated_rmsnorm", device, cases, run_case)
