"""Hugging Face transformers: one call swaps the cake ops into Qwen3-Next (and Qwen3.5 / Qwen3.5-MoE) models, and
into Kimi-Linear's KDA layers (`apply_to_kimi_linear`).

    from miles_ext_kernels.integrations.transformers import apply_to_qwen3_next
    model = Qwen3NextForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda()
    apply_to_qwen3_next(model)              # or apply_to_qwen3_next() before building models: patches the classes
    # train as usual; packed batches (DataCollatorWithFlattening) run document-isolated in every layer

What is patched (each piece at the narrowest point of HF's modelling code):
- full attention (`attention=True`): the attention core runs `varlen_gqa_attention`, registered as the HF attention
  implementation "cake" (`AttentionInterface` and a mask function that hands over the 2D padding mask, as FA2's
  does); the model's text config is switched to it. HF's q/k norms, RoPE, output gate and projections stay.
- Gated DeltaNet (`linear_attention=True`): the layer's forward is replaced (HF's repeats the key heads for GVA,
  transposes the conv input to [B, D, T], zeroes padding instead of skipping it, and never sees the document
  boundaries of a position-ids-only packed batch). Ours keeps HF's projections, `A_log` / `dt_bias` math, gated
  norm and output projection, and runs the short conv through `causal_conv1d` and the core through
  `chunk_gated_delta_rule` with GVA native (value head hv reads key head hv // (HV / H), no repeated heads), both
  over the same `cu_seqlens`.
- norms (`norms=True`): every `*RMSNormGated` through `rmsnorm_silu_gate`, every zero-centred `*RMSNorm`
  (decoder, final, q/k norms) through `zero_centered_rmsnorm`. Parameters and state-dict names are HF's.
- the text model's forward gets a thin wrapper that finds the documents once per forward and hands them to every
  layer: `cu_seq_lens_q/k` + `max_length_q/k` kwargs (DataCollatorWithFlattening(return_flash_attn_kwargs=True)),
  else position ids restarting per document (its default), else a 2D `attention_mask` (padded batches run unpadded:
  only the kept tokens reach the kernels), else one document per row. A packed batch cannot fill a cache, so the
  wrapper turns HF's default `use_cache` off for it (an explicit `use_cache=True` or a `past_key_values` raises).

`apply_to_*` returns what it patched, `{entry point: [classes or module names]}`; a second call patches nothing
and returns `{}`. A layer or shape the ops do not serve raises `ValueError` / `TypeError` naming the module and the
op — at `apply_to_*(model)` for static shapes, at the first forward for dtypes (bf16 only) and for class patches —
never a silent fallback to HF's torch code. Importing this module imports neither torch nor transformers.
"""
from __future__ import annotations

ATTN_IMPLEMENTATION = "cake"

__all__ = ["ATTN_IMPLEMENTATION", "apply_to_qwen3_next", "apply_to_qwen3_5", "apply_to_qwen3_5_moe",
           "apply_to_kimi_linear", "register_attention"]


def apply_to_qwen3_next(model=None, *, attention: bool = True, linear_attention: bool = True,
                        norms: bool = True) -> dict[str, list[str]]:
    """Swap the cake ops into HF's Qwen3-Next: one model instance, or (model=None) the classes, so that every
    Qwen3-Next model built afterwards (and every existing one, at its next forward) runs them.

    attention: the full-attention core through `varlen_gqa_attention` (attn_implementation "cake").
    linear_attention: the Gated DeltaNet core and its short conv through `chunk_gated_delta_rule` /
    `causal_conv1d`. norms: the gated output norm through `rmsnorm_silu_gate`, every Qwen3NextRMSNorm through
    `zero_centered_rmsnorm`. Returns `{entry point: [patched classes or module names]}` ({} when nothing was left
    to patch). The model must run in bf16 on a GPU the ops serve (or CPU tensors under TRITON_INTERPRET=1).
    """
    from . import _hf

    return _hf.apply("qwen3_next", model, attention=attention, linear_attention=linear_attention, norms=norms)


def apply_to_qwen3_5(model=None, *, attention: bool = True, linear_attention: bool = True,
                     norms: bool = True) -> dict[str, list[str]]:
    """`apply_to_qwen3_next` for HF's Qwen3.5 (dense) text model (`Qwen3_5ForCausalLM`, or the language model
    of `Qwen3_5ForConditionalGeneration`; its vision tower is left as it is)."""
    from . import _hf

    return _hf.apply("qwen3_5", model, attention=attention, linear_attention=linear_attention, norms=norms)


def apply_to_qwen3_5_moe(model=None, *, attention: bool = True, linear_attention: bool = True,
                         norms: bool = True) -> dict[str, list[str]]:
    """`apply_to_qwen3_next` for HF's Qwen3.5-MoE text model (the MoE blocks are left as they are)."""
    from . import _hf

    return _hf.apply("qwen3_5_moe", model, attention=attention, linear_attention=linear_attention, norms=norms)


def apply_to_kimi_linear(model=None, *, linear_attention: bool = True) -> dict[str, list[str]]:
    """Swap the cake ops into HF's Kimi-Linear (`KimiLinearForCausalLM`): every KDA layer's short conv and core run
    `causal_conv1d` and `chunk_kda` (the forget gate in the kernel: `use_gate_in_kernel` with the layer's A_log and
    dt_bias, whose gradients come back from it) over the documents of the batch; HF's projections, output gate,
    sigmoid-gated norm and output projection stay. One model instance, or (model=None) the classes.

    Not served, so left to HF: the full-attention layers (MLA, q / k head dim 192, v 128), the plain and the
    sigmoid-gated RMSNorm, the MoE. A packed batch therefore needs an HF attention implementation that keeps
    documents apart in those layers (`attn_implementation="flash_attention_2"`); with sdpa / eager one raises a
    `ValueError` at the forward instead of running attention across documents (padded batches are fine).
    Returns `{entry point: [patched classes or module names]}` ({} when nothing was left to patch).
    """
    from . import _hf

    return _hf.apply("kimi_linear", model, attention=False, linear_attention=linear_attention, norms=False)


def register_attention() -> str:
    """Register `varlen_gqa_attention` as HF attention implementation "cake" (idempotent; `apply_to_*` does it);
    returns the name, for `from_pretrained(..., attn_implementation="cake")`."""
    from . import _hf

    _hf.register_attention()
    return ATTN_IMPLEMENTATION
