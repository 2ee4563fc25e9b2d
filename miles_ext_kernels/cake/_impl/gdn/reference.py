"""Readable reference of the gated delta rule: the per-token recurrence, in float64 (or a chosen dtype).

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        S: [K, V] per value head
    o_t = scale * S_t^T q_t

written as S <- exp(g_t) S;  d_t = beta_t (v_t - S^T k_t);  S <- S + k_t d_t^T;  o_t = scale S^T q_t.
Value head hv reads key head hv // (HV // H). Gradients come from autograd through this loop.
"""
from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_reference(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, dtype=torch.float64):
    """Returns (o [B, T, HV, V] in `dtype`, final_state [N, HV, K, V] or None). Differentiable."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    grp = HV // H
    q = q.repeat_interleave(grp, dim=2).reshape(B * T, HV, K)
    k = k.repeat_interleave(grp, dim=2).reshape(B * T, HV, K)
    v = v.reshape(B * T, HV, V)
    g = g.reshape(B * T, HV)
    beta = beta.reshape(B * T, HV)
    if cu_seqlens is None:
        bounds = [(b * T, (b + 1) * T) for b in range(B)]
    else:
        cu = [int(x) for x in cu_seqlens.tolist()]
        bounds = list(zip(cu[:-1], cu[1:]))
    outs, finals = [], []
    for n, (bos, eos) in enumerate(bounds):
        if initial_state is not None:
            S = initial_state[n].to(dtype)
        else:
            S = torch.zeros(HV, K, V, dtype=dtype, device=q.device)
        for t in range(bos, eos):
            S = S * torch.exp(g[t])[:, None, None]
            d = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t][:, :, None] * d[:, None, :]
            outs.append(scale * torch.einsum("hkv,hk->hv", S, q[t]))
        finals.append(S)
    o = torch.stack(outs, 0).reshape(B, T, HV, V)
    final = torch.stack(finals, 0) if output_final_state else None
    return o, final
