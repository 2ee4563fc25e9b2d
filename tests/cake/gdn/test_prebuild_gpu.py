"""One prebuild of gdn (head dims 128 / 128), then every route runs under no_build(): in this process, and in a
fresh process that shares the cache directory (it compiles nothing and gets the same det bits)."""
import importlib
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
    """Calls that launch every route: with / without initial state, final state, dht, L2 norm; det and fast;
    kept and recomputed states. Returns the det bits."""
    d = importlib.import_module("miles_ext_kernels.cake._impl.gdn.demo")
    from miles_ext_kernels.cake import gdn

    out = {}
    for l2 in (True, False):
        for h0 in (True, False):
            for final in (True, False):
                for variant, recompute in (("det", False), ("fast", True)):
                    mek.configure(gdn_variant=variant, gdn_recompute_state=recompute)
                    inp = d.make_inputs([70, 130], 2, 4, 128, 128, "cuda", seed=1, h0=h0, l2=l2)
                    leaves = {n: inp[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
                    if h0:
                        leaves["h0"] = inp["h0"].clone().requires_grad_(True)
                    o, ht = gdn.chunk_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"],
                                                       leaves["beta"], initial_state=leaves.get("h0"),
                                                       output_final_state=final, use_qk_l2norm_in_kernel=l2,
                                                       cu_seqlens=inp["cu"])
                    outs, grads = [o], [inp["do"]]
                    if final:
                        outs.append(ht)
                        grads.append(inp["dht"])
                    torch.autograd.backward(outs, grads)
                    if variant == "det":
                        key = f"l2={l2}/h0={h0}/final={final}"
                        out[key + "/o"] = o.detach().cpu()
                        for n, t in leaves.items():
                            out[key + "/d" + n] = t.grad.cpu()
    mek.configure()
    torch.cuda.synchronize()
    return out


def test_prebuild_then_no_build_here_and_in_fresh_processes(tmp_path):
    """In this process: prebuild, then every route under no_build(). Then a node's view: process A prebuilds into
    an empty cache directory (compiles every route), process B shares that directory and compiles nothing; both run
    every route under no_build(), and their det bits equal this process' bits. (A fresh process must not share this
    process' default cache directory: other checkouts on the machine may have filled it with some of the routes.)"""
    res = cake.prebuild("gdn", head_k_dim=128, head_v_dim=128)
    assert len(res.routes) > 0 and cake.prebuild("gdn", head_k_dim=128, head_v_dim=128) is res
    with cake.no_build():
        here = every_route()
    cake.release("gdn")
    cache = str(tmp_path / "node-cache")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TRITON_CACHE_DIR=cache)
    got = []
    for name in ("A", "B"):
        bits = str(tmp_path / f"bits{name}.pt")
        script = textwrap.dedent(f"""
            import json, torch
            from miles_ext_kernels import cake
            from tests.cake.gdn.test_prebuild_gpu import every_route
            res = cake.prebuild("gdn", head_k_dim=128, head_v_dim=128)
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
        for k in here:
            assert torch.equal(here[k], there[k]), (name, k)
    n = len(res.routes)
    assert got == [{"generated": n, "routes": n}, {"generated": 0, "routes": n}]
