"""rmsnorm: the zero-centred RMSNorm of miles' Qwen3-Next / Qwen3.5 layers (selector
`--linear-attention-input-norm cake`). Torch-free declaration; the implementation loads on first use.

    y = x * rsqrt(mean(x^2, -1) + eps) * (1 + w)

computed in fp32, returned in x's dtype (Qwen3NextRMSNorm's semantics; Transformer Engine calls it
`zero_centered_gamma`). x is `[..., H]` bf16 (rows read in place when the last stride is 1 and the row stride is a
multiple of 8 elements); the weight `[H]` is fp32 or bf16 (FSDP2 with `param_dtype=bf16`) and its gradient comes
in its own dtype, summed over all rows of the call.

Variants: det (default; every output and gradient repeats bit for bit) and fast (may sum the weight gradient in
no fixed order; it runs the det kernels: on the H200 an atomic sum was not faster than the fixed-order one).
Widths: `supported_hidden_sizes()`.
"""
from __future__ import annotations

from miles_ext_kernels.cake._runtime.spec import OpSpec

OP = OpSpec(
    "rmsnorm",
    variants=("det", "fast"),
    selected_by=(("linear_attention_input_norm", "cake"),),
    entry_points=("ZeroCenteredRMSNorm", "zero_centered_rmsnorm"),
    prebuild_params=("hidden_size",),
    archs=("sm_90a",),
    bench="norms",
)

# Every multiple of 64 from 64 to 16384 (a row is one register tile of the next power of two).
_MIN_H, _MAX_H, _STEP_H = 64, 16384, 64


def supported_hidden_sizes() -> tuple[int, ...]:
    """The hidden sizes this op serves (2048, 2560, 4096, 5120, 7168 and every other multiple of 64 up to 16384)."""
    return tuple(range(_MIN_H, _MAX_H + 1, _STEP_H))


def check_supported(hidden_size) -> None:
    """Raise (on any device, before anything is built) unless `hidden_size` is served."""
    if isinstance(hidden_size, bool) or not isinstance(hidden_size, int):
        raise TypeError(f"hidden_size must be an int, got {type(hidden_size).__name__}")
    if not (_MIN_H <= hidden_size <= _MAX_H and hidden_size % _STEP_H == 0):
        raise ValueError(f"rmsnorm: hidden_size {hidden_size} is not served; served: multiples of {_STEP_H} from "
                         f"{_MIN_H} to {_MAX_H} (e.g. 2048, 2560, 4096, 5120, 7168)")


def zero_centered_rmsnorm(x, weight, eps: float = 1e-6):
    """y = x * rsqrt(mean(x^2, -1) + eps) * (1 + weight), fp32 math, y in x's dtype and shape.

    x: `[..., H]` bf16, H in `supported_hidden_sizes()`. weight: `[H]` fp32 or bf16, on x's device (ValueError
    otherwise). eps: a finite float > 0. y is contiguous. Differentiable in x and weight; the weight gradient is
    summed over every row of the call (under sequence parallelism the caller all-reduces it, see
    `ZeroCenteredRMSNorm`).
    The variant configured when the call runs (det unless `configure(rmsnorm_variant="fast")`) decides how the
    backward sums the weight gradient; the backward runs its forward's variant.
    """
    from ._impl import rmsnorm as impl  # a static import: torch.compile traces it (importlib it cannot)

    return impl.zero_centered_rmsnorm(x, weight, eps)


class _ImplClass(type):
    """Metaclass of the torch-free stand-in below: constructing it (or an isinstance check) loads the real class."""

    def __call__(cls, *args, **kwargs):
        return OP.impl().ZeroCenteredRMSNorm(*args, **kwargs)

    def __instancecheck__(cls, obj):
        return isinstance(obj, OP.impl().ZeroCenteredRMSNorm)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, OP.impl().ZeroCenteredRMSNorm)


class ZeroCenteredRMSNorm(metaclass=_ImplClass):
    """`torch.nn.Module`: y = x * rsqrt(mean(x^2, -1) + eps) * (1 + weight) over the last dim of x.

    ZeroCenteredRMSNorm(hidden_size, eps=1e-6, *, device=None, dtype=None, sequence_parallel=None)

    - hidden_size must be served (`check_supported`), else ValueError on any device.
    - weight: `[hidden_size]`, dtype fp32 (default) or bf16, zero-initialised (so 1 + w = 1). It is allocated on
      `device` when given; else where torch's factories allocate when that is not the CPU (`with
      torch.device("meta")`, `torch.set_default_device`); else on the current CUDA device. `device="meta"`
      touches no GPU, and construction compiles nothing.
    - `reset_parameters()` zeroes the weight (also after `to_empty()`).
    - `sequence_parallel=True/False` sets that attribute on the weight, as Transformer Engine's norms do, so
      Megatron all-reduces its gradient under sequence parallelism (re-applied by `reset_parameters`); None leaves
      whatever mark the caller set.
    - forward(x): `zero_centered_rmsnorm(x, self.weight, self.eps)`.
    """
