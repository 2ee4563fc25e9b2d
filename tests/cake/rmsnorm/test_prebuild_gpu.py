"""One prebuild of rmsnorm, then every route (both variants, both weight dtypes, every token-count window) runs
under no_build(): in this process, and in a fresh process sharing the cache directory (whose det bits must equal
this process' bits)."""
import pytest

from tests.cake._norms import every_route_det_bits
from tests.cake._prebuild import check_prebuild_here_and_on_a_node

pytestmark = pytest.mark.gpu
H = 2048


def every_route(H):
    """Run every route of width H (small and large token windows, fp32/bf16 weights, det/fast); return det bits."""
    from miles_ext_kernels.cake import rmsnorm as decl
    from miles_ext_kernels.cake._impl.rmsnorm import configs

    return every_route_det_bits("rmsnorm", decl.zero_centered_rmsnorm, (100, configs.SMALL_T + 1, 3000),
                                lambda T: (T, H), gated=False, weight_mean=0)


def test_prebuild_then_no_build_here_and_in_fresh_processes(tmp_path):
    check_prebuild_here_and_on_a_node(tmp_path, "rmsnorm", {"hidden_size": H},
                                      "tests.cake.rmsnorm.test_prebuild_gpu", (H,))
