"""rmsnorm properties through the interpreter: random valid layouts against the FP64 reference, finite results,
det bits on a repeat (see tests/cake/_properties.py)."""
import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import miles_ext_kernels as mek
from miles_ext_kernels.cake import rmsnorm as decl
from miles_ext_kernels.cake._impl.rmsnorm.reference import grads_ref
from tests.cake._properties import bounded, check_finite, check_reference, check_same_bits

demo_mod = importlib.import_module("miles_ext_kernels.cake._impl.rmsnorm.demo")

pytestmark = pytest.mark.interpreter

# rows per program of the small-window forward are 2048 // next_pow2(H): 32 at H 64, 8 at H 256, 2 at H 1024
ROWS = st.one_of(st.sampled_from([0, 1, 2, 7, 8, 9, 31, 32, 33]), st.integers(0, 40))


@st.composite
def cases(draw):
    H = draw(st.sampled_from([64, 128, 192, 256, 320, 1024]))  # 192, 320: rows of two power-of-two tiles
    T = draw(ROWS)
    lead = draw(st.sampled_from([(T,), (1, T), (T, 1) if T else (0, 3)]))  # leading dims are flattened into rows
    return {
        "shape": (*lead, H),
        "layout": draw(st.sampled_from(["contiguous", "row slice", "misaligned slice"])),
        "wdtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "scale": draw(st.sampled_from([1e-3, 1.0, 30.0, 1e3])),  # magnitude of x
        "zero_rows": draw(st.booleans()),
        "eps": draw(st.sampled_from([1e-6, 1e-5])),
        "variant": draw(st.sampled_from(["det", "fast"])),
        "seed": draw(st.integers(0, 2 ** 16)),
    }


def _inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    shape, H = c["shape"], c["shape"][-1]
    x = c["scale"] * torch.randn(shape, generator=g)
    if c["zero_rows"] and x.numel():
        x.view(-1, H)[:: 3] = 0.0  # rows of zeros: rstd = eps ** -0.5, still finite
    if c["layout"] != "contiguous":  # a column slice of a wider row, read in place (aligned) or copied (misaligned)
        off = 8 if c["layout"] == "row slice" else 3
        wide = torch.zeros(*shape[:-1], H + 16)
        wide[..., off:off + H] = x
        x = wide.to(torch.bfloat16)[..., off:off + H]
    else:
        x = x.to(torch.bfloat16)
    w = (0.2 * torch.randn(H, generator=g)).to(c["wdtype"])
    dy = torch.randn(shape, generator=g).to(torch.bfloat16)
    return x, w, dy


def _run(x, w, dy, eps):
    xr = x.detach().requires_grad_(True)
    wr = w.detach().clone().requires_grad_(True)
    y = decl.zero_centered_rmsnorm(xr, wr, eps)
    y.backward(dy)
    return {"y": y.detach(), "dx": xr.grad, "dw": wr.grad}


@bounded(40)
@given(cases())
def test_random_layouts_match_fp64_finite_and_repeat(c):
    x, w, dy = _inputs(c)
    try:
        mek.configure(rmsnorm_variant=c["variant"])
        got = _run(x, w, dy, c["eps"])
        mek.configure()  # det
        det = got if c["variant"] == "det" else _run(x, w, dy, c["eps"])
        again = _run(x, w, dy, c["eps"])
    finally:
        mek.configure()
    check_finite(got)
    ref = dict(zip(("y", "dx", "dw"), grads_ref(x, w, dy, c["eps"])))
    budgets = demo_mod.budgets("cpu", c["wdtype"], x.numel())
    for name in ("y", "dx", "dw"):
        check_reference(name, got[name], ref[name], budgets[name])
    assert got["y"].dtype == torch.bfloat16 and got["dw"].dtype == c["wdtype"] and got["y"].shape == x.shape
    check_same_bits(det, again)
