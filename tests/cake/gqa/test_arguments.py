"""gqa declaration, check_supported, TP-rank validation and CLI flags (torch-free)."""
import argparse
import types

import pytest

import miles_ext_kernels as mek
from miles_ext_kernels import cake
from miles_ext_kernels.cake import gqa
from tests.cake._cli import parse_validated
from tests.cake._helpers import assert_declared, assert_import_is_torch_free


def test_declaration():
    op = gqa.OP
    assert_declared(op, "gqa", "full_attention_backend", ("varlen_gqa_attention",), ())
    assert [f.name for f in op.options] == ["check_seqlens"] and op.options[0].is_bool
    assert gqa.varlen_gqa_attention.__doc__ and cake.varlen_gqa_attention is gqa.varlen_gqa_attention


def test_declaration_is_torch_free():
    assert_import_is_torch_free("miles_ext_kernels.cake.gqa", "m.check_supported(24, 4)")


@pytest.mark.parametrize("hq,hkv", [(16, 2), (8, 1), (24, 4), (3, 1), (1, 1), (2, 2), (32, 4), (6, 3)])
def test_supported(hq, hkv):
    gqa.check_supported(hq, hkv)
    gqa.check_supported(hq, hkv, 256)
    assert gqa.is_supported(hq, hkv)


@pytest.mark.parametrize("args,err,match", [
    ((16, 3), ValueError, "multiple"), ((16, 2, 128), ValueError, "head_dim"),
    ((0, 1), ValueError, "num_heads_q"), ((4, 0), ValueError, "num_heads_kv"),
    ((16.0, 2), TypeError, "num_heads_q"), ((16, True), TypeError, "num_heads_kv"),
    ((16, 2, "256"), TypeError, "head_dim"),
])
def test_refused(args, err, match):
    with pytest.raises(err, match=match):
        gqa.check_supported(*args)
    assert not gqa.is_supported(*args)


def _ns(**kw):
    return types.SimpleNamespace(**kw)


def test_rank_heads():
    # Qwen3.5-27B: 24 query heads, 4 groups, head dim 256; TP 8 -> 3 query heads over 1 kv head per rank
    assert gqa.rank_heads(_ns(num_attention_heads=24, num_query_groups=4, kv_channels=256,
                              tensor_model_parallel_size=8)) == (3, 1, 256)
    assert gqa.rank_heads(_ns(num_attention_heads=16, num_query_groups=2, kv_channels=None, hidden_size=4096,
                              tensor_model_parallel_size=1)) == (16, 2, 256)
    assert gqa.rank_heads(_ns(num_attention_heads=16, num_query_groups=2, kv_channels=256,
                              tensor_model_parallel_size=2)) == (8, 1, 256)
    gqa.OP.validate(_ns(num_attention_heads=24, num_query_groups=4, kv_channels=256, tensor_model_parallel_size=8))
    with pytest.raises(ValueError, match="head_dim"):
        gqa.OP.validate(_ns(num_attention_heads=16, num_query_groups=2, kv_channels=128,
                            tensor_model_parallel_size=1))
    with pytest.raises(ValueError, match="tensor parallel"):
        gqa.OP.validate(_ns(num_attention_heads=24, num_query_groups=4, kv_channels=256,
                            tensor_model_parallel_size=16))
    gqa.OP.validate(_ns())  # no model shape on args: nothing to check


def _parse(argv):
    return parse_validated(*argv)


def test_cli_flags():
    args = _parse(["--full-attention-backend", "cake"])
    assert args.cake_gqa_variant == "fast" and args.cake_gqa_check_seqlens is False
    args = _parse(["--full-attention-backend", "cake", "--deterministic-mode"])
    assert args.cake_gqa_variant == "det"
    args = _parse(["--full-attention-backend", "cake", "--cake-gqa-variant", "det", "--cake-gqa-check-seqlens"])
    assert args.cake_gqa_variant == "det" and args.cake_gqa_check_seqlens is True
    with pytest.raises(ValueError, match="gqa"):
        _parse(["--cake-gqa-check-seqlens"])  # option without the selector
    with pytest.raises(ValueError, match="fast"):
        _parse(["--full-attention-backend", "cake", "--deterministic-mode", "--cake-gqa-variant", "fast"])
    mek.configure()


def test_cli_validates_rank_heads():
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-attention-heads", type=int)
    parser.add_argument("--num-query-groups", type=int)
    parser.add_argument("--kv-channels", type=int)
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    mek.add_arguments(parser)
    ok = parser.parse_args(["--full-attention-backend", "cake", "--num-attention-heads", "24",
                            "--num-query-groups", "4", "--kv-channels", "256", "--tensor-model-parallel-size", "8"])
    mek.validate_args(ok)
    bad = parser.parse_args(["--full-attention-backend", "cake", "--num-attention-heads", "32",
                             "--num-query-groups", "8", "--kv-channels", "128"])
    with pytest.raises(ValueError, match="head_dim"):
        mek.validate_args(bad)
    mek.configure()


def test_prebuild_takes_no_params():
    with pytest.raises(TypeError, match="gqa"):
        cake.prebuild("gqa", head_dim=256)
