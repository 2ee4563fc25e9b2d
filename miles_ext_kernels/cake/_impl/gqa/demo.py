"""`demo(device)`: a few cases of `gqa` against the FP64 reference, as rows for `python -m miles_ext_kernels demo`."""
from __future__ import annotations

import torch

from ..._runtime.testing import rel_rms
from . import reference
from .ops import varlen_gqa_attention

# relative RMS budgets vs FP64 (GPU: FA2-varlen's error on the same inputs x 1.1 is computed in the demo;
# these fixed ones apply where no peer runs, e.g. the interpreter)
_FIXED_BUDGET = 1.0e-2


def _case(lens_q, lens_k, hq, hkv, device, seed):
    g = torch.Generator().manual_seed(seed)
    tq, tk = sum(lens_q) + 3, sum(lens_k) + 2  # a few padding tokens
    q = torch.randn(tq, hq, 256, generator=g).to(device, torch.bfloat16)
    k = torch.randn(tk, hkv, 256, generator=g).to(device, torch.bfloat16)
    v = torch.randn(tk, hkv, 256, generator=g).to(device, torch.bfloat16)
    do = torch.randn(tq, hq, 256, generator=g).to(device, torch.bfloat16)
    cq = torch.tensor([0] + list(torch.tensor(lens_q).cumsum(0)), dtype=torch.int32, device=device)
    ck = torch.tensor([0] + list(torch.tensor(lens_k).cumsum(0)), dtype=torch.int32, device=device)
    return q, k, v, do, cq, ck


def _fa2(q, k, v, do, cq, ck, lens_q, lens_k):
    """FA2-varlen's (out, dq, dk, dv) or None where it cannot run (needs equal q/k lengths here)."""
    if lens_q != lens_k or q.device.type != "cuda":
        return None
    try:
        L = max(lens_q)
        res = torch.ops.aten._flash_attention_forward(q, k, v, cq, ck, L, L, 0.0, True, False, scale=256 ** -0.5)
        o, lse, seed, off = res[0], res[1], res[2], res[3]
        dq, dk, dv = torch.ops.aten._flash_attention_backward(do, q, k, v, o, lse, cq, ck, L, L, 0.0, True, seed,
                                                              off, scale=256 ** -0.5)
        n = int(cq[-1])
        return o[:n], dq[:n], dk[:n], dv[:n]
    except Exception:  # noqa: BLE001 - a peer that cannot run just gives no budget
        return None


def demo(device: str) -> list[dict]:
    cases = ([("2 docs, Hq4/Hkv1", [24, 40], [24, 40], 4, 1), ("L_k > L_q, Hq3/Hkv1", [16, 20], [30, 20], 3, 1)]
             if device == "cpu" else
             [("4 docs x 1024, Hq16/Hkv2", [1024] * 4, [1024] * 4, 16, 2),
              ("irregular, Hq24/Hkv4", [700, 1500, 64, 1800], [700, 1500, 64, 1800], 24, 4)])
    rows = []
    for i, (name, lq, lk, hq, hkv) in enumerate(cases):
        q, k, v, do, cq, ck = _case(lq, lk, hq, hkv, device, seed=i)
        qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
        out = varlen_gqa_attention(qr, kr, vr, cq, ck, max_seqlen_k=max(lk))
        dq, dk, dv = torch.autograd.grad(out, (qr, kr, vr), do)
        ref = reference.reference_grads(q, k, v, cq, ck, do)
        peer = _fa2(q, k, v, do, cq, ck, lq, lk)
        n = sum(lq)
        for j, (tname, got, r) in enumerate((("out", out, ref[0]), ("dq", dq, ref[2]), ("dk", dk, ref[3]),
                                             ("dv", dv, ref[4]))):
            err = rel_rms(got, r)
            budget = _FIXED_BUDGET
            if peer is not None:
                pr = r[:n] if tname in ("out", "dq") else r[:sum(lk)]
                budget = 1.1 * rel_rms(peer[j], pr)
            rows.append({"op": "gqa", "case": name, "tensor": tname, "err": err, "budget": budget,
                         "ok": bool(err <= budget)})
    return rows
