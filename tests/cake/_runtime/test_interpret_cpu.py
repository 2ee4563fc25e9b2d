"""The interpreter's fp32 -> bf16 conversion rounds to nearest even once an op implementation has loaded (as the
GPU's cvt.rn.bf16.f32 does; triton 3.9's interpreter alone truncates), for `.to(bf16)` and for a store of fp32
values into a bf16 tensor, so CPU error budgets mean what GPU budgets mean."""
import pytest
import torch

pytestmark = pytest.mark.interpreter


def test_fp32_to_bf16_rounds_to_nearest_even_like_torch():
    import triton
    import triton.language as tl

    import miles_ext_kernels.cake._impl  # noqa: F401 - installs the rounding

    @triton.jit
    def cast(x, y, z, N: tl.constexpr):
        o = tl.arange(0, N)
        v = tl.load(x + o)
        tl.store(y + o, v.to(tl.bfloat16))
        tl.store(z + o, v)  # implicit conversion on store

    n = 4096
    x = torch.randn(n, generator=torch.Generator().manual_seed(0)) * torch.logspace(-40, 38, n)
    x[:5] = torch.tensor([float("nan"), float("inf"), -float("inf"), 3.4e38, -0.0])
    y, z = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.bfloat16)
    cast[(1,)](x, y, z, n)
    want = x.to(torch.bfloat16)
    for got in (y, z):
        same = (got.view(torch.int16) == want.view(torch.int16)) | (got.isnan() & want.isnan())
        assert bool(same.all()), f"{int((~same).sum())} of {n} conversions differ from round-to-nearest-even"
