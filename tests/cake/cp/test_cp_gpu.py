"""Context parallelism on one GPU: W simulated ranks (`_runtime/cp.simulate`) of gdn and kda at the models' head
dims, against the FP64 recurrence on the whole stream within the one-GPU budgets, and det bits on a repeat."""
import importlib

import pytest
import torch

from miles_ext_kernels.cake._runtime import cp as rcp
from miles_ext_kernels.cake._runtime.testing import check_budget

pytestmark = pytest.mark.gpu

NAMES = ("q", "k", "v", "g", "beta")
LENS = [15, 100, 300, 1200, 64, 1, 2416]   # 4096 tokens: chunk +- 1 documents, a one-token one, a long one
ZIGZAG_LENS = [1024, 2048, 512, 512]        # multiples of 2W for W <= 8
# (layout, W, lengths, state exchanges): zigzag by default waits on rank W - 1's pieces; with 4 exchanges on three
# pieces per document
PLANS = [("contiguous", 2, LENS, None), ("contiguous", 8, LENS, None), ("zigzag", 4, ZIGZAG_LENS, None),
         ("zigzag", 4, ZIGZAG_LENS, 4)]


def _gdn(layout, W, lens, exchanges):
    demo = importlib.import_module("miles_ext_kernels.cake._impl.gdn.demo")
    ref_mod = importlib.import_module("miles_ext_kernels.cake._impl.gdn.reference")
    ops = importlib.import_module("miles_ext_kernels.cake._impl.gdn.ops")
    inp = demo.make_inputs(lens, 4, 8, 128, 128, "cuda", h0=False)
    leaves = [inp[n].double().requires_grad_(True) for n in NAMES]
    ro, _ = ref_mod.gdn_reference(*leaves, use_qk_l2norm_in_kernel=True, cu_seqlens=inp["cu"].cpu())
    ro.backward(inp["do"].double())
    ref = {"o": ro.detach()} | {"d" + n: x.grad for n, x in zip(NAMES, leaves)}

    def run():
        ctxs = rcp.simulated_contexts(inp["cu"], W, layout=layout, state_exchanges=exchanges, device="cuda")
        o, grads = rcp.simulate(ops.cp_forward_stage, ops.cp_backward_stage, ctxs, [inp[n] for n in NAMES],
                                args=(128 ** -0.5, True, True), grad_out=inp["do"])
        return {"o": o} | {"d" + n: gr for n, gr in zip(NAMES, grads)}

    return run, ref, demo.BUDGETS["cuda"], lambda n, got: check_budget(n, got, ref[n], demo.BUDGETS["cuda"][n])


def _kda(layout, W, lens, exchanges):
    demo = importlib.import_module("miles_ext_kernels.cake._impl.kda.demo")
    ops = importlib.import_module("miles_ext_kernels.cake._impl.kda.ops")
    inp = demo.make_inputs(lens, 4, 8, 128, 128, "cuda", h0=False, gate="safe")
    ref = demo.run_reference(dict(inp, h0=None), l2=True, final=False, device="cuda")
    gate = ops.gate_kind(True, inp["lower_bound"])

    def run():
        ctxs = rcp.simulated_contexts(inp["cu"], W, layout=layout, state_exchanges=exchanges, device="cuda")
        o, grads = rcp.simulate(ops.cp_forward_stage, ops.cp_backward_stage, ctxs, [inp[n] for n in NAMES],
                                params=[inp["A_log"], inp["dt_bias"]],
                                args=(128 ** -0.5, float(inp["lower_bound"]), gate, True), grad_out=inp["do"])
        return {"o": o} | {"d" + n: gr for n, gr in zip(NAMES + ("A_log", "dt_bias"), grads)}

    return run, ref, demo.BUDGETS["cuda"], lambda n, got: demo.check_budget(n, got, ref, demo.BUDGETS["cuda"][n])


@pytest.mark.parametrize("layout, W, lens, exchanges", PLANS)
@pytest.mark.parametrize("op", ["gdn", "kda"])
def test_simulated_ranks_within_one_gpu_budgets_and_det(op, layout, W, lens, exchanges):
    run, ref, budgets, check = (_gdn if op == "gdn" else _kda)(layout, W, lens, exchanges)
    ours = run()
    errs = {n: check(n, got) for n, got in ours.items()}
    print(op, layout, W, {n: f"{e:.2e}" for n, e in errs.items()})
    again = run()
    for n in ours:
        assert torch.equal(ours[n], again[n]), n
