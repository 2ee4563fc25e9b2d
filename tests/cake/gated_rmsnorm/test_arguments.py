"""gated_rmsnorm declaration, check_supported and CLI flags (torch-free)."""

import pytest

from miles_ext_kernels import cake
from miles_ext_kernels.cake import gated_rmsnorm
from tests.cake._cli import assert_cli_variants
from tests.cake._helpers import assert_declared


def test_declaration():
    assert_declared(gated_rmsnorm.OP, "gated_rmsnorm", "linear_attention_output_norm_backend", ("rmsnorm_silu_gate",),
                    ("head_dim",))
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


def test_cli_flags():
    assert_cli_variants("gated_rmsnorm", ("--linear-attention-output-norm-backend", "cake"))


def test_prebuild_params_checked_before_anything():
    with pytest.raises(TypeError, match="head_dim"):
        cake.prebuild("gated_rmsnorm", hidden_size=128)
