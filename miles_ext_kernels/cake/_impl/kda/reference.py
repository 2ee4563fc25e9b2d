"""Readable reference of Kimi Delta Attention: the per-token recurrence, in float64 (or a chosen dtype).

Per value head hv (key head hv // (HV // H)), with a decay per key dimension (fla's naive_recurrent_kda):

    S <- S * exp(g_t)[:, None]                    S: [K, V], g_t: [K] (the log decay of token t)
    S <- S + beta_t k_t (v_t - S^T k_t)^T
    o_t = scale * S^T q_t

With the in-kernel gate, g_t = -exp(A_log[hv]) * softplus(g_raw_t + dt_bias[hv]), or with a lower bound
g_t = lower_bound * sigmoid(exp(A_log[hv]) * (g_raw_t + dt_bias[hv])). Gradients come from autograd through the loop.
States are [N, HV, K, V], or [N, HV, V, K] with transpose_state_layout. The loop is
`_impl/delta_rule/reference.py`'s (gdn's too).
"""
from __future__ import annotations

import torch

from ..delta_rule.reference import l2norm, recurrence

__all__ = ["gate_param_terms", "kda_gate", "kda_reference", "l2norm", "softplus"]


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
    if use_gate_in_kernel:
        g = kda_gate(g.to(dtype), A_log.to(dtype), dt_bias.to(dtype), lower_bound)
    return recurrence(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      cu_seqlens=cu_seqlens, dtype=dtype, transpose_state_layout=transpose_state_layout)
