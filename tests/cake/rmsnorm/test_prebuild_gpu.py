"""One prebuild of rmsnorm, then every route (both variants, both weight dtypes, every token-count window) runs
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
H = 2048


def every_route(H):
    """Run every route of width H (small and large token windows, fp32/bf16 weights, det/fast); return det bits."""
    from miles_ext_kernels.cake import rmsnorm as decl
    from miles_ext_kernels.cake._impl.rmsnorm import ops

    out = {}
    for T in (100, ops.SMALL_T + 1, 3000):
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
    """In this process: prebuild, then every route under no_build(). Then a node's view: process A prebuilds into
    an empty cache directory (compiles every route), process B shares that directory and compiles nothing; both run
    every route under no_build(), and their det bits equal this process' bits."""
    res = cake.prebuild("rmsnorm", hidden_size=H)
    assert len(res.routes) > 0 and cake.prebuild("rmsnorm", hidden_size=H) is res
    with cake.no_build():
        here = every_route(H)
    cake.release("rmsnorm")
    cache = str(tmp_path / "node-cache")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TRITON_CACHE_DIR=cache)
    got = []
    for name in ("A", "B"):
        bits = str(tmp_path / f"bits{name}.pt")
        script = textwrap.dedent(f"""
            import json, torch
            from miles_ext_kernels import cake
            from tests.cake.rmsnorm.test_prebuild_gpu import every_route
            res = cake.prebuild("rmsnorm", hidden_size={H})
            with cake.no_build():
                torch.save(every_route({H}), {bits!r})
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
