"""The torch.distributed wiring of context parallelism: W gloo ranks (one process each, Triton's interpreter) call
the public entry points with `cake.build_cp_context`, and their outputs and gradients equal, bit for bit, the W
simulated ranks of one process (which tests/cake/<op>/test_<op>_cp_cpu.py holds to the FP64 reference)."""
import pytest
import torch

from tests.cake.cp import _cases

pytestmark = pytest.mark.interpreter

CASES = [("gdn", "contiguous", 2, [100, 60, 0, 32]), ("gdn", "zigzag", 3, [66, 12]),
         ("kda", "contiguous", 3, [150, 0, 30]), ("kda", "zigzag", 2, [64, 8]),
         ("conv1d", "zigzag", 2, [8, 16, 4])]  # conv1d: 1-token pieces, a halo from pieces on both ranks


@pytest.mark.parametrize("op, layout, world, lens", CASES)
def test_gloo_ranks_equal_simulated_ranks(op, layout, world, lens, tmp_path):
    ranks = _cases.spawn_ranks(op, layout, world, lens, tmp_path)
    assert all(r.pop("_repeats") for r in ranks)
    inp = _cases.inputs(op, lens)
    want = _cases.run_simulated(op, inp, layout, world)
    got = _cases.gathered(op, inp, layout, world, ranks)
    assert got.keys() == want.keys()
    for name, ref in want.items():
        assert torch.equal(got[name], ref), name


def test_gloo_rmsnorm_sequence_parallel(tmp_path):
    """The sequence-parallel rmsnorm case of tests/cake/cp/test_cp_nccl_gpu.py over gloo: the all-reduced weight
    gradient is the same on both ranks and within fp32 summation error of the one-process call's; y and dx are its
    rows bit for bit."""
    from miles_ext_kernels import cake
    from miles_ext_kernels.cake._runtime.testing import rel_rms

    T, H = 64, 2048
    ranks = _cases.spawn_ranks("rmsnorm_sp", "contiguous", 2, [T], tmp_path, dims=dict(_cases.TINY, D=H))
    assert torch.equal(ranks[0]["dw"], ranks[1]["dw"])
    inp = _cases.rmsnorm_inputs(T, H)
    x, w = inp["x"].clone().requires_grad_(True), inp["w"].clone().requires_grad_(True)
    y = cake.zero_centered_rmsnorm(x, w)
    y.backward(inp["dy"])
    assert torch.equal(torch.cat([r["y"] for r in ranks]), y.detach())
    assert torch.equal(torch.cat([r["dx"] for r in ranks]), x.grad)
    assert rel_rms(ranks[0]["dw"].double(), w.grad.double()) < 1e-5
