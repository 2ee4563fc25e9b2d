"""Context parallelism over NCCL, one GPU per rank (W = 2, and 4 where four GPUs are visible): the public entry
points with `cake.build_cp_context` on a real process group give, bit for bit, the W simulated ranks of one process
on cuda:0 (which tests/cake/cp/test_cp_gpu.py holds to the FP64 reference within the one-GPU budgets), and each
rank's second call repeats its first. gdn, kda and conv1d, both layouts, at the models' head dims. Also rmsnorm
under sequence parallelism: the all-reduced weight gradient is the same on every rank and within the one-GPU
call's error of it."""
import pytest
import torch

from tests.cake.cp import _cases

pytestmark = pytest.mark.multi_gpu

DIMS = {"H": 4, "HV": 8, "K": 128, "V": 128, "D": 1024, "Wc": 4}
LENS = [15, 100, 300, 1200, 64, 1, 2416]  # 4096 tokens: boundaries inside documents for W = 2 and 4
ZIGZAG_LENS = [1024, 2048, 512, 512]      # multiples of 2W for W <= 4
CASES = [(op, layout, W) for op in ("gdn", "kda", "conv1d") for layout in ("contiguous", "zigzag") for W in (2, 4)]


@pytest.mark.parametrize("op, layout, world", CASES)
def test_nccl_ranks_equal_simulated_ranks(op, layout, world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    lens = ZIGZAG_LENS if layout == "zigzag" else LENS
    ranks = _cases.spawn_ranks(op, layout, world, lens, tmp_path, backend="nccl", dims=DIMS)
    assert all(r.pop("_repeats") for r in ranks), "a rank's second call gave other bits"
    inp = _cases.inputs(op, lens, DIMS, "cuda:0")
    want = _cases.run_simulated(op, inp, layout, world)
    got = _cases.gathered(op, inp, layout, world, ranks)
    assert got.keys() == want.keys()
    for name, ref in want.items():
        assert torch.equal(got[name], ref.cpu()), f"{name}: NCCL ranks differ from the simulated ranks"


@pytest.mark.parametrize("world", (2, 4))
def test_rmsnorm_sequence_parallel_weight_gradient(world, tmp_path):
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs, found {torch.cuda.device_count()}")
    from miles_ext_kernels import cake
    from miles_ext_kernels.cake._runtime.testing import rel_rms

    T, H = 8192, 2048
    ranks = _cases.spawn_ranks("rmsnorm_sp", "contiguous", world, [T], tmp_path, backend="nccl",
                               dims=dict(DIMS, D=H))
    for r in ranks[1:]:
        assert torch.equal(r["dw"], ranks[0]["dw"]), "the all-reduced weight gradient differs between ranks"
    inp = _cases.rmsnorm_inputs(T, H, "cuda:0")
    x, w = inp["x"].clone().requires_grad_(True), inp["w"].clone().requires_grad_(True)
    y = cake.zero_centered_rmsnorm(x, w)
    y.backward(inp["dy"])
    # rows are independent: y and dx are the one-GPU call's bits; dw sums the same rows in another grouping
    assert torch.equal(torch.cat([r["y"] for r in ranks]), y.detach().cpu())
    assert torch.equal(torch.cat([r["dx"] for r in ranks]), x.grad.cpu())
    assert rel_rms(ranks[0]["dw"].double(), w.grad.cpu().double()) < 1e-5
