"""rmsnorm declaration, check_supported and CLI flags (torch-free)."""

import pytest

import miles_ext_kernels as mek
from miles_ext_kernels import cake
from miles_ext_kernels.cake import rmsnorm
from tests.cake._cli import parse_validated


def test_declaration():
    op = rmsnorm.OP
    assert op is cake.op_spec("rmsnorm") and op in cake.OPS
    assert op.variants == ("det", "fast") and op.default_variant == "det"
    assert op.selected_by == (("linear_attention_input_norm", "cake"),)
    assert op.entry_points == ("ZeroCenteredRMSNorm", "zero_centered_rmsnorm")
    assert op.prebuild_params == ("hidden_size",) and op.archs == ("sm_90a",)
    assert rmsnorm.zero_centered_rmsnorm.__doc__ and rmsnorm.ZeroCenteredRMSNorm.__doc__


@pytest.mark.parametrize("h", [2048, 2560, 4096, 5120, 7168, 64, 16384, 3072, 8192])
def test_supported(h):
    rmsnorm.check_supported(h)
    assert h in rmsnorm.supported_hidden_sizes()


@pytest.mark.parametrize("h,err", [(100, ValueError), (0, ValueError), (32, ValueError), (16448, ValueError),
                                   (2050, ValueError), (2048.0, TypeError), (True, TypeError), ("2048", TypeError)])
def test_refused(h, err):
    with pytest.raises(err, match="hidden_size"):
        rmsnorm.check_supported(h)


def _parse(argv):
    return parse_validated(*argv)


def test_cli_flags():
    args = _parse(["--linear-attention-input-norm", "cake"])
    assert args.cake_rmsnorm_variant == "fast"  # miles' command-line default
    args = _parse(["--linear-attention-input-norm", "cake", "--deterministic-mode"])
    assert args.cake_rmsnorm_variant == "det"
    args = _parse(["--linear-attention-input-norm", "cake", "--cake-rmsnorm-variant", "det"])
    assert args.cake_rmsnorm_variant == "det"
    with pytest.raises(ValueError, match="rmsnorm"):
        _parse(["--cake-rmsnorm-variant", "det"])  # variant without the selector
    with pytest.raises(ValueError, match="fast"):
        _parse(["--linear-attention-input-norm", "cake", "--deterministic-mode", "--cake-rmsnorm-variant", "fast"])
    with pytest.raises(SystemExit):
        _parse(["--linear-attention-input-norm", "cake", "--cake-rmsnorm-variant", "exact"])
    mek.configure()


def test_prebuild_params_checked_before_anything():
    with pytest.raises(TypeError, match="hidden_size"):
        cake.prebuild("rmsnorm", head_dim=128)
