"""One prebuild of gated_rmsnorm, then every route (both variants, both weight dtypes, every row-count window) runs
under no_build(): in this process, and in a fresh process sharing the cache directory (whose det bits must equal
this process' bits)."""
import pytest
import torch

import miles_ext_kernels as mek
from tests.cake._prebuild import check_prebuild_here_and_on_a_node

pytestmark = pytest.mark.gpu
D = 128


def every_route(D):
    """Run every route of head dim D (small and large row windows, fp32/bf16 weights, det/fast); return det bits."""
    from miles_ext_kernels.cake import gated_rmsnorm as decl
    from miles_ext_kernels.cake._impl.gated_rmsnorm import configs

    out = {}
    NH = 32
    for T in (10, configs.SMALL_N // NH + 1, 1000):
        for wdt in (torch.float32, torch.bfloat16):
            for variant in ("det", "fast"):
                mek.configure(gated_rmsnorm_variant=variant)
                g = torch.Generator().manual_seed(T)
                x = torch.randn(T, NH, D, generator=g).to(torch.bfloat16).cuda().requires_grad_(True)
                z = torch.randn(T, NH, D, generator=g).to(torch.bfloat16).cuda().requires_grad_(True)
                w = (1 + 0.1 * torch.randn(D, generator=g)).to(wdt).cuda().requires_grad_(True)
                dy = torch.randn(T, NH, D, generator=g).to(torch.bfloat16).cuda()
                y = decl.rmsnorm_silu_gate(x, z, w)
                y.backward(dy)
                if variant == "det":
                    for k, t in (("y", y), ("dx", x.grad), ("dz", z.grad), ("dw", w.grad)):
                        out[f"{T}/{wdt}/{k}"] = t.detach().float().cpu()
    mek.configure()
    torch.cuda.synchronize()
    return out


def test_prebuild_then_no_build_here_and_in_fresh_processes(tmp_path):
    check_prebuild_here_and_on_a_node(tmp_path, "gated_rmsnorm", {"head_dim": D},
                                      "tests.cake.gated_rmsnorm.test_prebuild_gpu", (D,))
