"""Readable FP64 reference of conv1d: `F.conv1d` per document (W-1 rows of left context, groups = D): zeros, or the
document's initial state.

Initial state: [N, D, W] (fla's layout), initial_state[n, :, W - k] the row k before document n's start, k in
1..W-1; entry 0 is not read. Documents past N (the padding rows after cu_seqlens[-1], when passed as one more
document) have zeros.
"""
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
                      dtype=torch.float64, initial_state=None) -> torch.Tensor:
    """y = act(causal depthwise conv(x)) per document, computed in `dtype` (FP64 by default), differentiable (in
    the initial state too)."""
    T, D = x.shape
    W = weight.shape[1]
    xd = x.to(dtype)
    wd = weight.to(dtype).unsqueeze(1)  # [D, 1, W]
    hd = None if initial_state is None else initial_state.to(dtype)
    outs = []
    for n, (s, e) in enumerate(segments(T, cu_seqlens)):
        if e <= s:
            continue
        seg = xd[s:e].t().unsqueeze(0)  # [1, D, L]
        if hd is not None and n < hd.shape[0]:
            seg = torch.cat([hd[n, :, 1:].unsqueeze(0), seg], 2)  # [1, D, W - 1 + L]
        else:
            seg = F.pad(seg, (W - 1, 0))
        y = F.conv1d(seg, wd, groups=D)  # [1, D, L]
        outs.append(y[0].t())
    y = torch.cat(outs, 0) if outs else xd[:0] * wd[:, 0, -1]  # keeps the graph when T == 0
    if activation in ("silu", "swish"):
        y = F.silu(y)
    return y


def causal_conv1d_ref_grads(x, weight, dy, cu_seqlens=None, activation="silu", round_preactivation=False,
                            initial_state=None):
    """FP64 (y, dx, dw), and d(initial_state) after them when one is given. `round_preactivation=True` evaluates
    SiLU' at the pre-activation rounded to bf16 (the `silu_grad_preactivation=bf16` semantics); False is the exact
    gradient."""
    xd = x.detach().to(torch.float64).requires_grad_(True)
    wd = weight.detach().to(torch.float64).requires_grad_(True)
    leaves = [xd, wd]
    hd = None
    if initial_state is not None:
        hd = initial_state.detach().to(torch.float64).requires_grad_(True)
        leaves.append(hd)
    pre = causal_conv1d_ref(xd, wd, cu_seqlens, activation=None, initial_state=hd)
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
    grads = torch.autograd.grad(pre, leaves, dpre, allow_unused=True)
    if hd is not None and grads[2] is None:  # no document read it (T == 0)
        grads = (*grads[:2], torch.zeros_like(hd))
    return (y, *grads)


def positions(T: int, cu_seqlens, device) -> torch.Tensor:
    """Position of every token inside its document (int64, on `device`)."""
    return _positions_and_docs(T, cu_seqlens, device)[0]


def _positions_and_docs(T: int, cu_seqlens, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(position inside its document, document index) of every token; rows past cu_seqlens[-1] get index N."""
    t = torch.arange(T, device=device)
    if cu_seqlens is None:
        return t, torch.zeros_like(t)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    seg = (torch.searchsorted(cu, t, right=True) - 1).clamp_min(0)
    return t - cu[seg], seg


def causal_conv1d_ref_shift(x, weight, dy=None, cu_seqlens=None, activation="silu", round_preactivation=False,
                            dtype=torch.float64, initial_state=None):
    """The same FP64 reference written as W shifted, masked multiply-adds with analytic gradients: cheap enough
    for benchmark shapes on the GPU. Returns y, or (y, dx, dw) when `dy` is given, and d(initial_state) after them
    when one is given."""
    T, D = x.shape
    W = weight.shape[1]
    xd = x.detach().to(dtype)
    wd = weight.detach().to(dtype)
    pos, doc = _positions_and_docs(T, cu_seqlens, x.device)
    pre = torch.zeros_like(xd)
    for k in range(min(W, T)):  # tap k multiplies x[t - k], valid when the token is >= k into its document
        m = (pos[k:] >= k).to(dtype)[:, None]
        pre[k:] += wd[:, W - 1 - k] * xd[:T - k] * m
    halo = None
    if initial_state is not None:
        # rows t with pos < k read entry W - k + pos of their document's state (taps k = 1..W-1)
        N = initial_state.shape[0]
        hd = initial_state.detach().to(dtype)
        halo = []
        for k in range(1, W):
            rows = torch.nonzero((pos < k) & (doc < N)).flatten()
            idx = W - k + pos[rows]
            halo.append((k, rows, idx))
            pre[rows] += wd[:, W - 1 - k] * hd[doc[rows], :, idx]
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
    if halo is None:
        return y, dx, dw
    dh = torch.zeros(N * W, D, dtype=dtype, device=x.device)  # [(n, i), d]: index_add_ over rows
    for k, rows, idx in halo:
        gk = g[rows]
        dw[:, W - 1 - k] += (gk * hd[doc[rows], :, idx]).sum(0)
        dh.index_add_(0, doc[rows] * W + idx, wd[:, W - 1 - k] * gk)
    return y, dx, dw, dh.view(N, W, D).transpose(1, 2).contiguous()
