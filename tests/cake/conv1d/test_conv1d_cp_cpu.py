"""conv1d under context parallelism, W simulated ranks in one process through Triton's interpreter: the halo (a
document's previous W_conv - 1 inputs, possibly from several short pieces on several ranks) against the FP64
convolution of the whole stream, dweight as the sum of the ranks' partials, det bits, the argument rules (gloo ranks
against these simulated ones: tests/cake/cp/test_cp_gloo_cpu.py)."""

import pytest
import torch

from miles_ext_kernels.cake import conv1d
from miles_ext_kernels.cake._impl.conv1d import ops
from miles_ext_kernels.cake._impl.conv1d.reference import causal_conv1d_ref_grads
from miles_ext_kernels.cake._runtime import cp as rcp
from miles_ext_kernels.cake._runtime.testing import check_budget

pytestmark = pytest.mark.interpreter

BUDGET = {"y": 7e-3, "dx": 7e-3, "dw": 4e-3}  # tests/cake/conv1d/test_conv1d_cpu.py's one-process budgets
# (layout, W ranks, document lengths, conv width): pieces shorter than the halo (1-token zigzag pieces: a halo from
# three pieces on three ranks), documents straddling ranks, empty documents, a rank inside one document
CASES = [("contiguous", 2, [15, 70, 0, 11], 4), ("contiguous", 3, [60, 0, 12], 3), ("zigzag", 2, [8, 16, 4], 4),
         ("zigzag", 3, [12, 6, 18], 2)]


def _inputs(lens, Wc, D=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = sum(lens)
    x = torch.randn(T, D, generator=g).to(torch.bfloat16)
    w = (torch.randn(D, Wc, generator=g) * 0.5).float()
    dy = torch.randn(T, D, generator=g).to(torch.bfloat16)
    cu = [0] + torch.tensor(lens).cumsum(0).tolist()
    return x, w, dy, cu


def _simulated(x, w, dy, cu, layout, W, act="silu"):
    ctxs = rcp.simulated_contexts(cu, W, layout=layout, conv1d_kernel_size=w.shape[1])
    y, (dx, dw) = rcp.simulate(ops.cp_forward_stage, ops.cp_backward_stage, ctxs, [x], params=[w],
                               args=(ops._act_mode(act),), grad_out=dy, token_dim=0)
    return y, dx, dw


@pytest.mark.parametrize("layout, W, lens, Wc", CASES)
def test_cp_halo_against_fp64_and_det(layout, W, lens, Wc):
    x, w, dy, cu = _inputs(lens, Wc)
    ry, rdx, rdw = causal_conv1d_ref_grads(x, w, dy, torch.tensor(cu), "silu")
    y, dx, dw = _simulated(x, w, dy, cu, layout, W)
    check_budget("y", y, ry, BUDGET["y"])
    check_budget("dx", dx, rdx, BUDGET["dx"])
    check_budget("dw", dw, rdw, BUDGET["dw"])
    # y is the one-process call's, bit for bit: every output row reads the same inputs in the same order
    whole = conv1d.causal_conv1d(x, w, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    assert torch.equal(y, whole)
    again = _simulated(x, w, dy, cu, layout, W)
    for a, b in zip((y, dx, dw), again):
        assert torch.equal(a, b)


def test_cp_call_argument_rules():
    x, w, dy, cu = _inputs([32], 4)
    ctx = rcp.simulated_contexts(cu, 2, conv1d_kernel_size=3)[0]
    xs = rcp.shard(x, ctx, 0)
    with pytest.raises(ValueError, match="pass neither"):
        conv1d.causal_conv1d(xs, w, cu_seqlens=ctx.cu_seqlens, cp_context=ctx)
    with pytest.raises(ValueError, match="conv1d_kernel_size=3"):
        conv1d.causal_conv1d(xs, w, cp_context=ctx)
    with pytest.raises(ValueError, match="rank's tokens"):
        conv1d.causal_conv1d(x, w[:, :3], cp_context=ctx)
    with pytest.raises(TypeError, match="build_cp_context"):
        conv1d.causal_conv1d(xs, w, cp_context={})
