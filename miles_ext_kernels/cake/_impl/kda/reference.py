"""Readable reference of Kimi Delta Attention: the per-token recurrence, in float64 (or a chosen dtype).

Per value head hv (key head hv // (HV // H)), with a decay per key dimension (fla's naive_recurrent_kda):

    S <- S * exp(g_t)[:, None]                    S: [K, V], g_t: [K] (the log decay of token t)
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = scale * S^T q_t

With the in-kernel gate, g_t = -exp(A_log[hv]) * softplus(g_raw_t + dt_bias[hv]), or with a lower bound
g_t = lower_bound * sigmoid(exp(A_log[hv]) * (g_raw_t + dt_bias[hv])). Gradients come from autograd through the loop.
States are [N, HV, K, V], or [N, HV, V, K] with transpose_state_layout.
"""
from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), exact (no threshold)."""
    return torch.logaddexp(x, torch.zeros_like(x))


def kda_gate(g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound=None) -> torch.Tensor:
    """The in-kernel gate: g [..., HV, K] raw -> the log decay g_eff [..., HV, K]."""
    HV, K = g.shape[-2:]
    x = g + dt_bias.reshape(HV, K)
    a = torch.exp(A_log).reshape(HV, 1)
    if lower_bound is None:
        return -a * softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def gate_param_terms(g, A_log, dt_bias, dg_eff, lower_bound=None):
    """The per-(token, head, key dim) terms whose sums are dA_log [HV] (over tokens and key dims) and ddt_bias
    [HV * K] (over tokens), given the gradient dg_eff of the gated log decay: (terms of dA_log, terms of ddt_bias),
    each [..., HV, K]. Their root sum of squares is the scale the sums' errors are measured against."""
    HV, K = g.shape[-2:]
    x = g + dt_bias.reshape(HV, K)
    a = torch.exp(A_log).reshape(HV, 1)
    if lower_bound is None:
        sp = softplus(x)
        return dg_eff * (-a * sp), dg_eff * (-a * torch.sigmoid(x))
    s = torch.sigmoid(a * x)
    dz = dg_eff * lower_bound * s * (1 - s)
    return dz * a * x, dz * a


def kda_reference(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, safe_gate=False,
                  lower_bound=None, transpose_state_layout=False, cu_seqlens=None, dtype=torch.float64):
    """Returns (o [B, T, HV, V] in `dtype`, final_state [N, HV, K, V] ([N, HV, V, K] transposed) or None).
    Differentiable. `safe_gate` changes nothing here (it is a promise about the gate's range)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_gate_in_kernel:
        g = kda_gate(g, A_log.to(dtype), dt_bias.to(dtype), lower_bound)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    grp = HV // H
    q = q.repeat_interleave(grp, dim=2).reshape(B * T, HV, K)
    k = k.repeat_interleave(grp, dim=2).reshape(B * T, HV, K)
    v = v.reshape(B * T, HV, V)
    g = g.reshape(B * T, HV, K)
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
