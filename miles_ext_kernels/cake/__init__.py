"""cake: the kernels miles selects with `... cake` backends, on one shared runtime. Torch-free at import.

    OPS                     the shipped ops' declarations (OpSpec), in order
    op_spec(name)           one op's declaration
    prebuild(op, ...)       compile every kernel route of an op for a device (see _runtime/build.py)
    no_build()              context manager: any Triton code generation inside raises RuntimeError
    release(op=None)        forget prebuild records, free the workspace pool; returns bytes freed
    device_arch(device)     "sm_90a" for an H100/H200; NotImplementedError for a GPU no op serves
    ARCH_BY_CAPABILITY      {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}

Each op's public functions are importable from its declaration module (`cake.gqa.varlen_gqa_attention`) and
from here (`cake.varlen_gqa_attention`); the implementation (torch, triton) loads on first call.
"""
from ._runtime.registry import OPS, op_spec, prebuild, release
from ._runtime.spec import ARCH_BY_CAPABILITY


def device_arch(device=None) -> str:
    from ._runtime import build

    return build.device_arch(device)


def no_build():
    from ._runtime import build

    return build.no_build()


def __getattr__(name):
    for spec in OPS:
        if name in spec.entry_points:
            import importlib

            return getattr(importlib.import_module(f"{__name__}.{spec.name}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["OPS", "op_spec", "prebuild", "no_build", "release", "device_arch", "ARCH_BY_CAPABILITY"] + [
    e for s in OPS for e in s.entry_points]
