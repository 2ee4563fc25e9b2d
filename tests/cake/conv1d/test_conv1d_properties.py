"""conv1d properties through the interpreter: random valid packed layouts, with and without an initial state,
against the FP64 reference, finite results, det bits on a repeat (see tests/cake/_properties.py)."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import miles_ext_kernels as mek
from miles_ext_kernels.cake import conv1d
from miles_ext_kernels.cake._impl.conv1d.reference import causal_conv1d_ref_grads
from tests.cake._properties import bounded, check_finite, check_reference, check_same_bits

pytestmark = pytest.mark.interpreter

BUDGET = {"y": 7e-3, "dx": 7e-3, "dw32": 4e-3, "dw16": 8e-3, "dh": 6e-3}  # test_conv1d_cpu.py's
# document lengths: empty, one token, around the width (2..4) and the interpreter's token chunks (8 fwd, 16 bwd)
LENGTHS = st.one_of(st.sampled_from([0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17]), st.integers(0, 20))


@st.composite
def cases(draw):
    docs = draw(st.one_of(st.none(), st.lists(LENGTHS, min_size=1, max_size=4)))  # None: one document
    T = draw(LENGTHS) if docs is None else sum(docs)
    pad = 0 if docs is None else draw(st.sampled_from([0, 0, 1, 3]))  # rows past cu_seqlens[-1]: one more document
    return {
        "T": T + pad, "docs": docs,
        "D": draw(st.sampled_from([8, 16, 20, 24, 33, 40])),  # 32 channels per program; D % 8 != 0: unaligned route
        "W": draw(st.sampled_from([2, 3, 4])),
        "act": draw(st.sampled_from(["silu", None])),
        "wdtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "cu_dtype": draw(st.sampled_from([torch.int32, torch.int64])),
        "x_layout": draw(st.sampled_from(["contiguous", "aligned slice", "misaligned slice"])),
        "scale": draw(st.sampled_from([1e-2, 1.0, 30.0])),
        "halo": draw(st.booleans()),  # an initial state [N, D, W] (N = 1 without cu_seqlens)
        "seed": draw(st.integers(0, 2 ** 16)),
    }


def _inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    T, D, W = c["T"], c["D"], c["W"]
    x = (c["scale"] * torch.randn(T, D, generator=g)).to(torch.bfloat16)
    if c["x_layout"] != "contiguous":  # a column slice of a wider projection: read in place or copied
        off = 8 if c["x_layout"] == "aligned slice" else 3
        wide = torch.zeros(T, D + 16 + (8 - D % 8) % 8, dtype=torch.bfloat16)
        wide[:, off:off + D] = x
        x = wide[:, off:off + D]
    w = (0.5 * torch.randn(D, W, generator=g)).to(c["wdtype"])
    dy = torch.randn(T, D, generator=g).to(torch.bfloat16)
    N = 1 if c["docs"] is None else len(c["docs"])
    h = (c["scale"] * torch.randn(N, D, W, generator=g)).to(torch.bfloat16) if c["halo"] else None
    if c["docs"] is None:
        return x, w, dy, None, None, h
    bounds = [0] + torch.tensor(c["docs"], dtype=torch.int64).cumsum(0).tolist()
    cu = torch.tensor(bounds, dtype=c["cu_dtype"])
    full = torch.tensor(bounds + ([T] if T > bounds[-1] else []), dtype=torch.int64)  # padding as its own document
    return x, w, dy, cu, full, h


def _run(x, w, dy, cu, act, h):
    xr = x.detach().requires_grad_(True)
    wr = w.detach().clone().requires_grad_(True)
    hr = None if h is None else h.detach().requires_grad_(True)
    y = conv1d.causal_conv1d(xr, wr, cu_seqlens=cu, activation=act, initial_state=hr)
    y.backward(dy)
    out = {"y": y.detach(), "dx": xr.grad, "dw": wr.grad}
    if h is not None:
        out["dh"] = hr.grad
    return out


@bounded(40)
@given(cases())
def test_random_layouts_match_fp64_finite_and_repeat(c):
    x, w, dy, cu, full, h = _inputs(c)
    mek.configure()  # det
    try:
        got = _run(x, w, dy, cu, c["act"], h)
        again = _run(x, w, dy, cu, c["act"], h)
    finally:
        mek.configure()
    check_finite(got)
    ry, rdx, rdw, *rdh = causal_conv1d_ref_grads(x, w, dy, full, c["act"], round_preactivation=False,
                                                 initial_state=h)
    check_reference("y", got["y"], ry, BUDGET["y"])
    check_reference("dx", got["dx"], rdx, BUDGET["dx"])
    check_reference("dw", got["dw"], rdw, BUDGET["dw32" if c["wdtype"] == torch.float32 else "dw16"])
    if h is not None:
        check_reference("dh", got["dh"], rdh[0], BUDGET["dh"])
        assert got["dh"].dtype == torch.bfloat16 and not got["dh"][:, :, 0].any()
    assert got["y"].dtype == torch.bfloat16 and got["dw"].dtype == c["wdtype"]
    check_same_bits(got, again)
