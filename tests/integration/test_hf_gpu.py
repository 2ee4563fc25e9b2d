"""HF transformers' Qwen3NextForCausalLM with `apply_to_qwen3_next` on the GPU at Qwen3-Next's layer shapes.

Hidden 2048, layers linear / linear / linear / full (Qwen3-Next's 3:1), attention 16 q heads over 2 kv heads at
head dim 256, GDN 16 key / 32 value heads at 128 / 128, conv width 4, dense MLP 5632, vocab 4096, on five
documents of 700, 1, 1500, 300 and 2048 tokens. The same comparison as the CPU test (`_hf_case.py`): the
reference is the unpatched model in FP64 on the padded batch, the budget's unit is the unpatched model in bf16
(HF's torch fallbacks, sdpa; fla / causal-conv1d are bypassed where installed, so the unit is HF's own code), and
ours runs the padded batch and both packed ones: logits, loss, every parameter group (the decay-driven A_log and
dt_bias too, see DECAY_DRIVEN) and each GDN layer's dL/dg within 1.5x HF bf16's error, documents isolated, det bits
on a repeat, every patched entry point ran. The ratios are printed (pytest -s). Measured on the H200 (torch 2.11,
triton 3.6, transformers 5.17; every run the same): logits 0.97, loss within its unit, parameter groups 0.91 - 1.03
(A_log 1.03, dt_bias 1.02), dL/dg 0.97 - 0.99.
"""
from __future__ import annotations

import pytest

from tests.integration import _hf_case as hc

pytest.importorskip("transformers")
pytestmark = pytest.mark.gpu
LENS = [700, 1, 1500, 300, 2048]
LAYERS = ("linear_attention", "linear_attention", "linear_attention", "full_attention")


@pytest.fixture(scope="module")
def case():
    cfg = hc.config(hidden=2048, layers=LAYERS, heads=16, kv_heads=2, k_heads=16, v_heads=32, vocab=4096,
                    intermediate=5632)
    return hc.build_case(cfg, LENS, "cuda")


def test_entry_points_ran_and_second_apply_is_a_noop(case):
    per_forward = {"varlen_gqa_attention": 1, "chunk_gated_delta_rule": 3, "causal_conv1d": 3,
                   "rmsnorm_silu_gate": 3, "zero_centered_rmsnorm": 2 * 4 + 2 + 1}
    for run in ("padded", "packed", "pos_only"):
        assert dict(case["counts"][run]) == per_forward, run
    assert case["again"] == {}


class TestQwen3Next(hc.CaseChecks):
    """Within budget of FP64 per parameter group (decay-driven ones held too), documents isolated, det bits."""
