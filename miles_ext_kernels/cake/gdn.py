"""gdn: chunked Gated DeltaNet (the linear-attention core of Qwen3-Next / Qwen3.5), selector
`--linear-attention-backend cake`. Torch-free declaration; the implementation loads on first use.

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,        o_t = scale * S_t^T q_t

Drop-in for fla's `chunk_gated_delta_rule` (chunk 64, WY / UT representation, inter-chunk state recurrence).
q, k `[B, T, H, K]`, v `[B, T, HV, V]` bf16 with HV a multiple of H (value head hv reads key head hv // (HV / H));
g (log-decay) and beta `[B, T, HV]` fp32 (bf16 / fp16 accepted, gradients come back in their dtype); packed
documents with `cu_seqlens` int `[N + 1]` and B = 1; states `[N, HV, K, V]` fp32. K, V in {16, 32, 64, 128}.

Variants: det and fast launch the same kernels. No kernel uses atomics, and every sum split over programs or
launches is added in one fixed order, so o, the final state and every gradient (dq, dk, dv, dg, dbeta, dh0) repeat
bit for bit in either variant.
Option `--cake-gdn-recompute-state` (configure(gdn_recompute_state=True)): the backward recomputes w, u, the
per-chunk states and v_new instead of keeping them from the forward (less memory: at 32k tokens, 32 heads,
K = V = 128 that is 0.81 GB of activations per layer less).
`cake.prebuild("gdn", head_k_dim=K, head_v_dim=V)` compiles every route for those head dims.
"""
from __future__ import annotations

from miles_ext_kernels.cake._runtime.declare import check_delta_rule_heads, delta_rule_spec
from miles_ext_kernels.cake._runtime.spec import Flag

HEAD_DIMS = (16, 32, 64, 128)

OP = delta_rule_spec("gdn", ("linear_attention_backend", "cake"), "chunk_gated_delta_rule", options=(
    Flag("recompute_state", "gdn backward recomputes the per-chunk states instead of keeping them from the forward "
         "(less activation memory, a longer backward)"),))


def check_supported(head_k_dim, head_v_dim, num_k_heads=1, num_v_heads=1) -> None:
    """Raise (on any device, before anything is built) unless these head dims / head counts are served."""
    check_delta_rule_heads("gdn", HEAD_DIMS, head_k_dim, head_v_dim, num_k_heads, num_v_heads)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, cp_context=None):
    """Gated delta rule over packed documents; returns `(o [B, T, HV, V], final_state [N, HV, K, V] or None)`.

    - q, k: `[B, T, H, K]` bf16; v: `[B, T, HV, V]` bf16, HV a multiple of H (value head hv reads key head
      hv // (HV / H)); K, V in {16, 32, 64, 128}. Any strides: q, k and v are read in place as views of a wider
      projection (heads packed within a token, token stride a multiple of 16, e.g. Qwen3-Next's split conv
      output); other operands that are not contiguous are copied first.
    - g (log-decay, <= 0 in practice) and beta: `[B, T, HV]` fp32, bf16 or fp16 (computed in fp32; their
      gradients come back in their own dtype).
    - scale: a finite float, default K ** -0.5.
    - initial_state: None or `[N, HV, K, V]` fp32 (bf16 / fp16 accepted, read as fp32; its gradient in its own
      dtype), N = B, or the number of documents with cu_seqlens. output_final_state: a bool; the final state is
      fp32 `[N, HV, K, V]`.
    - cu_seqlens: None, or int32 / int64 `[N + 1]` on q's device with B = 1 (packed documents).
    - o: bf16 `[B, T, HV, V]`, contiguous. Every tensor argument must be on q's device (ValueError otherwise).

    With `use_qk_l2norm_in_kernel`, q and k are L2-normalised per head first
    (x / sqrt(sum x^2 + 1e-6)) and the backward goes through the norm. Differentiable in q, k, v, g, beta and
    initial_state. Bad operands raise ValueError / TypeError naming the argument before any launch. No
    device->host synchronisation (cu_seqlens stays on the device and is trusted: 0 = c_0 <= ... <= c_N = T, as
    in fla; a pack padded past its last document must pass the padding as one more segment — rows past c_N
    are not computed: their outputs and gradients are undefined (uninitialised memory, possibly NaN); on a GPU
    a violation cannot be detected without a sync — it gives garbage outputs, never a read or write outside the
    tensors (the kernels clamp every document into [0, T]); on CPU it raises). A log-decay below -128 per token
    counts as -128 (exp(-128) is 0 in fp32), so g = -inf, a full forget, gives the exact finite result.
    `configure(gdn_check_seqlens=True)` (`--cake-gdn-check-seqlens`) checks them on the host before each call
    instead (one device sync per call; eager mode).

    Context parallelism: `cp_context=cake.build_cp_context(cu_seqlens_global, group, layout=...)` and the rank's
    tokens (B = 1, the rank's shard in layout order): the documents come from the context (cu_seqlens must be
    None), initial_state / output_final_state are not served (ValueError, as fla). The ranks exchange their
    chunk states (one all_gather of 4 HV K (V + K) bytes per piece that continues on another rank, forward; one
    of 4 HV K V per piece that continues one, backward) and chain them in fp32 in a fixed order: det bits repeat
    for a given layout, group size and cu_seqlens. Eager only (the collectives run inside an autograd.Function).
    """
    from ._impl import gdn as impl  # a static import: torch.compile traces it (importlib it cannot)

    return impl.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                       output_final_state=output_final_state,
                                       use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
                                       cp_context=cp_context)
