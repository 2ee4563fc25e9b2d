"""rmsnorm through Triton's interpreter on CPU tensors: accuracy vs FP64, layouts, variants, checks, module."""
import importlib

import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels.cake import rmsnorm as decl
from miles_ext_kernels.cake._impl.rmsnorm import configs, ops
from miles_ext_kernels.cake._impl.rmsnorm.reference import grads_ref, zero_centered_rmsnorm_ref
from miles_ext_kernels.cake._runtime.operands import copies
from tests.cake._helpers import assert_demo_passes
from tests.cake._norms import BF, F32, check_within, forward_backward, norm_operands

demo_mod = importlib.import_module("miles_ext_kernels.cake._impl.rmsnorm.demo")

pytestmark = pytest.mark.interpreter


def _inputs(shape, wdtype, seed=0):
    return norm_operands(shape, wdtype, seed, gated=False, weight_mean=0)


def _run(x, w, dy, eps=1e-6):
    return forward_backward(decl.zero_centered_rmsnorm, (x, w), dy, eps, clone=(0, 1) if x.is_contiguous() else (1,))


def _check(x, w, dy, got, eps=1e-6):
    check_within(("y", "dx", "dw"), got, grads_ref(x, w, dy, eps), demo_mod.budgets("cpu", w.dtype, x.numel()))
    y, dx, dw = got
    assert y.dtype == BF and dx.dtype == BF and dw.dtype == w.dtype


@pytest.mark.parametrize("variant", ["det", "fast"])
@pytest.mark.parametrize("shape,wdtype", [((37, 256), F32), ((3, 5, 320), BF), ((1, 2048), F32), ((7, 64), BF)])
def test_accuracy(variant, shape, wdtype):
    mek.configure(rmsnorm_variant=variant)
    x, w, dy = _inputs(shape, wdtype)
    _check(x, w, dy, _run(x, w, dy))


def test_large_window_and_odd_tokens():
    # T > SMALL_T selects the "large" configs; 1025 rows do not fill the last row block
    T = configs.SMALL_T + 1
    assert configs.window_of(T) == "large"
    x, w, dy = _inputs((T, 64), F32, seed=1)
    _check(x, w, dy, _run(x, w, dy))


def test_strided_rows_read_in_place():
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(9, 3 * 128 + 16, generator=g).to(BF)
    x = wide[:, 8:8 + 128]  # row stride 400 (a multiple of 8), 16-byte aligned start
    _, w, dy = _inputs((9, 128), F32, seed=3)
    before = copies(ops.OP)
    got = _run(x, w, dy)
    assert copies(ops.OP) == before  # no copy
    _check(x, w, dy, got)
    x_odd = wide[:, 3:3 + 128]  # misaligned start: copied first
    got = _run(x_odd, w, dy)
    assert copies(ops.OP)["x"] == before.get("x", 0) + 2  # copied once in the forward, once in the backward
    _check(x_odd, w, dy, got)


@pytest.mark.parametrize("programs", [1, 16, 37])
def test_in_launch_weight_gradient_sum(programs):
    # det: the backward's last programs sum the partial rows (per group of GROUP, then the groups) inside the one
    # launch; 37 programs = two full groups and a partial one. The counters must be zero again afterwards.
    from miles_ext_kernels.cake._runtime import reduce as R

    x, w, dy = _inputs((150, 320), F32, seed=8)  # 320 = 256 + 64: the two-tile row
    y = ops.rmsnorm_fwd(x, w, 1e-6)
    dx, dw = ops.rmsnorm_bwd(dy, x, w, 1e-6, programs=programs)
    _check(x, w, dy, (y, dx, dw))
    assert int(R.counters(x).abs().sum()) == 0
    dx2, dw2 = ops.rmsnorm_bwd(dy, x, w, 1e-6, programs=programs)
    assert torch.equal(dx, dx2) and torch.equal(dw, dw2)


