"""A second derivative through any op raises instead of returning gradients that silently carry no history
(the backward kernels are not differentiable): `.backward()` of a loss built from the op's gradients raises.
(`torch.autograd.grad(loss, inputs)` prunes the error node and still drops the op's part, as for any
`once_differentiable` function.) Interpreter, tiny shapes."""
import pytest
import torch

from miles_ext_kernels.cake import conv1d, gated_rmsnorm, gdn, kda, rmsnorm

pytestmark = pytest.mark.interpreter


def _second_derivative_raises(out, leaves):
    grads = torch.autograd.grad(out.float().square().sum(), leaves, create_graph=True)
    # A gradient penalty plus a differentiable term: without the guard, the op's part of the second derivative would
    # be dropped silently (its gradients carry no history) while the other term still backpropagates.
    penalty = sum(g.float().sum() for g in grads) + sum(x.float().square().sum() for x in leaves)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        penalty.backward()


def _leaf(*shape, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(True)


def test_rmsnorm():
    x, w = _leaf(3, 64), _leaf(64, dtype=torch.float32, seed=1)
    _second_derivative_raises(rmsnorm.zero_centered_rmsnorm(x, w), (x, w))


def test_gated_rmsnorm():
    x, z, w = _leaf(3, 64), _leaf(3, 64, seed=1), _leaf(64, dtype=torch.float32, seed=2)
    _second_derivative_raises(gated_rmsnorm.rmsnorm_silu_gate(x, z, w), (x, z, w))


def test_conv1d():
    x, w = _leaf(5, 16), _leaf(16, 4, dtype=torch.float32, seed=1)
    _second_derivative_raises(conv1d.causal_conv1d(x, w), (x, w))


def test_gdn():
    from miles_ext_kernels.cake._impl.gdn.demo import make_inputs

    inp = make_inputs([5], 1, 1, 16, 16, "cpu", seed=3, h0=False)
    leaves = [inp[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")]
    o, _ = gdn.chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True, cu_seqlens=inp["cu"])
    _second_derivative_raises(o, leaves)


def test_kda():
    from miles_ext_kernels.cake._impl.kda.demo import make_inputs

    inp = make_inputs([5], 1, 1, 16, 16, "cpu", seed=3, h0=False, gate="softplus")
    leaves = [inp[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "A_log", "dt_bias")]
    o, _ = kda.chunk_kda(*leaves[:5], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=leaves[5],
                         dt_bias=leaves[6], cu_seqlens=inp["cu"])
    _second_derivative_raises(o, leaves)


def test_gqa():
    from miles_ext_kernels.cake import gqa

    q, k, v = _leaf(5, 2, 256), _leaf(5, 1, 256, seed=1), _leaf(5, 1, 256, seed=2)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    _second_derivative_raises(gqa.varlen_gqa_attention(q, k, v, cu, cu, max_seqlen_k=5), (q, k, v))


def test_gqa_custom_op():
    """The path torch.compile traces (the registered custom op, called directly here) refuses too."""
    from miles_ext_kernels.cake._impl.gqa import ops

    q, k, v = _leaf(5, 2, 256), _leaf(5, 1, 256, seed=1), _leaf(5, 1, 256, seed=2)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    out, _ = ops.GQA.forward_op(q, k, v, cu, cu, 0.0625, 5, "det")  # the custom op miles_ext_kernels::gqa_fwd
    grads = torch.autograd.grad(out.float().square().sum(), (q, k, v), create_graph=True)
    penalty = sum(g.float().sum() for g in grads) + sum(x.float().square().sum() for x in (q, k, v))
    with pytest.raises(RuntimeError, match="no autograd formula"):  # the backward custom op has none
        penalty.backward()
