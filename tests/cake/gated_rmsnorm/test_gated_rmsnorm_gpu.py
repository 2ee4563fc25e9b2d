"""gated_rmsnorm on the GPU: accuracy vs FP64 at model sizes, z read in place from the fused projection, bits
(repeats, side stream, pool), no host sync."""
import importlib

import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels import cake
from miles_ext_kernels.cake import gated_rmsnorm as decl
from miles_ext_kernels.cake._impl.gated_rmsnorm.reference import grads_ref
from miles_ext_kernels.cake._runtime.operands import copies
from tests.cake._helpers import assert_demo_passes
from tests.cake._norms import BF, F32, check_within, forward_backward, norm_operands

demo_mod = importlib.import_module("miles_ext_kernels.cake._impl.gated_rmsnorm.demo")

pytestmark = pytest.mark.gpu
DIMS = (128, 256)


@pytest.fixture(scope="module", autouse=True)
def _built():
    for d in DIMS:
        cake.prebuild("gated_rmsnorm", head_dim=d)


def inputs(shape, wdtype, seed=0):
    return norm_operands(shape, wdtype, seed, gated=True, weight_mean=1, device="cuda")


def run(x, z, w, dy, eps=1e-6):
    return forward_backward(decl.rmsnorm_silu_gate, (x, z, w), dy, eps, clone=(2,))


def check(x, z, w, dy, got):
    ref = grads_ref(x.cpu(), z.cpu(), w.cpu(), dy.cpu())
    errs = check_within(("y", "dx", "dz", "dw"), got, ref, demo_mod.budgets("cuda", w.dtype, x.numel()))
    print("errors", tuple(x.shape), w.dtype, errs)
    return errs


@pytest.mark.parametrize("variant", ["det", "fast"])
@pytest.mark.parametrize("shape,wdtype", [((2048, 32, 128), F32), ((301, 16, 256), BF), ((1, 1, 128), F32),
                                          ((4097, 128), BF)])
def test_accuracy(variant, shape, wdtype):
    mek.configure(gated_rmsnorm_variant=variant)
    x, z, w, dy = inputs(shape, wdtype, seed=shape[0])
    check(x, z, w, dy, run(x, z, w, dy))


def test_z_from_fused_projection_in_place():
    T, NH, D = 1024, 32, 128
    width = 2 * 16 * D + NH * D + NH * D + 2 * NH  # [q | k | v | z | b | a]
    proj = torch.randn(T, width, device="cuda").to(BF)
    z = proj[:, 2 * 16 * D + NH * D:2 * 16 * D + 2 * NH * D].view(T, NH, D)
    x, _, w, dy = inputs((T, NH, D), F32, seed=7)
    before = copies("gated_rmsnorm")
    got = run(x, z, w, dy)
    assert copies("gated_rmsnorm") == before
    check(x, z, w, dy, got)
    x0, z0, w0, dy0 = inputs((0, NH, D), F32)
    y, dx, dz, dw = run(x0, z0, w0, dy0)
    assert y.shape == (0, NH, D) and torch.equal(dw, torch.zeros_like(w0))


def _bits(*a):
    return [t.clone() for t in run(*a)]


@pytest.mark.parametrize("wdtype", [F32, BF])
def test_det_bits_repeat_side_stream_and_pool(wdtype):
    mek.configure(gated_rmsnorm_variant="det")
    a = inputs((32768, 32, 128), wdtype, seed=3)
    ref = _bits(*a)
    for _ in range(2):
        assert all(torch.equal(u, v) for u, v in zip(ref, _bits(*a)))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        side = _bits(*a)
    torch.cuda.current_stream().wait_stream(s)
    assert all(torch.equal(u, v) for u, v in zip(ref, side))
    mek.configure(gated_rmsnorm_variant="det", workspace_pool_bytes=1 << 26)
    for _ in range(2):
        assert all(torch.equal(u, v) for u, v in zip(ref, _bits(*a)))


def test_fast_runs_the_det_kernels():
    a = inputs((8192, 32, 128), F32, seed=4)
    mek.configure(gated_rmsnorm_variant="det")
    d = _bits(*a)
    mek.configure(gated_rmsnorm_variant="fast")
    f = _bits(*a)
    assert all(torch.equal(u, v) for u, v in zip(d, f))


def test_no_host_sync_in_steady_state():
    a = inputs((4096, 32, 128), BF, seed=5)
    for variant in ("det", "fast"):
        mek.configure(gated_rmsnorm_variant=variant, workspace_pool_bytes=1 << 26)
        run(*a)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            run(*a)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_compile_fullgraph():
    x, z, w, dy = inputs((256, 32, 128), F32, seed=6)
    eager = decl.rmsnorm_silu_gate(x, z, w)
    compiled = torch.compile(decl.rmsnorm_silu_gate, fullgraph=True, backend="aot_eager")(x, z, w)
    assert torch.equal(eager, compiled)


def test_demo():
    assert_demo_passes(decl.OP, "cuda")
