"""One prebuild of gated_rmsnorm, then every route (both variants, both weight dtypes, every row-count window) runs
under no_build(): in this process, and in a fresh process sharing the cache directory (whose det bits must equal
this process' bits)."""
import pytest

from tests.cake._norms import every_route_det_bits
from tests.cake._prebuild import check_prebuild_here_and_on_a_node

pytestmark = pytest.mark.gpu
D = 128


def every_route(D):
    """Run every route of head dim D (small and large row windows, fp32/bf16 weights, det/fast); return det bits."""
    from miles_ext_kernels.cake import gated_rmsnorm as decl
    from miles_ext_kernels.cake._impl.gated_rmsnorm import configs

    NH = 32  # T x 32 heads: the row windows are over T x NH rows
    return every_route_det_bits("gated_rmsnorm", decl.rmsnorm_silu_gate, (10, configs.SMALL_N // NH + 1, 1000),
                                lambda T: (T, NH, D), gated=True, weight_mean=1)


def test_prebuild_then_no_build_here_and_in_fresh_processes(tmp_path):
    check_prebuild_here_and_on_a_node(tmp_path, "gated_rmsnorm", {"head_dim": D},
                                      "tests.cake.gated_rmsnorm.test_prebuild_gpu", (D,))
