"""gated_rmsnorm through Triton's interpreter on CPU tensors: accuracy vs FP64, layouts, variants, checks."""
import importlib

import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels.cake import gated_rmsnorm as decl
from miles_ext_kernels.cake._impl.gated_rmsnorm import configs, ops
from miles_ext_kernels.cake._impl.gated_rmsnorm.reference import grads_ref
from miles_ext_kernels.cake._runtime.operands import copies
from tests.cake._helpers import assert_demo_passes
from tests.cake._norms import BF, F32, check_within, forward_backward, norm_operands

demo_mod = importlib.import_module("miles_ext_kernels.cake._impl.gated_rmsnorm.demo")

pytestmark = pytest.mark.interpreter


def _inputs(shape, wdtype, seed=0):
    return norm_operands(shape, wdtype, seed, gated=True, weight_mean=1)


def _run(x, z, w, dy, eps=1e-6):
    return forward_backward(decl.rmsnorm_silu_gate, (x, z, w), dy, eps, clone=(2,))


def _check(x, z, w, dy, got, eps=1e-6):
    check_within(("y", "dx", "dz", "dw"), got, grads_ref(x, z, w, dy, eps), demo_mod.budgets("cpu", w.dtype, x.numel()))
    assert got[0].dtype == BF and got[3].dtype == w.dtype and got[0].shape == x.shape


@pytest.mark.parametrize("variant", ["det", "fast"])
@pytest.mark.parametrize("shape,wdtype", [((7, 4, 128), F32), ((13, 64), BF), ((3, 2, 256), F32), ((1, 1, 64), BF)])
def test_accuracy(variant, shape, wdtype):
    mek.configure(gated_rmsnorm_variant=variant)
    x, z, w, dy = _inputs(shape, wdtype)
    _check(x, z, w, dy, _run(x.clone(), z.clone(), w, dy))


def test_large_window_and_odd_rows():
    N = configs.SMALL_N + 1
    assert configs.window_of(N) == "large"
    x, z, w, dy = _inputs((N, 64), F32, seed=1)
    _check(x, z, w, dy, _run(x.clone(), z.clone(), w, dy))


def test_z_column_slice_read_in_place():
    # z is the z-block of a fused [q | k | v | z | b | a] projection: token stride = projection width
    T, NH, D = 9, 4, 128
    g = torch.Generator().manual_seed(2)
    width = 3 * NH * D + NH * D + 2 * NH
    proj = torch.randn(T, width, generator=g).to(BF)
    z = proj[:, 3 * NH * D:4 * NH * D].view(T, NH, D)
    assert not z.is_contiguous() and z.stride(0) == width
    x, _, w, dy = _inputs((T, NH, D), F32, seed=3)
    before = copies(ops.OP)
    got = _run(x, z, w, dy)
    assert copies(ops.OP) == before  # z was read in place, in the forward and in the backward
    _check(x, z, w, dy, got)
    assert got[2].shape == z.shape and got[2].is_contiguous()
    # a token stride that is not a multiple of 8 elements: copied
    proj2 = torch.randn(T, NH * D + 4, generator=g).to(BF)
    z2 = proj2[:, :NH * D].view(T, NH, D)
    got = _run(x, z2, w, dy)
    assert copies(ops.OP)["z"] == before.get("z", 0) + 2  # once in the forward, once in the backward
    _check(x, z2, w, dy, got)


def test_head_strided_x_read_in_place():
    # x as [T, NH, D] with a head stride that is not D (heads interleaved with other data)
    T, NH, D = 5, 3, 64
    base = torch.randn(T, NH, 2 * D).to(BF)
    x = base[:, :, :D]
    _, z, w, dy = _inputs((T, NH, D), BF, seed=4)
    before = copies(ops.OP)
    got = _run(x, z, w, dy)
    assert copies(ops.OP) == before
    _check(x, z, w, dy, got)


@pytest.mark.parametrize("programs", [1, 5])
def test_launchers_with_overrides(programs):
    # the benchmark entry points: checked launchers outside autograd, the program count overridden; the partial
    # rows are summed in a fixed order whatever their number
    x, z, w, dy = _inputs((11, 3, 64), F32, seed=8)
    y = ops.gated_fwd(x, z, w, 1e-6)
    dx, dz, dw = ops.gated_bwd(dy, x, z, w, 1e-6, programs=programs)
    _check(x, z, w, dy, (y, dx, dz, dw))
    again = ops.gated_bwd(dy, x, z, w, 1e-6, programs=programs)
    assert all(torch.equal(a, b) for a, b in zip((dx, dz, dw), again))


def test_zero_rows():
    x, z, w, dy = _inputs((0, 4, 128), F32)
    y, dx, dz, dw = _run(x, z, w, dy)
    assert y.shape == (0, 4, 128) and dz.shape == (0, 4, 128) and torch.equal(dw, torch.zeros(128))


