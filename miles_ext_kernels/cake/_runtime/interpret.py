"""Triton's interpreter, made to round fp32 -> bf16 as a GPU does.

triton 3.9's interpreter converts fp32 to bf16 by truncating the low 16 bits (`cast_impl`, used by every `.to(bf16)`
and by a store of an fp32 value into a bf16 tensor); a GPU rounds to nearest even (`cvt.rn.bf16.f32`). Every
interpreted bf16 output, and every bf16 intermediate (e.g. attention's P before P V), then carries about twice the
GPU's rounding error and a bias towards zero, so a CPU budget would not mean what the GPU budget means.
`round_bf16_to_nearest()` replaces that one conversion with round-to-nearest-even (NaN stays NaN, overflow goes to
inf, as on the GPU); every other cast is left to triton. It runs once, when the first op implementation loads under
TRITON_INTERPRET=1 (`cake/_impl/__init__.py`), and changes nothing on a GPU.
"""
from __future__ import annotations

_PATCHED = False


def _rne_bits(x):
    """bf16 bit patterns (uint16) of the fp32 numpy array `x`, rounded to nearest even."""
    import numpy as np

    x = np.ascontiguousarray(x, dtype=np.float32)
    b = x.view(np.uint32).astype(np.uint64)
    r = ((b + 0x7FFF + ((b >> 16) & 1)) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():
        r = np.where(nan, ((b >> 16).astype(np.uint16) | np.uint16(0x0040)), r)  # quiet NaN, sign kept
    return r


def round_bf16_to_nearest() -> bool:
    """Make the interpreter's fp32 -> bf16 conversion round to nearest even. Idempotent; True when active."""
    global _PATCHED
    if _PATCHED:
        return True
    try:
        import triton.language as tl
        from triton.runtime import interpreter as ti
    except ImportError:
        return False
    builder = getattr(ti, "InterpreterBuilder", None)
    original = getattr(builder, "cast_impl", None)
    if original is None or not hasattr(ti, "TensorHandle"):
        return False  # another triton layout: leave it alone

    def cast_impl(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            return ti.TensorHandle(_rne_bits(src.data).reshape(src.data.shape), dst_type.scalar)
        return original(self, src, dst_type)

    cast_impl._cake_original = original
    builder.cast_impl = cast_impl
    _PATCHED = True
    return True
