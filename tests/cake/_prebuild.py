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

from miles_ext_kernels import cake
from tests._paths import ROOT


def check_prebuild_here_and_on_a_node(tmp_path, op: str, params: dict, module: str, args: tuple = ()) -> None:
    """`module.every_route(*args)` must launch every route of `op` and return its det bits (name -> CPU tensor)."""
    every_route = importlib.import_module(module).every_route
    res = cake.prebuild(op, **params)
    assert len(res.routes) > 0 and cake.prebuild(op, **params) is res
    with cake.no_build():
        here = every_route(*args)
    cake.release(op)
    cache = str(tmp_path / "node-cache")
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), TRITON_CACHE_DIR=cache)
    got = []
    for name in ("A", "B"):
        bits = str(tmp_path / f"bits{name}.pt")
        script = textwrap.dedent(f"""
            import json, torch
            from miles_ext_kernels import cake
            from {module} import every_route
            res = cake.prebuild({op!r}, **{params!r})
            with cake.no_build():
                torch.save(every_route(*{args!r}), {bits!r})
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
