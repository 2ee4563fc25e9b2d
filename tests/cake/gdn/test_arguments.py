"""gdn declaration and command-line flags: torch-free (check_supported: tests/cake/test_delta_rule_arguments.py)."""

import pytest

import miles_ext_kernels as mek
from miles_ext_kernels.cake import gdn
from tests.cake._cli import assert_cli_option, parse_validated
from tests.cake._helpers import assert_declared, assert_import_is_torch_free


def test_declaration():
    op = gdn.OP
    assert_declared(op, "gdn", "linear_attention_backend", ("chunk_gated_delta_rule",), ("head_k_dim", "head_v_dim"))
    flag = op.option("recompute_state")
    assert flag.is_bool and flag.default is False
    flag = op.option("check_seqlens")
    assert flag.is_bool and flag.default is False


def test_check_seqlens_flag():
    args = parse_validated("--linear-attention-backend", "cake", "--cake-gdn-check-seqlens")
    assert args.cake_gdn_check_seqlens is True
    with pytest.raises(ValueError):
        parse_validated("--cake-gdn-check-seqlens")  # an option without its selector


def test_import_is_torch_free():
    assert_import_is_torch_free("miles_ext_kernels.cake.gdn", "m.check_supported(128, 128, 16, 32)")


def test_cli_defaults_and_option():
    assert_cli_option("gdn", ("--linear-attention-backend", "cake"), "recompute_state", False,
                      ("--cake-gdn-recompute-state",), True)


def test_cli_deterministic_mode_resolves_det():
    args = parse_validated("--linear-attention-backend", "cake", "--deterministic-mode")
    assert args.cake_gdn_variant == "det"


def test_option_without_selector_rejected():
    with pytest.raises(ValueError):
        parse_validated("--cake-gdn-recompute-state")


def test_configure_direct():
    mek.configure(gdn_variant="fast", gdn_recompute_state=True)
    from miles_ext_kernels.cake._runtime import config
    assert config.variant("gdn") == "fast" and config.option("gdn", "recompute_state") is True
    with pytest.raises(ValueError):
        mek.configure(deterministic_mode=True, gdn_variant="fast")
