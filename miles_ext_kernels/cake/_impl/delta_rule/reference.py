"""The per-token delta-rule recurrence that gdn's and kda's references run, in float64 (or a chosen dtype):

    S <- S * exp(g_t)                             S: [K, V] per value head; g_t a scalar (gdn) or [K] per row (kda)
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = scale * S^T q_t

Value head hv reads key head hv // (HV // H). Gradients come from autograd through this loop.
"""
from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def recurrence(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
               dtype, transpose_state_layout=False):
    """(o [B, T, HV, V] in `dtype`, final_state [N, HV, K, V] ([N, HV, V, K] transposed) or None) of the log decay
    g `[B, T, HV]` (one per head) or `[B, T, HV, K]` (one per key dimension)."""
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
    g = g.reshape(B * T, HV, K if g.dim() == 4 else 1)  # one decay per head (broadcast over the key rows) or per key
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
            if transpose_state_layout:
                S = S.transpose(-1, -2)
        else:
            S = torch.zeros(HV, K, V, dtype=dtype, device=q.device)
        for t in range(bos, eos):
            S = S * torch.exp(g[t])[:, :, None]
            d = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", S, k[t]))
            S = S + k[t][:, :, None] * d[:, None, :]
            outs.append(scale * torch.einsum("hkv,hk->hv", S, q[t]))
        finals.append(S.transpose(-1, -2) if transpose_state_layout else S)
    o = torch.stack(outs, 0).reshape(B, T, HV, V) if outs else v.new_zeros(B, T, HV, V)
    final = torch.stack(finals, 0) if output_final_state else None
    return o, final
