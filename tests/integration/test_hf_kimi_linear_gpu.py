"""HF transformers' KimiLinearForCausalLM with `apply_to_kimi_linear` on the GPU at Kimi-Linear's KDA shapes.

Hidden 2048, three KDA layers of 16 heads at Kimi-Linear's head dim 128, conv width 4, dense MLPs of 4096, vocab
4096, on four documents of 700, 1, 65 and 300 tokens. The sizes are bounded by HF's torch fallback, which
materialises a [B, H, chunks, 64, 64, K] decay tensor per layer (FP64 in the reference): Kimi-Linear's 32 heads on
documents of up to 2048 tokens need over 100 GB of it. The comparison of the CPU test
(`test_hf_kimi_linear_cpu.py`): the unpatched model in FP64 on the padded batch is the reference, the unpatched
model in bf16 (HF's torch fallbacks) the unit; ours on the padded batch and both packed ones within 1.5x HF bf16's
error for the logits, the loss and every parameter group, the forget gate's decay-driven ones too (as the Qwen3-Next
GPU test holds A_log / dt_bias); documents isolated; det bits on a repeat. On the H200: 6 passed (ratios 0.81 - 1.07).
"""
from __future__ import annotations

import pytest

from tests.integration import _hf_case as hc

pytest.importorskip("transformers.models.kimi_linear")
pytestmark = pytest.mark.gpu
LENS = [700, 1, 65, 300]


@pytest.fixture(scope="module")
def case():
    from transformers import KimiLinearConfig, KimiLinearForCausalLM

    from miles_ext_kernels.integrations.transformers import apply_to_kimi_linear

    cfg = KimiLinearConfig(
        vocab_size=4096, hidden_size=2048, intermediate_size=4096, num_hidden_layers=3,
        layer_types=["linear_attention"] * 3, mlp_layer_types=["dense"] * 3, num_attention_heads=16,
        num_key_value_heads=16, linear_head_dim=128, linear_num_heads=16, linear_conv_kernel_dim=4,
        initializer_range=0.02, model_max_length=8192, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, use_cache=False)
    return hc.build_case(cfg, LENS, "cuda", cls=KimiLinearForCausalLM, apply=apply_to_kimi_linear,
                         hf_module="transformers.models.kimi_linear.modeling_kimi_linear",
                         core="chunk_kimi_delta_attention", dg=False)


def test_entry_points_ran(case):
    for run in ("padded", "packed", "pos_only"):
        assert dict(case["counts"][run]) == {"chunk_kda": 3, "causal_conv1d": 3}, run


class TestKimiLinear(hc.CaseChecks):
    """Within budget of FP64 per parameter group (decay-driven ones held too), documents isolated, det bits."""
