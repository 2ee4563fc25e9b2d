"""Readable reference of the gated delta rule: the per-token recurrence, in float64 (or a chosen dtype).

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        S: [K, V] per value head
    o_t = scale * S_t^T q_t

written as S <- exp(g_t) S;  d_t = beta_t (v_t - S^T k_t);  S <- S + k_t d_t^T;  o_t = scale S^T q_t.
Value head hv reads key head hv // (HV // H). Gradients come from autograd through this loop (the loop of
`_impl/delta_rule/reference.py`, kda's too, with one decay per head).
"""
from __future__ import annotations

import torch

from ..delta_rule.reference import l2norm, recurrence

__all__ = ["gdn_reference", "l2norm"]


def gdn_reference(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, dtype=torch.float64):
    """Returns (o [B, T, HV, V] in `dtype`, final_state [N, HV, K, V] or None). Differentiable."""
    return recurrence(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                      output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                      cu_seqlens=cu_seqlens, dtype=dtype)
