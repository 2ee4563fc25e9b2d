"""One prebuild of rmsnorm, then every route (both variants, both weight dtypes, every token-count window) runs
under no_build(): in this process, and in a fresh process sharing the cache directory (whose det bits must equal
this process' bits)."""
import pytest
import torch

import miles_ext_kernels as mek
from tests.cake._prebuild import check_prebuild_here_and_on_a_node

pytestmark = pytest.mark.gpu
H = 2048


def every_route(H):
    """Run every route of width H (small and large token windows, fp32/bf16 weights, det/fast); return det bits."""
    from miles_ext_kernels.cake import rmsnorm as decl
    from miles_ext_kernels.cake._impl.rmsnorm import configs

    out = {}
    for T in (100, configs.SMALL_T + 1, 3000):
        for wdt in (torch.float32, torch.bfloat16):
            for variant in ("det", "fast"):
                mek.configure(rmsnorm_variant=variant)
                g = torch.Generator().manual_seed(T)
                x = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda().requires_grad_(True)
                w = (0.1 * torch.randn(H, generator=g)).to(wdt).cuda().requires_grad_(True)
                dy = torch.randn(T, H, generator=g).to(torch.bfloat16).cuda()
                y = decl.zero_centered_rmsnorm(x, w)
                y.backward(dy)
                if variant == "det":
                    for k, t in (("y", y), ("dx", x.grad), ("dw", w.grad)):
                        out[f"{T}/{wdt}/{k}"] = t.detach().float().cpu()
    mek.configure()
    torch.cuda.synchronize()
    return out


def test_prebuild_then_no_build_here_and_in_fresh_processes(tmp_path):
    check_prebuild_here_and_on_a_node(tmp_path, "rmsnorm", {"hidden_size": H},
                                      "tests.cake.rmsnorm.test_prebuild_gpu", (H,))