@pytest.mark.parametrize("kahan", [True, False])
def test_plain_and_compensated_weight_gradient_sums(kahan):
    # KAHAN=False (the H 5120 table entry: a plain fp32 sum per program) on a two-tile row (320 = 256 + 64), so both
    # column tiles' sums run; the result stays within the budgets and close to the compensated sum
    x, w, dy = _inputs((150, 320), F32, seed=9)
    y = ops.rmsnorm_fwd(x, w, 1e-6)
    dx, dw = ops.rmsnorm_bwd(dy, x, w, 1e-6, cfg=(1, 4, 3, kahan), programs=4)
    _check(x, w, dy, (y, dx, dw))
    dx_k, dw_k = ops.rmsnorm_bwd(dy, x, w, 1e-6, cfg=(1, 4, 3, True), programs=4)
    assert torch.equal(dx, dx_k)
    assert (dw - dw_k).abs().max() <= 1e-5 * dw_k.abs().max()


def test_zero_tokens():
    x, w, dy = _inputs((0, 128), F32)
    y, dx, dw = _run(x, w, dy)
    assert y.shape == (0, 128) and dx.shape == (0, 128)
    assert torch.equal(dw, torch.zeros(128))


@pytest.mark.parametrize("variant", ["det", "fast"])
def test_bits_repeat(variant):
    mek.configure(rmsnorm_variant=variant)
    x, w, dy = _inputs((50, 192), BF, seed=4)
    a, b = _run(x, w, dy), _run(x, w, dy)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_backward_runs_forward_variant(monkeypatch):
    seen = []
    real = ops.RMSNORM.backward

    def spy(dy, x, weight, eps, variant):
        seen.append(variant)
        return real(dy, x, weight, eps, variant)

    monkeypatch.setattr(ops.RMSNORM, "backward", spy)
    x, w, dy = _inputs((4, 64), F32)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    mek.configure(rmsnorm_variant="fast")
    y = decl.zero_centered_rmsnorm(xr, wr)
    mek.configure(rmsnorm_variant="det")
    y.backward(dy)
    y = decl.zero_centered_rmsnorm(xr, wr)
    mek.configure(rmsnorm_variant="fast")
    y.backward(dy)
    assert seen == ["fast", "det"]
    # torch.use_deterministic_algorithms(True) turns fast into det
    mek.configure(rmsnorm_variant="fast")
    torch.use_deterministic_algorithms(True)
    try:
        decl.zero_centered_rmsnorm(xr, wr).backward(dy)
    finally:
        torch.use_deterministic_algorithms(False)
    assert seen[-1] == "det"


def test_bad_inputs_raise_before_launch(monkeypatch):
    monkeypatch.setattr(ops, "_fwd", lambda *a, **k: pytest.fail("launched"))
    x, w, _ = _inputs((4, 128), F32)
    with pytest.raises(TypeError, match="x must be bfloat16"):
        decl.zero_centered_rmsnorm(x.float(), w)
    with pytest.raises(TypeError, match="weight"):
        decl.zero_centered_rmsnorm(x, w.half())
    with pytest.raises(ValueError, match="weight has 64"):
        decl.zero_centered_rmsnorm(x, w[:64])
    with pytest.raises(ValueError, match="^x's last dimension: rmsnorm: hidden_size 100"):
        decl.zero_centered_rmsnorm(torch.randn(2, 100).to(BF), torch.zeros(100))
    with pytest.raises(ValueError, match="^weight is on meta but x is on cpu"):  # meta: another device
        decl.zero_centered_rmsnorm(x, w.to("meta"))
    for bad in (float("inf"), float("nan")):  # eps = inf would silently give y = 0 and zero gradients
        with pytest.raises(ValueError, match="^eps must be a finite float > 0"):
            decl.zero_centered_rmsnorm(x, w, bad)
        with pytest.raises(ValueError, match="^eps must be a finite float > 0"):
            decl.ZeroCenteredRMSNorm(256, eps=bad, device="meta")
    with pytest.raises(ValueError, match="eps"):
        decl.zero_centered_rmsnorm(x, w, -1.0)
    with pytest.raises(TypeError, match="eps"):
        decl.zero_centered_rmsnorm(x, w, "1e-6")
    with pytest.raises(TypeError, match="eps"):
        decl.ZeroCenteredRMSNorm(256, eps="1e-6", device="meta")
    with pytest.raises(ValueError, match="eps"):
        decl.ZeroCenteredRMSNorm(256, eps=0.0, device="meta")
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        decl.zero_centered_rmsnorm([1.0], w)


