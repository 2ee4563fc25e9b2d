"""gated_rmsnorm properties through the interpreter: random valid layouts against the FP64 reference, finite
results, det bits on a repeat (see tests/cake/_properties.py)."""
import importlib

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import miles_ext_kernels as mek
from miles_ext_kernels.cake import gated_rmsnorm as decl
from miles_ext_kernels.cake._impl.gated_rmsnorm.reference import grads_ref
from tests.cake._properties import bounded, check_finite, check_reference, check_same_bits

demo_mod = importlib.import_module("miles_ext_kernels.cake._impl.gated_rmsnorm.demo")

pytestmark = pytest.mark.interpreter


@st.composite
def cases(draw):
    D = draw(st.sampled_from([64, 128, 256]))
    # rows (tokens x heads) per program of the small-window forward: 2048 // D (32, 16, 8)
    T = draw(st.one_of(st.sampled_from([0, 1, 7, 8, 9, 15, 16, 17, 33]), st.integers(0, 24)))
    NH = draw(st.sampled_from([1, 2, 3, 4]))
    form = draw(st.sampled_from(["[T, H, D]", "[N, D]", "[B, T, H, D]"]))
    shape = {"[T, H, D]": (T, NH, D), "[N, D]": (T * NH, D), "[B, T, H, D]": (1, T, NH, D)}[form]
    return {
        "shape": shape,
        "z_layout": draw(st.sampled_from(["contiguous", "projection slice", "odd stride"])),
        "x_layout": draw(st.sampled_from(["contiguous", "head strided"])),
        "wdtype": draw(st.sampled_from([torch.float32, torch.bfloat16])),
        "scale": draw(st.sampled_from([1e-3, 1.0, 30.0, 1e3])),  # magnitude of x
        "zscale": draw(st.sampled_from([0.1, 1.0, 8.0])),  # silu(z) from near-linear to saturated
        "zero_rows": draw(st.booleans()),
        "variant": draw(st.sampled_from(["det", "fast"])),
        "seed": draw(st.integers(0, 2 ** 16)),
    }


def _embed(t, layout):
    """`t` (bf16) itself, or a view of its values in a wider buffer: x with a head stride of 2 D (read in place); z
    as the z block of a fused projection (token stride a multiple of 8: read in place) or with a token stride that
    is not (copied)."""
    if layout == "contiguous":
        return t
    D = t.shape[-1]
    if layout == "head strided":
        wide = torch.zeros(*t.shape[:-1], 2 * D, dtype=t.dtype)
        wide[..., :D] = t
        return wide[..., :D]
    rows, width = t.shape[0], t[0].numel()
    proj = torch.zeros(rows, width + (24 if layout == "projection slice" else 12), dtype=t.dtype)
    proj[:, 8:8 + width] = t.reshape(rows, width)
    return proj[:, 8:8 + width].view(t.shape)


def _inputs(c):
    g = torch.Generator().manual_seed(c["seed"])
    shape, D = c["shape"], c["shape"][-1]
    x = c["scale"] * torch.randn(shape, generator=g)
    if c["zero_rows"] and x.numel():
        x.view(-1, D)[:: 3] = 0.0
    z = c["zscale"] * torch.randn(shape, generator=g)
    w = (1 + 0.2 * torch.randn(D, generator=g)).to(c["wdtype"])
    dy = torch.randn(shape, generator=g).to(torch.bfloat16)
    x, z = x.to(torch.bfloat16), z.to(torch.bfloat16)
    if len(shape) == 4:  # [B, T, H, D]: views through the flattened [T, H, D] form
        return x, z, w, dy
    return _embed(x, c["x_layout"]), _embed(z, c["z_layout"]), w, dy


def _run(x, z, w, dy):
    xr = x.detach().requires_grad_(True)
    zr = z.detach().requires_grad_(True)
    wr = w.detach().clone().requires_grad_(True)
    y = decl.rmsnorm_silu_gate(xr, zr, wr, 1e-6)
    y.backward(dy)
    return {"y": y.detach(), "dx": xr.grad, "dz": zr.grad, "dw": wr.grad}


@bounded(40)
@given(cases())
def test_random_layouts_match_fp64_finite_and_repeat(c):
    x, z, w, dy = _inputs(c)
    try:
        mek.configure(gated_rmsnorm_variant=c["variant"])
        got = _run(x, z, w, dy)
        mek.configure()  # det
        det = got if c["variant"] == "det" else _run(x, z, w, dy)
        again = _run(x, z, w, dy)
    finally:
        mek.configure()
    check_finite(got)
    ref = dict(zip(("y", "dx", "dz", "dw"), grads_ref(x, z, w, dy, 1e-6)))
    budgets = demo_mod.budgets("cpu", c["wdtype"], x.numel())
    for name in ("y", "dx", "dz", "dw"):
        check_reference(name, got[name], ref[name], budgets[name])
    assert got["y"].shape == x.shape and got["dz"].shape == z.shape and got["dw"].dtype == c["wdtype"]
    check_same_bits(det, again)
