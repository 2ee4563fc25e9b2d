"""`launch`'s direct path on real kernels (H200): every specialization Triton makes (alignment, int == 1, int % 16,
int width, constexprs, launch options) lands on its own compiled kernel, and a launch through the direct path
writes what Triton's own launch of the same arguments writes, bit for bit."""
import pytest
import torch
import triton
import triton.language as tl

from miles_ext_kernels.cake._runtime import launch as L

pytestmark = pytest.mark.gpu


@triton.jit
def _affine_kernel(x, y, n, stride, a, off, FLIP: tl.constexpr, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    v = tl.load(x + o.to(tl.int64) * stride, mask=m, other=0.).to(tl.float32)
    v = v * a + off.to(tl.float32)
    if FLIP:
        v = -v
    tl.store(y + o, v.to(y.dtype.element_ty), mask=m)


def _run(path, x, n, stride, a=1.5, off=3, flip=False, block=128, warps=4):
    y = torch.full((n,), float("nan"), dtype=torch.float32, device="cuda")
    kw = dict(x=x, y=y, n=n, stride=stride, a=a, off=off, FLIP=flip, BLOCK=block, num_warps=warps)
    grid = (triton.cdiv(n, block),)
    if path == "triton":
        _affine_kernel[grid](**kw)
    else:
        L.launch(_affine_kernel, grid, **kw)
    return y


CASES = {
    "base": dict(n=300, stride=2), "n_same_class": dict(n=301, stride=2), "n_mult16": dict(n=320, stride=2),
    "n_is_1": dict(n=1, stride=2), "stride_is_1": dict(n=300, stride=1), "stride_3": dict(n=300, stride=3),
    "off_wide": dict(n=300, stride=2, off=2 ** 40), "flip": dict(n=300, stride=2, flip=True),
    "block": dict(n=300, stride=2, block=256), "warps": dict(n=300, stride=2, warps=8),
    "misaligned": dict(n=300, stride=2, start=1), "bf16": dict(n=300, stride=2, dtype=torch.bfloat16),
}


def test_direct_launches_match_tritons():
    L.launch(_affine_kernel, (1,), **dict(x=torch.zeros(4, device="cuda"), y=torch.zeros(4, device="cuda"), n=4,
                                          stride=1, a=1.0, off=0, FLIP=False, BLOCK=128))
    direct = L._direct
    if not direct:
        pytest.skip("the direct path is off (MILES_EXT_KERNELS_TRITON_LAUNCH=1)")
    src = torch.randn(4096, device="cuda")
    for name, c in CASES.items():
        c = dict(c)
        x = src.to(c.pop("dtype", torch.float32))[c.pop("start", 0):]
        want = _run("triton", x, **c)
        before = len(direct._compiled)
        first = _run("direct", x, **c)  # a new key (or one an earlier case shares) then a cached one
        second = _run("direct", x, **c)
        assert torch.equal(first, want) and torch.equal(second, want), name
        assert len(direct._compiled) - before <= 1, name
    # base, n_same_class and stride_3 share a key (their ints differ within a class); with the first launch above,
    # 11 keys
    assert sum(k[0] == id(_affine_kernel) for k in direct._compiled) == 11
