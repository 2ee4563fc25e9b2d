"""demo(device): a couple of cases against the FP64 reference (tiny through the interpreter on "cpu")."""
from __future__ import annotations

import torch

from miles_ext_kernels.cake._runtime.testing import rel_rms

from .ops import causal_conv1d
from .reference import causal_conv1d_ref_shift

# relative-RMS budgets vs the FP64 reference (SiLU' reference at the bf16-rounded pre-activation for the default
# option): y and dx are bf16 outputs, dw is fp32 (or bf16) accumulated in fp32. The interpreter ("cpu") rounds
# fp32 -> bf16 by truncation, which doubles the bf16 errors and makes its bf16-rounded pre-activation differ from
# the reference's, hence its own budgets.
BUDGETS = {
    "cuda": {"y": 4e-3, "dx": 4e-3, "dw_float32": 1e-4, "dw_bfloat16": 5e-3},
    "cpu": {"y": 7e-3, "dx": 7e-3, "dw_float32": 4e-3, "dw_bfloat16": 8e-3},
}


def demo(device: str) -> list[dict]:
    """Run a couple of cases against the FP64 reference; rows: op, case, tensor, err, budget, ok."""
    if device == "cpu":
        cases = [("T=37,D=24,W=4,3 docs,fp32 w", 37, 24, 4, [0, 5, 6, 37], torch.float32),
                 ("T=20,D=16,W=3,1 doc,bf16 w", 20, 16, 3, None, torch.bfloat16)]
    else:
        cases = [("16x2048,D=4096,W=4,fp32 w", 32768, 4096, 4, [2048 * i for i in range(17)], torch.float32),
                 ("5 irregular docs,D=2048,W=4,bf16 w", 9001, 2048, 4, [0, 1, 3, 4000, 4001, 9001],
                  torch.bfloat16)]
    g = torch.Generator(device="cpu").manual_seed(0)
    budgets = BUDGETS["cpu" if device == "cpu" else "cuda"]
    rows = []
    for name, T, D, W, cu, wdt in cases:
        x = torch.randn(T, D, generator=g).to(torch.bfloat16).to(device).requires_grad_(True)
        w = (torch.randn(D, W, generator=g) * 0.5).to(wdt).to(device).requires_grad_(True)
        dy = torch.randn(T, D, generator=g).to(torch.bfloat16).to(device)
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=device)
        y = causal_conv1d(x, w, cu_seqlens=cu_t, activation="silu")
        y.backward(dy)
        ry, rdx, rdw = causal_conv1d_ref_shift(x, w, dy, cu_t, "silu", round_preactivation=True)
        for tname, got, ref, budget in (("y", y, ry, budgets["y"]), ("dx", x.grad, rdx, budgets["dx"]),
                                        ("dw", w.grad, rdw, budgets["dw_" + str(wdt).split(".")[1]])):
            err = rel_rms(got, ref)
            rows.append(dict(op="conv1d", case=name, tensor=tname, err=err, budget=budget, ok=bool(err <= budget)))
    return rows
