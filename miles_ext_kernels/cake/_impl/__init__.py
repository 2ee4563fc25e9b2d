"""Implementations of the cake ops: one package per op (`_impl/<op>/`), loaded on the op's first call."""
from .._runtime.build import INTERPRET as _INTERPRET

if _INTERPRET:  # CPU: the interpreter rounds fp32 -> bf16 to nearest even, as the GPU does (_runtime/interpret.py)
    from .._runtime.interpret import round_bf16_to_nearest as _round_bf16_to_nearest

    _round_bf16_to_nearest()
