"""GPU to GPU: the det variant of every op gives the same bits on cuda:0 and cuda:1 (inputs made once on the host,
copied to each device; the call on cuda:1 runs while cuda:0 is the current device). gqa has its own two-GPU test
(tests/cake/gqa/test_gqa_gpu.py::test_det_bits_two_gpus)."""
import pytest
import torch

import miles_ext_kernels as mek
from miles_ext_kernels.cake import conv1d, gated_rmsnorm, gdn, kda, rmsnorm

pytestmark = pytest.mark.multi_gpu


@pytest.fixture(autouse=True)
def _det():
    mek.configure(rmsnorm_variant="det", gated_rmsnorm_variant="det", conv1d_variant="det", gdn_variant="det",
                  kda_variant="det")


def _on(dev, tensors):
    return [t.to(dev).requires_grad_(t.is_floating_point()) for t in tensors]


def _grads(out, leaves, grad_out):
    outs = out if isinstance(out, (tuple, list)) else (out,)
    grads = torch.autograd.grad(outs, [x for x in leaves if x.requires_grad], grad_out)
    return [o.detach().cpu() for o in outs] + [g.cpu() for g in grads]


def _same_bits(fn):
    assert torch.cuda.current_device() == 0
    a, b = fn("cuda:0"), fn("cuda:1")
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert torch.equal(x, y), f"tensor {i} differs between cuda:0 and cuda:1"


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def test_rmsnorm_two_gpus():
    g = _gen(1)
    x, w, dy = torch.randn(4099, 2048, generator=g).bfloat16(), torch.randn(2048, generator=g) * 0.1, \
        torch.randn(4099, 2048, generator=g).bfloat16()

    def run(dev):
        xd, wd = _on(dev, [x, w])
        return _grads(rmsnorm.zero_centered_rmsnorm(xd, wd), [xd, wd], [dy.to(dev)])
    _same_bits(run)


def test_gated_rmsnorm_two_gpus():
    g = _gen(2)
    x, z = torch.randn(2051, 32, 128, generator=g).bfloat16(), torch.randn(2051, 32, 128, generator=g).bfloat16()
    w, dy = 1 + 0.1 * torch.randn(128, generator=g), torch.randn(2051, 32, 128, generator=g).bfloat16()

    def run(dev):
        xd, zd, wd = _on(dev, [x, z, w])
        return _grads(gated_rmsnorm.rmsnorm_silu_gate(xd, zd, wd), [xd, zd, wd], [dy.to(dev)])
    _same_bits(run)


def test_conv1d_two_gpus():
    g = _gen(3)
    x, w = torch.randn(8192, 1024, generator=g).bfloat16(), 0.5 * torch.randn(1024, 4, generator=g)
    dy, cu = torch.randn(8192, 1024, generator=g).bfloat16(), torch.tensor([0, 3, 100, 4096, 8192], dtype=torch.int32)

    def run(dev):
        xd, wd = _on(dev, [x, w])
        return _grads(conv1d.causal_conv1d(xd, wd, cu_seqlens=cu.to(dev)), [xd, wd], [dy.to(dev)])
    _same_bits(run)


def test_gdn_two_gpus():
    from miles_ext_kernels.cake._impl.gdn.demo import make_inputs

    inp = make_inputs([15, 100, 300, 1200], 2, 4, 128, 128, "cpu", seed=4)

    def run(dev):
        q, k, v, g, beta, h0 = _on(dev, [inp[n] for n in ("q", "k", "v", "g", "beta", "h0")])
        o, ht = gdn.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                           use_qk_l2norm_in_kernel=True, cu_seqlens=inp["cu"].to(dev))
        return _grads((o, ht), [q, k, v, g, beta, h0], [inp["do"].to(dev), inp["dht"].to(dev)])
    _same_bits(run)


def test_kda_two_gpus():
    from miles_ext_kernels.cake._impl.kda.demo import make_inputs

    inp = make_inputs([15, 100, 300, 1200], 2, 4, 128, 128, "cpu", seed=5, gate="safe")
    names = ("q", "k", "v", "g", "beta", "A_log", "dt_bias", "h0")

    def run(dev):
        q, k, v, g, beta, A_log, dt_bias, h0 = _on(dev, [inp[n] for n in names])
        o, ht = kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                              use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                              safe_gate=True, lower_bound=inp["lower_bound"], cu_seqlens=inp["cu"].to(dev))
        return _grads((o, ht), [q, k, v, g, beta, A_log, dt_bias, h0], [inp["do"].to(dev), inp["dht"].to(dev)])
    _same_bits(run)
