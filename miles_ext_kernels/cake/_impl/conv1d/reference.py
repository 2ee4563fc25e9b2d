"""Readable FP64 reference of conv1d: `F.conv1d` per document (W-1 zeros of left padding, groups = D)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def segments(T: int, cu_seqlens) -> list[tuple[int, int]]:
    """(start, end) of every document; None -> one document of T tokens."""
    if cu_seqlens is None:
        return [(0, T)]
    cu = [int(v) for v in cu_seqlens.tolist()]
    return list(zip(cu[:-1], cu[1:]))


def causal_conv1d_ref(x: torch.Tensor, weight: torch.Tensor, cu_seqlens=None, activation="silu",
                      dtype=torch.float64) -> torch.Tensor:
    """y = act(causal depthwise conv(x)) per document, computed in `dtype` (FP64 by default), differentiable."""
    T, D = x.shape
    W = weight.shape[1]
    xd = x.to(dtype)
    wd = weight.to(dtype).unsqueeze(1)  # [D, 1, W]
    outs = []
    for s, e in segments(T, cu_seqlens):
        if e <= s:
            continue
        seg = xd[s:e].t().unsqueeze(0)  # [1, D, L]
        y = F.conv1d(F.pad(seg, (W - 1, 0)), wd, groups=D)  # [1, D, L]
        outs.append(y[0].t())
    y = torch.cat(outs, 0) if outs else xd[:0] * wd[:, 0, -1]  # keeps the graph when T == 0
    if activation in ("silu", "swish"):
        y = F.silu(y)
    return y


def causal_conv1d_ref_grads(x, weight, dy, cu_seqlens=None, activation="silu", round_preactivation=False):
    """FP64 (y, dx, dw). `round_preactivation=True` evaluates SiLU' at the pre-activation rounded to bf16 (the
    `silu_grad_preactivation=bf16` semantics); False is the exact gradient."""
    xd = x.detach().to(torch.float64).requires_grad_(True)
    wd = weight.detach().to(torch.float64).requires_grad_(True)
    pre = causal_conv1d_ref(xd, wd, cu_seqlens, activation=None)
    if activation in ("silu", "swish"):
        p = pre.detach()
        if round_preactivation:
            p = p.to(torch.bfloat16).to(torch.float64)
        s = torch.sigmoid(p)
        dpre = dy.to(torch.float64) * (s * (1 + p * (1 - s)))
        y = F.silu(pre.detach())
    else:
        dpre = dy.to(torch.float64)
        y = pre.detach()
    dx, dw = torch.autograd.grad(pre, (xd, wd), dpre)
    return y, dx, dw


def positions(T: int, cu_seqlens, device) -> torch.Tensor:
    """Position of every token inside its document (int64, on `device`)."""
    t = torch.arange(T, device=device)
    if cu_seqlens is None:
        return t
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    seg = torch.searchsorted(cu, t, right=True) - 1
    return t - cu[seg.clamp_min(0)]


def causal_conv1d_ref_shift(x, weight, dy=None, cu_seqlens=None, activation="silu", round_preactivation=False,
                            dtype=torch.float64):
    """The same FP64 reference written as W shifted, masked multiply-adds with analytic gradients: cheap enough
    for benchmark shapes on the GPU. Returns y, or (y, dx, dw) when `dy` is given."""
    T, D = x.shape
    W = weight.shape[1]
    xd = x.detach().to(dtype)
    wd = weight.detach().to(dtype)
    pos = positions(T, cu_seqlens, x.device)
    pre = torch.zeros_like(xd)
    for k in range(min(W, T)):  # tap k multiplies x[t - k], valid when the token is >= k into its document
        m = (pos[k:] >= k).to(dtype)[:, None]
        pre[k:] += wd[:, W - 1 - k] * xd[:T - k] * m
    act = activation in ("silu", "swish")
    y = torch.nn.functional.silu(pre) if act else pre
    if dy is None:
        return y
    if act:
        p = pre.to(torch.bfloat16).to(dtype) if round_preactivation else pre
        s = torch.sigmoid(p)
        g = dy.to(dtype) * (s * (1 + p * (1 - s)))
    else:
        g = dy.to(dtype)
    dx = torch.zeros_like(xd)
    dw = torch.zeros_like(wd)
    for k in range(min(W, T)):
        m = (pos[k:] >= k).to(dtype)[:, None]
        gk = g[k:] * m
        dx[:T - k] += wd[:, W - 1 - k] * gk
        dw[:, W - 1 - k] = (gk * xd[:T - k]).sum(0)
    return y, dx, dw
