"""One prebuild of gated_rmsnorm, then every route (both variants, both weight dtypes, every row-count window) runs
under no_build(): in this process, and in a fresh process sharing the cache directory (whose det bits must equal
this process' bits)."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels import cake

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
D = 128


def every_route(D):
    """Run every route of head dim D (small and large row windows, fp32/bf16 weights, det/fast); return det bits."""
    from miles_ext_kernels.cake import gated_rmsnorm as decl
    from miles_ext_kernels.cake._impl.gated_rmsnorm import ops

    out = {}
    NH = 32
    for T in (10, ops.SMALL_N // NH + 1, 1000):
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
    """In this process: prebuild, then every route under no_build(). Then a node's view: process A prebuilds into
    an empty cache directory (compiles every route), process B shares that directory and compiles nothing; both run
    every route under no_build(), and their det bits equal this process' bits."""
    res = cake.prebuild("gated_rmsnorm", head_dim=D)
    assert len(res.routes) > 0 and cake.prebuild("gated_rmsnorm", head_dim=D) is res
    with cake.no_build():
        here = every_route(D)
    cake.release("gated_rmsnorm")
    cache = str(tmp_path / "node-cache")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TRITON_CACHE_DIR=cache)
    got = []
    for name in ("A", "B"):
        bits = str(tmp_path / f"bits{name}.pt")
        script = textwrap.dedent(f"""
            import json, torch
            from miles_ext_kernels import cake
            from tests.cake.gated_rmsnorm.test_prebuild_gpu import every_route
            res = cake.prebuild("gated_rmsnorm", head_dim={D})
            with cake.no_build():
                torch.save(every_route({D}), {bits!r})
            print(json.dumps({{"generated": res.generated, "routes": len(res.routes)}}))
        """)
        out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        got.append(json.loads(out.stdout.strip().splitlines()[-1]))
        there = torch.load(bits)
        assert there.keys() == here.keys()
        for k in here:
            assert torch.equal(here[k], there[k]), (name, k)
    n = len(res.routes)
    assert got == [{"generated": n, "routes": n}, {"generated": 0, "routes": n}]
