"""gdn declaration, check_supported and command-line flags: torch-free."""

import pytest

import miles_ext_kernels as mek
from miles_ext_kernels.cake import gdn
from miles_ext_kernels.cake._runtime import registry
from tests.cake._cli import parse_validated
from tests.cake._helpers import assert_import_is_torch_free


def test_declaration():
    op = gdn.OP
    assert op.name == "gdn" and registry.op_spec("gdn") is op
    assert op.variants == ("det", "fast")
    assert op.selected_by == (("linear_attention_backend", "cake"),)
    assert op.entry_points == ("chunk_gated_delta_rule",)
    assert op.prebuild_params == ("head_k_dim", "head_v_dim")
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


def test_check_supported_accepts():
    for kd in (16, 32, 64, 128):
        for vd in (16, 32, 64, 128):
            gdn.check_supported(kd, vd)
    gdn.check_supported(128, 128, 16, 32)


@pytest.mark.parametrize("args, exc, word", [
    ((256, 128), ValueError, "head_k_dim"),
    ((128, 96), ValueError, "head_v_dim"),
    ((128, 128, 3, 4), ValueError, "num_v_heads"),
    ((128, 128, 0, 4), ValueError, "num_k_heads"),
    ((True, 128), TypeError, "head_k_dim"),
    ((128.0, 128), TypeError, "head_k_dim"),
])
def test_check_supported_rejects(args, exc, word):
    with pytest.raises(exc, match=word):
        gdn.check_supported(*args)


def test_cli_defaults_and_option():
    args = parse_validated("--linear-attention-backend", "cake")
    assert args.cake_gdn_variant == "fast"  # miles' command-line default
    assert args.cake_gdn_recompute_state is False
    args = parse_validated("--linear-attention-backend", "cake", "--cake-gdn-recompute-state",
                           "--cake-gdn-variant", "det")
    mek.configure(args)
    from miles_ext_kernels.cake._runtime import config
    assert config.variant("gdn") == "det"
    assert config.option("gdn", "recompute_state") is True


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
