"""kda: chunked Kimi Delta Attention (the linear-attention core of Kimi Linear / Kimi-K3), selector
`--kda-backend cake`. Torch-free declaration; the implementation loads on first use.

Per value head, with a decay per key dimension (fla's naive_recurrent_kda):

    S <- S * exp(g_t)[:, None];   S <- S + beta_t k_t (v_t - S^T k_t)^T;   o_t = scale * S^T q_t      S: [K, V]

Drop-in for fla's `chunk_kda` (chunk 64, WY / UT representation, inter-chunk state recurrence), on the delta-rule
core it shares with gdn (`_impl/delta_rule/`). q, k `[B, T, H, K]`, v `[B, T, HV, V]` bf16 with HV a multiple of H
(value head hv reads key head hv // (HV / H)); g `[B, T, HV, K]`: the log decay (fp32), or with
`use_gate_in_kernel` the raw gate (bf16 / fp32) turned into one in the kernel with A_log `[HV]` and dt_bias
`[HV * K]` (fp32): g_eff = -exp(A_log) softplus(g + dt_bias), or with a `lower_bound`
g_eff = lower_bound * sigmoid(exp(A_log) (g + dt_bias)); beta `[B, T, HV]` (after the sigmoid) fp32 / bf16; packed
documents with `cu_seqlens` int `[N + 1]` and B = 1; states `[N, HV, K, V]` fp32 (`[N, HV, V, K]` with
`transpose_state_layout`). K, V in {16, 32, 64, 128}.

Variants: det and fast launch the same kernels. No kernel uses atomics, and every sum split over programs or
launches (the per-key-head dq / dk over value heads, dA_log and ddt_bias over tokens) is added in one fixed order,
so o, the final state and every gradient repeat bit for bit in either variant.
Option `--cake-kda-check-seqlens` (configure(kda_check_seqlens=True)): check cu_seqlens on the host before each call
(one device sync per call). `cake.prebuild("kda", head_k_dim=K, head_v_dim=V)` compiles every route for those dims.
"""
from __future__ import annotations

from miles_ext_kernels.cake._runtime.declare import check_delta_rule_heads, delta_rule_spec

HEAD_DIMS = (16, 32, 64, 128)
SAFE_LOWER_BOUND = -5.0  # the safe gate's floor: lower_bound must lie in [SAFE_LOWER_BOUND, 0)

OP = delta_rule_spec("kda", ("kda_backend", "cake"), "chunk_kda")


def check_supported(head_k_dim, head_v_dim, num_k_heads=1, num_v_heads=1) -> None:
    """Raise (on any device, before anything is built) unless these head dims / head counts are served."""
    check_delta_rule_heads("kda", HEAD_DIMS, head_k_dim, head_v_dim, num_k_heads, num_v_heads)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, A_log=None, dt_bias=None, safe_gate=False,
              lower_bound=None, transpose_state_layout=False, cu_seqlens=None, cp_context=None):
    """Kimi Delta Attention over packed documents; returns `(o [B, T, HV, V], final_state or None)`.

    - q, k: `[B, T, H, K]` bf16; v: `[B, T, HV, V]` bf16, HV a multiple of H (value head hv reads key head
      hv // (HV / H)); K, V in {16, 32, 64, 128}. Any strides: q, k, v and g are read in place as views of a wider
      projection (heads packed within a token, token stride a multiple of 16); other operands that are not
      contiguous are copied first.
    - g: `[B, T, HV, K]`. Without `use_gate_in_kernel`: the log decay per key dimension, fp32 (<= 0 in practice; a
      value below -128 counts as -128: exp(-128) is 0 in fp32, so g = -inf, a full forget, stays finite).
      With `use_gate_in_kernel=True`: the raw gate, bf16 or fp32, and A_log `[HV]`, dt_bias `[HV * K]` (fp32) are
      required; g_eff = -exp(A_log[h]) * softplus(g + dt_bias[h]), or, when `lower_bound` is given,
      g_eff = lower_bound * sigmoid(exp(A_log[h]) * (g + dt_bias[h])) (as fla: the lower-bound gate of Kimi-K3,
      lower_bound -5). Gradients reach the raw g, A_log and dt_bias. Without the in-kernel gate, A_log and dt_bias
      must be None.
    - safe_gate: fla's promise that the gate is bounded below (with the in-kernel gate it requires a lower_bound in
      [-5, 0)). Our kernels' numerics do not depend on it: every in-chunk decay product is an exp of a non-positive
      number for any gate (see `_impl/kda/kernels.py`), so it changes no result.
    - lower_bound: None or a finite float < 0 (>= -5 with safe_gate); read only by the in-kernel gate.
    - beta: `[B, T, HV]` after the sigmoid, fp32 or bf16 (its gradient in its dtype).
    - scale: a finite float, default K ** -0.5.
    - initial_state: None or `[N, HV, K, V]` (`[N, HV, V, K]` with `transpose_state_layout`) fp32 (bf16 / fp16
      accepted, read as fp32; its gradient in its dtype), N = B, or the number of documents with cu_seqlens.
      output_final_state: a bool; the final state is fp32 in the same layout.
    - cu_seqlens: None, or int32 / int64 `[N + 1]` on q's device with B = 1 (packed documents).
    - cp_context: context parallelism (`cake.build_cp_context(cu_seqlens_global, group, layout=...)`) with the
      rank's tokens (B = 1, its shard in layout order): the documents come from the context (cu_seqlens must be
      None); initial_state / output_final_state are not served (ValueError, as fla). The ranks exchange chunk
      states (one all_gather of 4 HV K (V + K) bytes per piece that continues on another rank, forward; one of
      4 HV K V per piece that continues one, backward) chained in fp32 in a fixed order: det bits repeat for a
      given layout, group size and cu_seqlens. dA_log / ddt_bias are this rank's partial sums: the caller's
      data-parallel / CP all-reduce adds them (as Megatron does for every parameter). Eager only.
    - o: bf16 `[B, T, HV, V]`, contiguous. Every tensor argument must be on q's device (ValueError otherwise).

    With `use_qk_l2norm_in_kernel`, q and k are L2-normalised per head first (x / sqrt(sum x^2 + 1e-6)) and the
    backward goes through the norm. Differentiable in q, k, v, g, beta, A_log, dt_bias and initial_state. Bad
    operands raise ValueError / TypeError naming the argument before any launch. No device->host synchronisation:
    cu_seqlens stays on the device and is trusted (0 = c_0 <= ... <= c_N = T, as in fla); rows past c_N are not
    computed (their outputs and gradients are undefined); a violation gives garbage outputs, never a read or write
    outside the tensors (the kernels clamp every document into [0, T]); on CPU it raises.
    `configure(kda_check_seqlens=True)` (`--cake-kda-check-seqlens`) checks them on the host before each call instead
    (one device sync per call; eager mode).
    """
    from ._impl import kda as impl  # a static import: torch.compile traces it (importlib it cannot)

    return impl.chunk_kda(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                          output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                          use_gate_in_kernel=use_gate_in_kernel, A_log=A_log, dt_bias=dt_bias, safe_gate=safe_gate,
                          lower_bound=lower_bound, transpose_state_layout=transpose_state_layout,
                          cu_seqlens=cu_seqlens, cp_context=cp_context)
