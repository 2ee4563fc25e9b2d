"""prebuild / no_build with a tiny real Triton kernel on the GPU (synthetic op), in-process and in a fresh process."""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels import cake
from miles_ext_kernels.cake._runtime import build, registry
from tests._paths import ROOT
from tests.cake._runtime._ops import SYNTHETIC

pytestmark = pytest.mark.gpu


@pytest.fixture
def op(tmp_path, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton-cache"))
    with registry.registered(SYNTHETIC):
        yield SYNTHETIC
    cake.release()


def test_device_arch_served():
    assert cake.device_arch() == "sm_90a"
    assert cake.device_arch("cuda:0") == "sm_90a"
    assert build.check_device(torch.zeros(1, device="cuda"), "x") == "sm_90a"
    with pytest.raises(NotImplementedError, match="x is on a sm_90a GPU"):
        build.check_device(torch.zeros(1, device="cuda"), "x", archs=("sm_100a",))


def test_prebuild_then_no_build(op):
    res = cake.prebuild("synthetic", width=4096)
    assert res.routes == ("axpb[det]", "axpb[fast]") and res.arch == "sm_90a"
    assert res.generated == 2  # fresh cache directory: both routes were generated now
    assert cake.prebuild("synthetic", width=4096) is res  # remembered: a no-op
    assert build.prebuilt("synthetic") == [res]
    x = torch.randn(100_003, device="cuda")
    with cake.no_build():
        for v in ("det", "fast"):
            mek.configure(synthetic_variant=v)
            torch.testing.assert_close(op.impl().axpb(x, 0.25), x * 0.25 + 1)
            torch.testing.assert_close(op.impl().axpb(x[:77], 3.0), x[:77] * 3 + 1)  # other sizes: same route
        # a specialization no route declares (float16 pointers) must raise, naming the kernel
        with pytest.raises(RuntimeError, match=r"no_build\(\).*_axpb_kernel.*fp16"):
            op.impl().axpb(torch.randn(64, device="cuda", dtype=torch.float16), 1.0)
    mek.configure()
    cake.release("synthetic")
    assert build.prebuilt("synthetic") == []


def test_fresh_process_shares_the_cache(op, tmp_path):
    """A node prebuilds once (process A); every rank then starts without compiling (process B, same cache dir)."""
    script = textwrap.dedent("""
        import json, sys, torch
        import miles_ext_kernels as mek
        from miles_ext_kernels import cake
        from miles_ext_kernels.cake._runtime import registry
        from tests.cake._runtime._ops import SYNTHETIC
        with registry.registered(SYNTHETIC):
            res = cake.prebuild("synthetic", width=4096)
            x = torch.randn(5000, device="cuda")
            with cake.no_build():
                for v in ("det", "fast"):
                    mek.configure(synthetic_variant=v)
                    y = SYNTHETIC.impl().axpb(x, 2.0)
            ok = bool(torch.allclose(y, 2 * x + 1))
        print(json.dumps({"generated": res.generated, "routes": len(res.routes), "ok": ok}))
    """)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TRITON_CACHE_DIR=str(tmp_path / "node-cache"))
    got = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        got.append(json.loads(out.stdout.strip().splitlines()[-1]))
    assert got[0] == {"generated": 2, "routes": 2, "ok": True}  # process A compiled both routes
    assert got[1] == {"generated": 0, "routes": 2, "ok": True}  # process B loaded both from the disk cache
