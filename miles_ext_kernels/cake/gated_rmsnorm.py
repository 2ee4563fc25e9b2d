"""gated_rmsnorm: RMSNorm(x) * w * SiLU(z), the output norm of miles' Qwen3-Next / Qwen3.5 GDN layers (selector
`--linear-attention-output-norm-backend cake`). Torch-free declaration; the implementation loads on first use.

    y = x * rsqrt(mean(x^2, -1) + eps) * w * silu(z)

over rows of the head dim D (64, 128 or 256), computed in fp32, y in x's dtype. The weight `[D]` is
ones-initialised (not zero-centred), fp32 or bf16. Variants: det (default; every output and gradient repeats bit
for bit) and fast (may sum the weight gradient in no fixed order; it runs the det kernels: on the H200 an atomic
sum was not faster than the fixed-order one).
"""
from __future__ import annotations

from miles_ext_kernels.cake._runtime.spec import OpSpec

OP = OpSpec(
    "gated_rmsnorm",
    variants=("det", "fast"),
    selected_by=(("linear_attention_output_norm_backend", "cake"),),
    entry_points=("rmsnorm_silu_gate",),
    prebuild_params=("head_dim",),
    archs=("sm_90a",),
    bench="norms",
)

_HEAD_DIMS = (64, 128, 256)


def supported_head_dims() -> tuple[int, ...]:
    """The head dims this op serves."""
    return _HEAD_DIMS


def check_supported(head_dim) -> None:
    """Raise (on any device, before anything is built) unless `head_dim` is served."""
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        raise TypeError(f"head_dim must be an int, got {type(head_dim).__name__}")
    if head_dim not in _HEAD_DIMS:
        raise ValueError(f"gated_rmsnorm: head_dim {head_dim} is not served; served: {_HEAD_DIMS}")


def rmsnorm_silu_gate(x, z, weight, eps: float = 1e-6):
    """y = x * rsqrt(mean(x^2, -1) + eps) * weight * silu(z), fp32 math, y in x's dtype and shape (contiguous).

    x: `[T, H_v, D]` or `[N, D]` bf16 (more leading dims, `[..., H_v, D]`, are flattened into T). z: x's shape,
    bf16; read in place when its last stride is 1 and its token and head strides are multiples of 8 elements (e.g.
    a column slice of the fused `[q | k | v | z | b | a]` projection), copied otherwise. weight: `[D]` fp32 or bf16
    (ones-initialised), its gradient in its own dtype. x, z and weight on one device (ValueError otherwise); eps a
    finite float > 0.
    Differentiable in x, z and weight. The weight gradient is summed over the rows of this call only: under
    tensor parallelism the caller all-reduces it over the tensor-parallel group. The variant configured when the
    call runs (det unless `configure(gated_rmsnorm_variant="fast")`) decides how the backward sums the weight
    gradient; the backward runs its forward's variant.
    """
    from ._impl import gated_rmsnorm as impl  # a static import: torch.compile traces it (importlib it cannot)

    return impl.rmsnorm_silu_gate(x, z, weight, eps)
