"""gdn properties through the interpreter (chunk 64): random valid packed layouts, head ratios and decay strengths
against the FP64 per-token recurrence, finite results, det bits on a repeat (see tests/cake/_properties.py)."""
import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import miles_ext_kernels as mek
from tests.cake._properties import bounded, check_finite, check_reference, check_same_bits

pytestmark = pytest.mark.interpreter

demo_mod = importlib.import_module("miles_ext_kernels.cake._impl.gdn.demo")
# test_gdn_cpu.py's BUDGETS_VARLEN (= demo.py's "cpu" budgets): 2 x our interpreter errors on the layout they were
# measured on, whose decays average -0.8 per token. With near-zero decay (a long memory) and the L2 norm, dg and dbeta
# are less well conditioned: over 44 random layouts of this suite's space their errors reached 1.18 x and 1.03 x those
# budgets (the other tensors <= 0.73 x), while the same inputs with fp32 operands match the FP64 recurrence to
# 3e-7 (the algebra is exact: this is the precision of the bf16 intermediates). dg and dbeta get 1.5 x here; every
# budget still rejects a 2 %-wrong result (check_budget proves it per example).
BUDGETS = dict(demo_mod.BUDGETS["cpu"])
BUDGETS.update(dg=1.5 * BUDGETS["dg"], dbeta=1.5 * BUDGETS["dbeta"])
# dg of a document's first token without an initial state is 0 only in exact arithmetic (S_0 = 0): where the whole
# reference dg is 0 (one-token documents) an fp32 residue remains (measured 1.5e-8)
ZERO_ATOL = {"dg": 1e-6}
# document lengths: empty, one token, chunk - 1, chunk, chunk + 1 (and short ones); a pack holds >= 1 token
LENGTHS = st.one_of(st.sampled_from([0, 1, 63, 64, 65]), st.integers(0, 20))
HEADS = [(1, 1), (1, 2), (2, 2), (1, 3)]  # (H, HV): value heads per key head 1 to 3
# log-decay per token: mild (-0.1 .. 0) to strong (-3): G reaches -192 over a chunk, where exp(-G) overflows fp32
DECAYS = [0.0, 0.05, 0.5, 1.5, 3.0]


@st.composite
def cases(draw):
    lens = draw(st.lists(LENGTHS, min_size=1, max_size=3).filter(lambda ls: sum(ls) > 0))
    while len(lens) > 1 and sum(lens) > 140:  # keep the interpreter's work tiny: at most three chunk slots or so
        lens = lens[:-1]
    H, HV = draw(st.sampled_from(HEADS))
    K, V = draw(st.sampled_from([(16, 16), (16, 32), (32, 16)]))
    return {"lens": lens, "H": H, "HV": HV, "K": K, "V": V, "decay": draw(st.sampled_from(DECAYS)),
            "l2": draw(st.booleans()), "h0": draw(st.booleans()), "seed": draw(st.integers(0, 2 ** 16))}


def _inputs(c):
    inp = demo_mod.make_inputs(c["lens"], c["H"], c["HV"], c["K"], c["V"], "cpu", seed=c["seed"], h0=c["h0"],
                               l2=c["l2"])
    gen = torch.Generator().manual_seed(c["seed"] + 1)
    inp["g"] = -c["decay"] - 0.1 * torch.rand(inp["g"].shape, generator=gen)  # in [-decay - 0.1, -decay]
    return inp


@bounded(12)
@given(cases())
def test_random_layouts_match_fp64_finite_and_repeat(c):
    inp = _inputs(c)
    mek.configure()  # det
    try:
        got = demo_mod.run_impl(inp, l2=c["l2"])
        again = demo_mod.run_impl(inp, l2=c["l2"])
    finally:
        mek.configure()
    check_finite(got)
    ref = demo_mod.run_reference(inp, l2=c["l2"])
    assert got.keys() == ref.keys()
    for name in got:
        check_reference(name, got[name], ref[name], BUDGETS[name], zero_atol=ZERO_ATOL.get(name, 0.0))
    check_same_bits(got, again)
