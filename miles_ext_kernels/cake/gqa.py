"""gqa: packed (variable-length) causal grouped-query attention, head dim 256, bf16, forward and backward, for
miles' Qwen3-Next / Qwen3.5 full-attention layers (selector `--full-attention-backend cake`). Torch-free
declaration; the implementation (our Triton kernels for Hopper) loads on first use.

Variants (the backward runs the variant its forward ran):
- det (default of a process that never configured the op; resolved by `--deterministic-mode`): out, LSE, dQ, dK
  and dV repeat bit for bit run to run, in a fresh process, on any stream, at any workspace pool bound, for any
  valid `max_seqlen_k`, and a document's bits do not depend on the pack it sits in (alone, first, last, between
  other documents; whatever the total token count). No atomics anywhere: dK/dV of a key block sum the group's
  query heads in a fixed order, dQ sums key blocks in order in its own pass.
- fast (miles' command-line default): out, LSE, dK and dV as det (same kernels); dQ may be summed with fp32
  atomics (in no fixed order), so its low bits may differ run to run. On sm_90a the fast variant currently
  runs the det kernels (the atomic dQ was slower there, see bench/NOTES.md, gqa), so it gives det's bits.
"""
from __future__ import annotations

from miles_ext_kernels.cake._runtime.declare import check_counts, check_seqlens_flag
from miles_ext_kernels.cake._runtime.spec import OpSpec

HEAD_DIM = 256


def check_supported(num_heads_q, num_heads_kv, head_dim=HEAD_DIM) -> None:
    """Raise ValueError/TypeError naming what this op does not serve (torch-free, before anything is built).

    Served: head_dim 256, num_heads_q a positive multiple of num_heads_kv (any ratio: 1/1, 2/1, 3/1, 8/1, ...).
    """
    check_counts((("num_heads_q", num_heads_q), ("num_heads_kv", num_heads_kv), ("head_dim", head_dim)), "gqa: ")
    if head_dim != HEAD_DIM:
        raise ValueError(f"gqa: head_dim {head_dim} is not served (only {HEAD_DIM})")
    if num_heads_q % num_heads_kv:
        raise ValueError(f"gqa: num_heads_q ({num_heads_q}) must be a multiple of num_heads_kv ({num_heads_kv})")


def is_supported(num_heads_q, num_heads_kv, head_dim=HEAD_DIM) -> bool:
    """Whether `check_supported` accepts these heads."""
    try:
        check_supported(num_heads_q, num_heads_kv, head_dim)
    except (TypeError, ValueError):
        return False
    return True


def rank_heads(args) -> tuple[int, int, int]:
    """(query heads, key/value heads, head dim) of one tensor-parallel rank, from miles' parsed arguments."""
    tp = getattr(args, "tensor_model_parallel_size", None) or 1
    n_heads = getattr(args, "num_attention_heads", None)
    if n_heads is None:
        raise ValueError("gqa: --num-attention-heads is needed to check the attention heads")
    groups = getattr(args, "num_query_groups", None) or n_heads
    head_dim = getattr(args, "kv_channels", None)
    if head_dim is None:
        hidden = getattr(args, "hidden_size", None)
        if hidden is None:
            raise ValueError("gqa: --kv-channels or --hidden-size is needed to know the head dim")
        head_dim = hidden // n_heads
    if n_heads % tp:
        raise ValueError(f"gqa: {n_heads} attention heads do not split over tensor parallel size {tp}")
    kv = max(groups, tp)
    if kv % tp:
        raise ValueError(f"gqa: {groups} query groups do not split over tensor parallel size {tp}")
    return n_heads // tp, kv // tp, head_dim


def _validate(args) -> None:
    """Startup check (validate_args): the heads of one tensor-parallel rank must be served (skipped when the
    parsed arguments carry no model shape, e.g. a parser without miles' model flags)."""
    if getattr(args, "num_attention_heads", None) is None:
        return
    hq, hkv, d = rank_heads(args)
    check_supported(hq, hkv, d)


OP = OpSpec("gqa", selected_by=(("full_attention_backend", "cake"),), entry_points=("varlen_gqa_attention",),
            options=(check_seqlens_flag("gqa", "cu_seqlens_q/k and max_seqlen_k", ""),), validate=_validate,
            bench="gqa")


def varlen_gqa_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_k, softmax_scale=None,
                         return_lse=False):
    """Packed causal GQA attention: out[T_q, H_q, 256] (bf16), or (out, lse) with `return_lse=True`.

    - q `[T_q, H_q, 256]`, k, v `[T_k, H_kv, 256]`: bf16 CUDA tensors, any row strides with a unit last stride
      (views of one packed QKV projection are read in place); H_q a multiple of H_kv (any ratio).
    - cu_seqlens_q, cu_seqlens_k: contiguous int32 or int64 `[B + 1]` (one dtype for both) on q's device (as k
      and v: ValueError otherwise), starting at 0, non-decreasing, ending within T_q / T_k (trusted unless
      check_seqlens, below; boundaries that break this give garbage outputs, never a read or write outside the
      tensors: the kernels clamp them). Tokens past `cu_seqlens_*[-1]` are padding: outputs and gradients 0.
    - Causal, bottom-right aligned per segment: query i of a segment with L_q queries and L_k keys sees keys
      j <= i + L_k - L_q. A row that sees no key gets output 0, LSE -inf and no gradient. Empty segments,
      T_q = 0 and T_k = 0 are valid.
    - max_seqlen_k: keyword-only host int >= every segment's key count (a contract, as in FlashAttention; the
      result does not depend on its value). `configure(gqa_check_seqlens=True)` (`--cake-gqa-check-seqlens`)
      checks the boundaries and this bound on the host before each call (one device sync).
    - softmax_scale: default 256 ** -0.5. lse: fp32 `[H_q, T_q]`, natural log, no gradient through it.
    - Differentiable in q, k, v. No device->host sync (unless check_seqlens), CUDA-graph capturable,
      torch.compile(fullgraph=True) traces it (custom ops `miles_ext_kernels::gqa_fwd` / `gqa_bwd`).
    - Variant (det / fast) as configured when the call runs; see the module docstring for what each promises.
    """
    from ._impl import gqa as impl  # a static import: torch.compile traces it (importlib it cannot)

    return impl.varlen_gqa_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k=max_seqlen_k,
                                     softmax_scale=softmax_scale, return_lse=return_lse)
