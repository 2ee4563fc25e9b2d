"""The prebuild check every op's `test_prebuild_gpu.py` runs (GPU only).

In this process: `cake.prebuild(op, **params)` (a second call returns the remembered result), then every route
under `no_build()`. Then a node's view: process A prebuilds into an empty cache directory (compiles every route),
process B shares that directory and compiles nothing; both run every route under `no_build()`, and their det bits
equal this process' bits. Fresh processes get their own cache directory: the default one may hold some routes
already (other checkouts on the machine), which would hide a route that prebuild misses."""
import importlib
import json
import os
import subprocess
import sys
import textwrap

import torch

import miles_ext_kernels as mek
from miles_ext_kernels import cake
from tests._paths import ROOT


def every_route_bits(module: str, args: tuple) -> dict:
    """`module.every_route(*args)` under no_build(), then the default configuration again (every_route configures
    the variants it runs) and a device sync: its det bits."""
    every_route = importlib.import_module(module).every_route
    with cake.no_build():
        bits = every_route(*args)
    mek.configure()
    torch.cuda.synchronize()
    return bits


def check_prebuild_here_and_on_a_node(tmp_path, op: str, params: dict, module: str, args: tuple = ()) -> None:
    """`module.every_route(*args)` must launch every route of `op` and return its det bits (name -> CPU tensor)."""
    res = cake.prebuild(op, **params)
    assert len(res.routes) > 0 and cake.prebuild(op, **params) is res
    here = every_route_bits(module, args)
    cake.release(op)
    cache = str(tmp_path / "node-cache")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TRITON_CACHE_DIR=cache)
    got = []
    for name in ("A", "B"):
        bits = str(tmp_path / f"bits{name}.pt")
        script = textwrap.dedent(f"""
            import json, torch
            from miles_ext_kernels import cake
            from tests.cake._prebuild import every_route_bits
            res = cake.prebuild({op!r}, **{params!r})
            torch.save(every_route_bits({module!r}, {args!r}), {bits!r})
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


def over_state_tiles(op: str, calls) -> dict:
    """For gdn and kda: `calls()` (name -> det bits) with the state kernels' wide tiles, then with their narrow tiles
    (configs.NARROW_BELOW 0, then 1 << 30: the tests' 2 docs x 4 heads are narrow under the real threshold), the
    names prefixed "wide/" and "narrow/"; the threshold is restored after."""
    configs = importlib.import_module(f"miles_ext_kernels.cake._impl.{op}.configs")
    narrow_below = configs.NARROW_BELOW
    out = {}
    try:
        for tiles, below in (("wide", 0), ("narrow", 1 << 30)):
            configs.NARROW_BELOW = below
            out.update({f"{tiles}/{k}": v for k, v in calls().items()})
    finally:
        configs.NARROW_BELOW = narrow_below
    return out


def backward_keeping_det_bits(out: dict, key: str, variant: str, o, ht, leaves: dict, inp: dict, final: bool) -> None:
    """The backward of a delta-rule call (from inp["do"], and inp["dht"] where the final state `ht` was asked for);
    under the det variant, o and each leaf's gradient go into `out` (on the CPU) as `key`/o and `key`/d<leaf>."""
    outs, grads = [o], [inp["do"]]
    if final:
        outs.append(ht)
        grads.append(inp["dht"])
    torch.autograd.backward(outs, grads)
    if variant == "det":
        out[key + "/o"] = o.detach().cpu()
        for n, t in leaves.items():
            out[key + "/d" + n] = t.grad.cpu()
