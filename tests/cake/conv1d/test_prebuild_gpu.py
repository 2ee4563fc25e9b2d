"""One prebuild, then every route of conv1d (both variants, both options, W 2..4, with and without cu_seqlens,
aligned and unaligned, with and without an initial state) runs under no_build(): in this process and in a fresh
process sharing the cache."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests._paths import ROOT

pytestmark = pytest.mark.gpu

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    import miles_ext_kernels as mek
    from miles_ext_kernels import cake
    from miles_ext_kernels.cake import conv1d
    from miles_ext_kernels.cake._impl.conv1d.reference import causal_conv1d_ref_shift
    from miles_ext_kernels.cake._runtime.testing import rel_rms

    wname = sys.argv[1]
    wdt = getattr(torch, wname)
    res = cake.prebuild("conv1d", weight_dtype=wname)
    assert cake.prebuild("conv1d", weight_dtype=wname) is res
    g = torch.Generator(device="cuda").manual_seed(0)
    worst = {}
    calls = 0
    with cake.no_build():
        for D in (512, 300):  # aligned route / unaligned route (D % 8 != 0)
            x = torch.randn(700, D, device="cuda", generator=g).to(torch.bfloat16)
            dy = torch.randn(700, D, device="cuda", generator=g).to(torch.bfloat16)
            for W in (2, 3, 4):
                w = (torch.randn(D, W, device="cuda", generator=g) * 0.5).to(wdt)
                for cu in (None, *(torch.tensor([0, 1, 5, 400, 700], dtype=dt, device="cuda")
                                   for dt in (torch.int32, torch.int64))):
                    N = 1 if cu is None else 4
                    halo = torch.randn(N, D, W, device="cuda", generator=g).to(torch.bfloat16)
                    for h in (None, halo):
                        for act in ("silu", None):
                            for variant in ("det", "fast"):
                                for opt in (("bf16", "fp32") if act else ("bf16",)):
                                    mek.configure(conv1d_variant=variant, conv1d_silu_grad_preactivation=opt)
                                    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
                                    hr = None if h is None else h.clone().requires_grad_(True)
                                    y = conv1d.causal_conv1d(xr, wr, cu_seqlens=cu, activation=act, initial_state=hr)
                                    grads = torch.autograd.grad(y, (xr, wr) if hr is None else (xr, wr, hr), dy)
                                    ref = causal_conv1d_ref_shift(x, w, dy, cu, act,
                                                                  round_preactivation=opt == "bf16", initial_state=h)
                                    for name, got, r in zip(("y", "dx", "dw", "dh"), (y, *grads), ref):
                                        worst[name] = max(worst.get(name, 0.0), rel_rms(got, r))
                                    calls += 1
    mek.configure()
    print(json.dumps({"routes": len(res.routes), "generated": res.generated, "calls": calls, "worst": worst}))
""")


@pytest.mark.parametrize("wname", ["bfloat16", "float32"])
def test_prebuild_every_route_no_build_two_processes(wname, tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               TRITON_CACHE_DIR=str(tmp_path / "node-cache"))
    got = []
    for _ in range(2):  # process A prebuilds into an empty cache; process B starts from the cache
        out = subprocess.run([sys.executable, "-c", SCRIPT, wname], env=env, cwd=ROOT, capture_output=True,
                             text=True, timeout=500)
        assert out.returncode == 0, out.stderr[-4000:]
        got.append(json.loads(out.stdout.strip().splitlines()[-1]))
    a, b = got
    # W x cu_seqlens (none, int32, int64) x alignment x initial state or not x (2 forward + 3 backward)
    # + 3 dw reductions
    assert a["routes"] == b["routes"] == 3 * 3 * 2 * 2 * (2 + 3) + 3
    assert a["generated"] == a["routes"] and b["generated"] == 0
    # D x W x cu_seqlens x initial state or not x (SiLU: 2 variants x 2 options; none: 2 variants)
    assert a["calls"] == b["calls"] == 2 * 3 * 3 * 2 * (2 * 2 + 2)
    dw_budget = 1e-4 if wname == "float32" else 5e-3
    for r in got:
        assert r["worst"]["y"] < 4e-3 and r["worst"]["dx"] < 4e-3 and r["worst"]["dw"] < dw_budget, r
        assert r["worst"]["dh"] < 4e-3, r
