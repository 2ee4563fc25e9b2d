"""Readable FP64 PyTorch reference of `gqa` (tests, demo, docs). Slow: one dense matrix per segment and head."""
from __future__ import annotations

import torch


def varlen_gqa_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale=None):
    """Packed causal GQA attention in float64 (differentiable). Returns (out [T_q, H_q, D], lse [H_q, T_q]).

    Bottom-right causal alignment per segment: query i of a segment with L_q queries and L_k keys sees keys
    j <= i + L_k - L_q. Rows that see no key, and padding rows past cu_seqlens_q[-1], get out 0 and LSE -inf.
    """
    T_q, H_q, D = q.shape
    H_kv = k.shape[1]
    group = H_q // H_kv
    scale = D ** -0.5 if softmax_scale is None else softmax_scale
    q64, k64, v64 = q.double(), k.double(), v.double()
    cq = [int(x) for x in cu_seqlens_q.cpu()]
    ck = [int(x) for x in cu_seqlens_k.cpu()]
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qs, ks = q64[cq[b]:cq[b + 1]], k64[ck[b]:ck[b + 1]]
        vs = v64[ck[b]:ck[b + 1]]
        L_q, L_k = qs.shape[0], ks.shape[0]
        kh = ks.repeat_interleave(group, dim=1)  # [L_k, H_q, D]
        vh = vs.repeat_interleave(group, dim=1)
        s = torch.einsum("ihd,jhd->hij", qs, kh) * scale
        i = torch.arange(L_q).unsqueeze(1)
        j = torch.arange(L_k).unsqueeze(0)
        allowed = (j <= i + (L_k - L_q)).to(q.device)
        s = s.masked_fill(~allowed, float("-inf"))
        seen = allowed.any(dim=-1).unsqueeze(0).expand(H_q, L_q)  # rows that see at least one key
        lse = torch.logsumexp(torch.where(seen.unsqueeze(-1), s, torch.zeros_like(s)), dim=-1)
        p = torch.exp(s - lse.unsqueeze(-1))  # 0 on masked entries (rows with no key: all masked)
        lse = torch.where(seen, lse, torch.full_like(lse, float("-inf")))
        outs.append(torch.einsum("hij,jhd->ihd", p, vh))
        lses.append(lse)
    pad = T_q - cq[-1]
    outs.append(q64.new_zeros(pad, H_q, D))
    lses.append(q64.new_full((H_q, pad), float("-inf")))
    return torch.cat(outs, 0), torch.cat(lses, 1)


def reference_grads(q, k, v, cu_seqlens_q, cu_seqlens_k, dout, softmax_scale=None):
    """(out, lse, dq, dk, dv) in float64 for the cotangent `dout`."""
    q64 = q.detach().double().requires_grad_()
    k64 = k.detach().double().requires_grad_()
    v64 = v.detach().double().requires_grad_()
    out, lse = varlen_gqa_reference(q64, k64, v64, cu_seqlens_q, cu_seqlens_k, softmax_scale)
    dq, dk, dv = torch.autograd.grad(out, (q64, k64, v64), dout.double(), allow_unused=True)
    dq = torch.zeros_like(q64) if dq is None else dq
    dk = torch.zeros_like(k64) if dk is None else dk
    dv = torch.zeros_like(v64) if dv is None else dv
    return out.detach(), lse.detach(), dq, dk, dv
