"""rmsnorm declaration, check_supported and CLI flags (torch-free)."""

import pytest

from miles_ext_kernels import cake
from miles_ext_kernels.cake import rmsnorm
from tests.cake._cli import assert_cli_variants, parse_validated
from tests.cake._helpers import assert_declared


def test_declaration():
    assert_declared(rmsnorm.OP, "rmsnorm", "linear_attention_input_norm",
                    ("ZeroCenteredRMSNorm", "zero_centered_rmsnorm"), ("hidden_size",))
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


def test_cli_flags():
    assert_cli_variants("rmsnorm", ("--linear-attention-input-norm", "cake"))
    with pytest.raises(SystemExit):
        parse_validated("--linear-attention-input-norm", "cake", "--cake-rmsnorm-variant", "exact")


def test_prebuild_params_checked_before_anything():
    with pytest.raises(TypeError, match="hidden_size"):
        cake.prebuild("rmsnorm", head_dim=128)
