"""gated_rmsnorm declaration, check_supported and CLI flags (torch-free)."""

import pytest

import miles_ext_kernels as mek
from miles_ext_kernels import cake
from miles_ext_kernels.cake import gated_rmsnorm
from tests.cake._cli import parse_validated


def test_declaration():
    op = gated_rmsnorm.OP
    assert op is cake.op_spec("gated_rmsnorm") and op in cake.OPS
    assert op.variants == ("det", "fast") and op.default_variant == "det"
    assert op.selected_by == (("linear_attention_output_norm_backend", "cake"),)
    assert op.entry_points == ("rmsnorm_silu_gate",)
    assert op.prebuild_params == ("head_dim",) and op.archs == ("sm_90a",)
    assert gated_rmsnorm.rmsnorm_silu_gate.__doc__
    assert "tensor-parallel" in gated_rmsnorm.rmsnorm_silu_gate.__doc__


@pytest.mark.parametrize("d", [64, 128, 256])
def test_supported(d):
    gated_rmsnorm.check_supported(d)
    assert d in gated_rmsnorm.supported_head_dims()


@pytest.mark.parametrize("d,err", [(96, ValueError), (0, ValueError), (512, ValueError), (128.0, TypeError),
                                   (True, TypeError)])
def test_refused(d, err):
    with pytest.raises(err, match="head_dim"):
        gated_rmsnorm.check_supported(d)


def _parse(argv):
    return parse_validated(*argv)


def test_cli_flags():
    sel = ["--linear-attention-output-norm-backend", "cake"]
    assert _parse(sel).cake_gated_rmsnorm_variant == "fast"
    assert _parse(sel + ["--deterministic-mode"]).cake_gated_rmsnorm_variant == "det"
    assert _parse(sel + ["--cake-gated-rmsnorm-variant", "det"]).cake_gated_rmsnorm_variant == "det"
    with pytest.raises(ValueError, match="gated_rmsnorm"):
        _parse(["--cake-gated-rmsnorm-variant", "fast"])
    with pytest.raises(ValueError, match="fast"):
        _parse(sel + ["--deterministic-mode", "--cake-gated-rmsnorm-variant", "fast"])
    mek.configure()


def test_prebuild_params_checked_before_anything():
    with pytest.raises(TypeError, match="head_dim"):
        cake.prebuild("gated_rmsnorm", hidden_size=128)
