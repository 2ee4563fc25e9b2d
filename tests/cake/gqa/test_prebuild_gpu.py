"""One prebuild of gqa, then every route (forward, delta, dQ, dK/dV, tile prefix; det and fast) runs under
no_build(): in this process, and in fresh processes sharing the cache directory (det bits equal this process')."""
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


def every_route():
    """Run every route (both variants; odd strides of packed views; padding; ratios 1, 3, 8); return det bits."""
    from miles_ext_kernels.cake import gqa as decl

    out = {}
    for hq, hkv, lens in ((8, 1, [300, 0, 517]), (3, 1, [129]), (2, 2, [64, 64])):
        for variant in ("det", "fast"):
            mek.configure(gqa_variant=variant)
            g = torch.Generator().manual_seed(hq)
            T = sum(lens) + 40
            qkv = torch.randn(T, hq + 2 * hkv, 256, generator=g).to("cuda", torch.bfloat16)
            q, k, v = (t.requires_grad_() for t in (qkv[:, :hq].clone(), qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]))
            k, v = k.detach().requires_grad_(), v.detach().requires_grad_()
            do = torch.randn(T, hq, 256, generator=g).to("cuda", torch.bfloat16)
            cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device="cuda")
            o, lse = decl.varlen_gqa_attention(q, k, v, cu, cu, max_seqlen_k=max(lens), return_lse=True)
            dq, dk, dv = torch.autograd.grad(o, (q, k, v), do)
            if variant == "det":
                for name, t in (("out", o), ("lse", lse), ("dq", dq), ("dk", dk), ("dv", dv)):
                    out[f"{hq}/{hkv}/{name}"] = t.detach().float().cpu()
    mek.configure()
    torch.cuda.synchronize()
    return out


def test_prebuild_then_no_build_here_and_in_fresh_processes(tmp_path):
    res = cake.prebuild("gqa")
    assert len(res.routes) > 0 and cake.prebuild("gqa") is res
    with cake.no_build():
        here = every_route()
    cake.release("gqa")
    cache = str(tmp_path / "node-cache")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TRITON_CACHE_DIR=cache)
    got = []
    for name in ("A", "B"):
        bits = str(tmp_path / f"bits{name}.pt")
        script = textwrap.dedent(f"""
            import json, torch
            from miles_ext_kernels import cake
            from tests.cake.gqa.test_prebuild_gpu import every_route
            res = cake.prebuild("gqa")
            with cake.no_build():
                torch.save(every_route(), {bits!r})
            print(json.dumps({{"generated": res.generated, "routes": len(res.routes)}}))
        """)
        out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        got.append(json.loads(out.stdout.strip().splitlines()[-1]))
        there = torch.load(bits)
        assert there.keys() == here.keys()
        for key in here:
            assert torch.equal(here[key], there[key]), (name, key)
    n = len(res.routes)
    assert got == [{"generated": n, "routes": n}, {"generated": 0, "routes": n}]
