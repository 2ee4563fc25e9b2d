"""conv1d declaration, check_supported and command-line flags: torch-free."""
import argparse

import pytest

import miles_ext_kernels as mek
from miles_ext_kernels import cake
from miles_ext_kernels.cake import conv1d
from tests.cake._cli import assert_cli_option, parse_validated
from tests.cake._helpers import assert_declared, assert_import_is_torch_free


def test_declaration():
    op = conv1d.OP
    assert_declared(op, "conv1d", "linear_attention_conv_backend", ("causal_conv1d",), ("weight_dtype",))
    flag = op.option("silu_grad_preactivation")
    assert flag.choices == ("bf16", "fp32") and flag.default == "bf16"
    assert "causal_conv1d" in cake.__all__


def test_import_is_torch_free():
    assert_import_is_torch_free("miles_ext_kernels.cake.conv1d", "m.check_supported()")


def test_check_supported_accepts():
    for w in (2, 3, 4):
        for act in (None, "silu", "swish"):
            for wd in ("float32", "bfloat16"):
                conv1d.check_supported(kernel_size=w, activation=act, weight_dtype=wd)


@pytest.mark.parametrize("kwargs, word", [
    (dict(has_bias=True), "bias"),
    (dict(kernel_size=5), "kernel_size"),
    (dict(kernel_size=1), "kernel_size"),
    (dict(kernel_size=True), "kernel_size"),
    (dict(activation="gelu"), "activation"),
    (dict(weight_dtype="float16"), "weight_dtype"),
    (dict(x_dtype="float32"), "x_dtype"),
])
def test_check_supported_rejects(kwargs, word):
    with pytest.raises(ValueError, match=word):
        conv1d.check_supported(**kwargs)


def test_cli_defaults_and_option():
    assert_cli_option("conv1d", ("--linear-attention-conv-backend", "cake"), "silu_grad_preactivation", "bf16",
                      ("--cake-conv1d-silu-grad-preactivation", "fp32"), "fp32")


def test_cli_deterministic_mode_resolves_det():
    args = parse_validated("--linear-attention-conv-backend", "cake", "--deterministic-mode")
    assert args.cake_conv1d_variant == "det"
    with pytest.raises(ValueError, match="fast"):
        parse_validated("--linear-attention-conv-backend", "cake", "--deterministic-mode",
                        "--cake-conv1d-variant", "fast")


def test_option_without_selector_rejected():
    with pytest.raises(ValueError, match="conv1d"):
        parse_validated("--cake-conv1d-silu-grad-preactivation", "fp32")
    with pytest.raises(SystemExit):
        parse_validated("--linear-attention-conv-backend", "cake", "--cake-conv1d-silu-grad-preactivation", "fp16")


def test_validate_kernel_width():
    ns = argparse.Namespace(linear_attention_conv_backend="cake", linear_conv_kernel_dim=5)
    with pytest.raises(ValueError, match="kernel width"):
        conv1d.OP.validate(ns)
    conv1d.OP.validate(argparse.Namespace(linear_conv_kernel_dim=4))


def test_configure_keywords():
    from miles_ext_kernels.cake._runtime import config
    mek.configure(conv1d_variant="fast", conv1d_silu_grad_preactivation="fp32")
    assert config.variant("conv1d") == "fast"
    assert config.option("conv1d", "silu_grad_preactivation") == "fp32"
    with pytest.raises(ValueError):
        mek.configure(conv1d_silu_grad_preactivation="fp16")
    mek.configure()
    assert config.variant("conv1d") == "det"  # unconfigured process
    assert config.option("conv1d", "silu_grad_preactivation") == "bf16"
