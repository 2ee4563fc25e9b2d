"""rmsnorm on the GPU: accuracy vs FP64 at model sizes, layouts, bits (repeats, side stream, pool), no host sync."""
import importlib

import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels import cake
from miles_ext_kernels.cake import rmsnorm as decl
from miles_ext_kernels.cake._impl.rmsnorm.reference import grads_ref
from miles_ext_kernels.cake._runtime.operands import copies
from tests.cake._helpers import assert_demo_passes
from tests.cake._norms import BF, F32, check_within, forward_backward, norm_operands

demo_mod = importlib.import_module("miles_ext_kernels.cake._impl.rmsnorm.demo")

pytestmark = pytest.mark.gpu
SIZES = (2048, 5120)


@pytest.fixture(scope="module", autouse=True)
def _built():
    for h in SIZES:  # compile every route once, in parallel (the tests then load them)
        cake.prebuild("rmsnorm", hidden_size=h)


def inputs(shape, wdtype, seed=0, device="cuda"):
    return norm_operands(shape, wdtype, seed, gated=False, weight_mean=0, device=device)


def run(x, w, dy, eps=1e-6):
    return forward_backward(decl.zero_centered_rmsnorm, (x, w), dy, eps, clone=(1,))


def check(x, w, dy, got):
    ref = grads_ref(x.cpu(), w.cpu(), dy.cpu())
    errs = check_within(("y", "dx", "dw"), got, ref, demo_mod.budgets("cuda", w.dtype, x.numel()))
    print("errors", tuple(x.shape), w.dtype, errs)
    return errs


@pytest.mark.parametrize("variant", ["det", "fast"])
@pytest.mark.parametrize("H", SIZES)
@pytest.mark.parametrize("T,wdtype", [(4096, F32), (300, BF), (1, F32)])
def test_accuracy(variant, H, T, wdtype):
    mek.configure(rmsnorm_variant=variant)
    x, w, dy = inputs((T, H), wdtype, seed=T + H)
    check(x, w, dy, run(x, w, dy))


def test_layouts_and_zero_tokens():
    x, w, dy = inputs((2, 700, 2048), F32, seed=1)
    check(x, w, dy, run(x, w, dy))
    wide = torch.randn(333, 3 * 2048 + 64, device="cuda").to(BF)
    xs = wide[:, 64:64 + 2048]
    before = copies("rmsnorm")
    _, w, dy = inputs((333, 2048), F32, seed=2)
    got = run(xs, w, dy)
    assert copies("rmsnorm") == before
    check(xs, w, dy, got)
    x0, w0, dy0 = inputs((0, 2048), F32)
    y, dx, dw = run(x0, w0, dy0)
    assert y.shape == (0, 2048) and torch.equal(dw, torch.zeros_like(w0))


def _bits(x, w, dy):
    return [t.clone() for t in run(x, w, dy)]


@pytest.mark.parametrize("wdtype", [F32, BF])
def test_det_bits_repeat_side_stream_and_pool(wdtype):
    mek.configure(rmsnorm_variant="det")
    x, w, dy = inputs((32768, 2048), wdtype, seed=3)
    ref = _bits(x, w, dy)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(ref, _bits(x, w, dy)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        side = _bits(x, w, dy)
    torch.cuda.current_stream().wait_stream(s)
    assert all(torch.equal(a, b) for a, b in zip(ref, side))
    mek.configure(rmsnorm_variant="det", workspace_pool_bytes=1 << 26)
    for _ in range(2):
        assert all(torch.equal(a, b) for a, b in zip(ref, _bits(x, w, dy)))


def test_fast_runs_the_det_kernels():
    x, w, dy = inputs((32768, 5120), F32, seed=4)
    mek.configure(rmsnorm_variant="det")
    d = _bits(x, w, dy)
    mek.configure(rmsnorm_variant="fast")
    f = _bits(x, w, dy)
    assert all(torch.equal(a, b) for a, b in zip(d, f))


def test_no_host_sync_in_steady_state():
    x, w, dy = inputs((4096, 5120), BF, seed=5)
    for variant in ("det", "fast"):
        mek.configure(rmsnorm_variant=variant, workspace_pool_bytes=1 << 26)
        run(x, w, dy)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run(x, w, dy)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_compile_fullgraph_and_module():
    m = decl.ZeroCenteredRMSNorm(2048)
    assert m.weight.device.type == "cuda"
    x, w, dy = inputs((512, 2048), F32, seed=6)
    with torch.no_grad():
        m.weight.copy_(w)
    eager = m(x)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(eager, compiled)


def test_demo():
    assert_demo_passes(decl.OP, "cuda")


def test_cuda_graph_capture_replays_the_same_bits():
    mek.configure(rmsnorm_variant="det")
    x, w, dy = inputs((4096, 2048), F32, seed=8)
    ref = _bits(x, w, dy)
    xr = x.detach().clone().requires_grad_(True)
    wr = w.detach().clone().requires_grad_(True)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up on the capture stream (its counters, the launch caches)
        decl.zero_centered_rmsnorm(xr, wr).backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    xr.grad = wr.grad = None
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = decl.zero_centered_rmsnorm(xr, wr)
        gx, gw = torch.autograd.grad(y, (xr, wr), dy)
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, ref[0]) and torch.equal(gx, ref[1]) and torch.equal(gw, ref[2])
