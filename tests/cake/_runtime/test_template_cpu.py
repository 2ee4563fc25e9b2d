"""The op template's runtime blocks on synthetic ops: launches described once (routes recorded from the launchers
themselves), the autograd / custom-op helper, operand preparation."""
import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels.cake._runtime.autograd import KernelOp
from miles_ext_kernels.cake._runtime.launch import arch_of, collect_routes, launch
from miles_ext_kernels.cake._runtime.operands import COPIES, copies, operand
from tests.cake._runtime import _synthetic as syn
from tests.cake._runtime._ops import SYNTHETIC

pytestmark = pytest.mark.registered_ops(SYNTHETIC)


@pytest.mark.interpreter
def test_launch_runs_outside_collect_and_records_inside():
    x = torch.arange(10, dtype=torch.float32)
    y = torch.zeros(10)
    launch(syn._scale_kernel, (1,), x_ptr=x, y_ptr=y, n=10, m=3, BLOCK=16, num_warps=1)
    assert torch.equal(y, 2 * x)
    y.zero_()
    with collect_routes("sm_90a") as rs:
        for n, m in ((10, 3), (70, 5), (10, 32), (10, 48), (10, 1), (2 ** 40, 3)):
            launch(syn._scale_kernel, (1,), x_ptr=x, y_ptr=y, n=n, m=m, BLOCK=16, num_warps=1)
        launch(syn._scale_kernel, (1,), x_ptr=x.double(), y_ptr=y, n=10, m=3, BLOCK=16, num_warps=1)
        launch(syn._scale_kernel, (1,), x_ptr=x, y_ptr=y, n=10, m=3, BLOCK=32, num_warps=1)
    assert not y.any()  # recorded, not run
    # n is not specialized (one route for 10 and 70, another for a 64-bit n); m by class: 3/5, 32/48, 1
    assert len(rs.routes) == 6
    labels = [r.label for r in rs.routes]
    assert len(set(labels)) == 6 and labels[0] == "_scale_kernel[BLOCK=16,num_warps=1]"
    assert rs.routes[0].args["x_ptr"] is torch.float32 and rs.routes[0].args["n"] == 10
    with pytest.raises(TypeError, match="unknown launch arguments"), collect_routes("sm_90a"):
        launch(syn._scale_kernel, (1,), x_ptr=x, y_ptr=y, n=10, m=3, BLOCK=16, nope=1)


def test_arch_of_meta_tensors_only_while_collecting():
    meta = torch.empty(4, device="meta")
    with collect_routes("sm_90a"):
        assert arch_of(meta, "x") == "sm_90a"
    with pytest.raises(ValueError, match="^x is a meta tensor"):
        arch_of(meta, "x")


MUL = KernelOp("synthetic", forward=syn._mul_forward, forward_fake=syn._mul_forward_fake, setup=syn._mul_setup,
               backward=syn._mul_backward, backward_fake=syn._mul_backward_fake, grad_inputs=(0, 1), n_outputs=2,
               non_differentiable=(1,))


def _grads(fn):
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    y, code = fn(x, w)
    y.backward(torch.ones_like(y))
    return y.detach(), code, x.grad, w.grad, x.detach(), w.detach()


def _check_mul(y, dx, dw, x, w, scale):
    assert torch.allclose(y, x * w * scale) and torch.allclose(dx, w.expand_as(x) * scale)
    assert torch.allclose(dw, x.sum(0) * scale)


def test_kernel_op_eager_compiled_and_no_grad_agree():
    mek.configure(synthetic_variant="fast")
    y, code, dx, dw, x, w = _grads(lambda x, w: MUL(x, w, 0.5))
    assert code.item() == 2.0 and not code.requires_grad  # the configured variant reached the launcher
    _check_mul(y, dx, dw, x, w, 0.5)
    compiled = torch.compile(lambda x, w: MUL(x, w, 0.5), fullgraph=True, backend="aot_eager")
    y2, code2, dx2, dw2, x2, w2 = _grads(compiled)
    assert code2.item() == 2.0
    _check_mul(y2, dx2, dw2, x2, w2, 0.5)
    with torch.no_grad():
        y3, code3 = MUL(x, w, 0.5)
    assert y3.grad_fn is None and torch.equal(y3, x * w * 0.5)
    mek.configure()
    assert MUL(x, w, 1.0)[1].item() == 1.0
    assert torch.ops.miles_ext_kernels.synthetic_fwd.default is not None  # the custom ops exist under one name
    assert torch.ops.miles_ext_kernels.synthetic_bwd.default is not None


def test_kernel_op_second_derivative_raises():
    x = torch.randn(3, 4, requires_grad=True)
    w = torch.randn(4, requires_grad=True)
    y, _ = MUL(x, w, 1.0)
    grads = torch.autograd.grad(y.square().sum(), (x, w), create_graph=True)
    penalty = sum(g.sum() for g in grads) + x.square().sum()
    with pytest.raises(RuntimeError, match="once_differentiable"):
        penalty.backward()


def test_operand_in_place_or_counted_copy():
    base = torch.randn(8, 48)
    COPIES.clear()
    assert operand(base, "op", "x") is base
    cols = base[:, 16:32]  # a column slice: row stride 48, 16-element aligned start
    assert operand(cols, "op", "x", stride_multiple=16).data_ptr() == cols.data_ptr()
    assert operand(cols, "op", "x", stride_multiple=32).is_contiguous() and copies("op") == {"x": 1}
    assert operand(cols, "op", "x", contiguous=True).is_contiguous() and copies("op") == {"x": 2}
    odd = base.view(-1)[1:97]  # a 4-byte offset: not 16-byte aligned
    assert operand(odd, "op", "y").data_ptr() % 16 == 0 and copies("op")["y"] == 1
    v = operand(base, "op", "z", view=(-1, 8, 6))
    assert v.shape == (8, 8, 6) and v.data_ptr() == base.data_ptr()
    assert operand(base.t(), "op", "z", view=(-1, 6)).shape == (64, 6)  # not viewable: copied in that shape
    assert operand(base, "op", "w", fits=lambda t: False) is not base and copies("op")["w"] == 1
