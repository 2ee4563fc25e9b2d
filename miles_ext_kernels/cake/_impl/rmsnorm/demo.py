"""demo(device): a couple of cases of both variants against the FP64 reference (tiny through the interpreter)."""
from __future__ import annotations

import torch

from .. import _norms


def budgets(device: str, wdtype: torch.dtype, numel: int = 1 << 20) -> dict:
    """{y, dx, dw: relative-RMS budget vs FP64} (`_norms.budgets`: where the numbers come from)."""
    return _norms.budgets(device, wdtype, numel, ("y", "dx"))


def demo(device: str) -> list[dict]:
    from .ops import zero_centered_rmsnorm
    from .reference import grads_ref

    cpu = str(device).startswith("cpu")
    cases = [(37, 256, torch.float32), (5, 320, torch.bfloat16)] if cpu else \
        [(4096, 2048, torch.float32), (4096, 5120, torch.bfloat16)]

    def run_case(case, gen):
        T, H, wdt = case
        x = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device)
        w = (0.1 * torch.randn(H, generator=gen)).to(wdt).to(device)
        dy = torch.randn(T, H, generator=gen).to(torch.bfloat16).to(device)
        xr = x.clone().requires_grad_(True)
        wr = w.clone().requires_grad_(True)
        y = zero_centered_rmsnorm(xr, wr, 1e-6)
        y.backward(dy)
        ref = dict(zip(("y", "dx", "dw"), grads_ref(x, w, dy, 1e-6)))
        got = {"y": y, "dx": xr.grad, "dw": wr.grad}
        return f"T={T} H={H} w={str(wdt).replace('torch.', '')}", got, ref, budgets(device, wdt, x.numel())

    return _norms.demo_rows("rmsnorm", device, cases, run_case)