@pytest.mark.parametrize("variant", ["det", "fast"])
def test_bits_repeat(variant):
    mek.configure(gated_rmsnorm_variant=variant)
    x, z, w, dy = _inputs((40, 3, 64), BF, seed=5)
    a, b = _run(x, z, w, dy), _run(x, z, w, dy)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_backward_runs_forward_variant(monkeypatch):
    seen = []
    real = ops.GATED.backward

    def spy(dy, x, z, weight, eps, variant):
        seen.append(variant)
        return real(dy, x, z, weight, eps, variant)

    monkeypatch.setattr(ops.GATED, "backward", spy)
    x, z, w, dy = _inputs((4, 2, 64), F32)
    xr, zr, wr = (t.clone().requires_grad_(True) for t in (x, z, w))
    mek.configure(gated_rmsnorm_variant="fast")
    y = decl.rmsnorm_silu_gate(xr, zr, wr)
    mek.configure(gated_rmsnorm_variant="det")
    y.backward(dy)
    mek.configure(gated_rmsnorm_variant="fast")
    torch.use_deterministic_algorithms(True)
    try:
        decl.rmsnorm_silu_gate(xr, zr, wr).backward(dy)
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen == ["fast", "det"]


def test_bad_inputs_raise_before_launch(monkeypatch):
    monkeypatch.setattr(ops, "_fwd", lambda *a, **k: pytest.fail("launched"))
    x, z, w, _ = _inputs((4, 2, 128), F32)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        decl.rmsnorm_silu_gate(x.float(), z, w)
    with pytest.raises(TypeError, match="z must be bfloat16"):
        decl.rmsnorm_silu_gate(x, z.half(), w)
    with pytest.raises(ValueError, match="z has shape"):
        decl.rmsnorm_silu_gate(x, z[:2], w)
    with pytest.raises(ValueError, match="weight has 64"):
        decl.rmsnorm_silu_gate(x, z, w[:64])
    with pytest.raises(ValueError, match="^x's last dimension: gated_rmsnorm: head_dim 96"):
        decl.rmsnorm_silu_gate(x[..., :96], z[..., :96], w[:96])
    with pytest.raises(ValueError, match="x must be"):
        decl.rmsnorm_silu_gate(x[0, 0], z[0, 0], w)
    with pytest.raises(ValueError, match="eps"):
        decl.rmsnorm_silu_gate(x, z, w, 0.0)
    for bad in (float("inf"), float("nan")):  # eps = inf would silently give y = 0 and zero gradients
        with pytest.raises(ValueError, match="^eps must be a finite float > 0"):
            decl.rmsnorm_silu_gate(x, z, w, bad)
    with pytest.raises(ValueError, match="^z is on meta but x is on cpu"):  # meta: another device
        decl.rmsnorm_silu_gate(x, z.to("meta"), w)
    with pytest.raises(ValueError, match="^weight is on meta but x is on cpu"):
        decl.rmsnorm_silu_gate(x, z, w.to("meta"))


def test_compile_fullgraph_traces():
    x, z, w, dy = _inputs((6, 2, 64), F32, seed=6)
    fn = torch.compile(decl.rmsnorm_silu_gate, fullgraph=True, backend="aot_eager")
    xr, zr, wr = (t.clone().requires_grad_(True) for t in (x, z, w))
    y = fn(xr, zr, wr, 1e-6)
    y.backward(dy)
    _check(x, z, w, dy, (y.detach(), xr.grad, zr.grad, wr.grad))


def test_demo():
    assert_demo_passes(decl.OP, "cpu")


@pytest.mark.parametrize("D", [64, 128, 256])
def test_routes_are_the_launchers_launches(D):
    """routes() runs the launchers on meta tensors over both weight dtypes, both row windows and both variants: 8
    distinct specializations (the forward per weight dtype x window, the backward per weight dtype, the fixed-order
    sum of the partial rows per weight dtype), each recorded from the real launch site."""
    rs = decl.OP.impl().routes(head_dim=D)
    labels = [r.label for r in rs]
    assert len(labels) == len(set(labels)) == 8
    assert sum(lab.startswith("_gated_fwd_kernel[") for lab in labels) == 4
    assert sum(lab.startswith("_gated_bwd_kernel[") for lab in labels) == 2
    assert {r.args["out_ptr"] for r in rs if r.label.startswith("_reduce_columns_kernel[")} == {F32, BF}
    with pytest.raises(ValueError):
        decl.OP.impl().routes(head_dim=96)


def test_no_grad_calls_run_the_forward_alone_and_custom_ops_exist(monkeypatch):
    x, z, w, _ = _inputs((4, 2, 64), F32)
    monkeypatch.setattr(ops.GATED, "function", None)  # no autograd.Function on this path
    assert decl.rmsnorm_silu_gate(x, z, w).grad_fn is None
    with torch.no_grad():
        assert decl.rmsnorm_silu_gate(x, z, w.clone().requires_grad_(True)).grad_fn is None
    assert torch.ops.miles_ext_kernels.gated_rmsnorm_fwd.default is not None
    assert torch.ops.miles_ext_kernels.gated_rmsnorm_bwd.default is not None