def test_compile_fullgraph_traces():
    x, w, dy = _inputs((6, 128), F32, seed=5)
    fn = torch.compile(decl.zero_centered_rmsnorm, fullgraph=True, backend="aot_eager")
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    y = fn(xr, wr, 1e-6)
    y.backward(dy)
    _check(x, w, dy, (y.detach(), xr.grad, wr.grad))


def test_module():
    m = decl.ZeroCenteredRMSNorm(256, eps=1e-5, sequence_parallel=True)
    assert isinstance(m, torch.nn.Module) and isinstance(m, decl.ZeroCenteredRMSNorm)
    assert m.weight.dtype == F32 and m.weight.shape == (256,) and torch.equal(m.weight, torch.zeros(256))
    assert m.weight.sequence_parallel is True
    x, _, dy = _inputs((5, 256), F32)
    y = m(x)
    torch.testing.assert_close(y.float(), zero_centered_rmsnorm_ref(x, m.weight.detach(), 1e-5).float(),
                               rtol=1e-2, atol=1e-2)
    y.backward(dy)
    assert m.weight.grad is not None and m.weight.grad.dtype == F32
    # meta: no storage; to_empty + reset_parameters re-zeroes and re-marks
    with torch.device("meta"):
        mm = decl.ZeroCenteredRMSNorm(2048, dtype=BF, sequence_parallel=False)
    assert mm.weight.is_meta and mm.weight.dtype == BF
    mm.to_empty(device="cpu")
    mm.reset_parameters()
    assert torch.equal(mm.weight, torch.zeros(2048, dtype=BF)) and mm.weight.sequence_parallel is False
    assert decl.ZeroCenteredRMSNorm(128, device="meta").weight.is_meta
    # None leaves the caller's mark alone
    m3 = decl.ZeroCenteredRMSNorm(128)
    m3.weight.sequence_parallel = True
    m3.reset_parameters()
    assert m3.weight.sequence_parallel is True
    with pytest.raises(ValueError, match="hidden_size"):
        decl.ZeroCenteredRMSNorm(100)


def test_demo():
    assert_demo_passes(decl.OP, "cpu")


@pytest.mark.parametrize("H", [2048, 5120, 320])
def test_routes_are_the_launchers_launches(H):
    """routes() runs the launchers on meta tensors over both weight dtypes, both token windows and both variants: 6
    distinct specializations (the forward per weight dtype x window, the backward per weight dtype: both windows
    and both variants share it), each recorded from the real launch site."""
    rs = decl.OP.impl().routes(hidden_size=H)
    labels = [r.label for r in rs]
    assert len(labels) == len(set(labels)) == 6
    assert sum(lab.startswith("_rmsnorm_fwd_kernel[") for lab in labels) == 4
    assert sum(lab.startswith("_rmsnorm_bwd_kernel[") for lab in labels) == 2
    assert {r.args["w_ptr"] for r in rs} == {F32, BF}
    with pytest.raises(ValueError):
        decl.OP.impl().routes(hidden_size=100)


def test_no_grad_calls_run_the_forward_alone_and_custom_ops_exist(monkeypatch):
    x, w, _ = _inputs((4, 64), F32)
    monkeypatch.setattr(ops.RMSNORM, "function", None)  # no autograd.Function on this path
    assert decl.zero_centered_rmsnorm(x, w).grad_fn is None
    with torch.no_grad():
        assert decl.zero_centered_rmsnorm(x, w.clone().requires_grad_(True)).grad_fn is None
    assert torch.ops.miles_ext_kernels.rmsnorm_fwd.default is not None
    assert torch.ops.miles_ext_kernels.rmsnorm_bwd.default is not None


def test_module_bad_device_is_a_value_error():
    for bad in ("nope", "cuda:x", -1):  # torch's own RuntimeError for these does not escape
        with pytest.raises(ValueError, match="^device must be"):
            decl.ZeroCenteredRMSNorm(64, device=bad)
    with pytest.raises(TypeError):
        decl.ZeroCenteredRMSNorm(64, device=3.5)
