"""The registry: every op's declaration, in order, and the prebuild/release entry points. Torch-free.

`OPS` holds the shipped ops, imported from their declaration modules `cake/<op>.py` (torch-free by contract).
Tests register synthetic ops with `registered(spec)`, so the runtime's rules are tested without relying on any
real op being present.
"""
from __future__ import annotations

import contextlib
import importlib

from .spec import OpSpec

# The shipped ops, in the order the command line and the docs list them. Adding an op = one line here.
_OP_MODULES: tuple[str, ...] = (  # one per line: adding an op touches one line
    "gqa",
    "rmsnorm",
    "gated_rmsnorm",
    "conv1d",
    "gdn",
    "kda",
)

_EXTRA: dict[str, OpSpec] = {}


class UnknownOpError(ValueError, KeyError):
    """An op name no registered op has. A `ValueError` (a bad argument value); also a `KeyError`, which
    `op_spec` raised before, so existing `except KeyError` callers keep working. Its message is printed as is
    (no KeyError quoting)."""

    __str__ = Exception.__str__


def _load_shipped() -> tuple[OpSpec, ...]:
    specs = []
    for name in _OP_MODULES:
        spec = importlib.import_module(f"miles_ext_kernels.cake.{name}").OP
        if spec.name != name:
            raise RuntimeError(f"cake/{name}.py declares op {spec.name!r}")
        specs.append(spec)
    return tuple(specs)


OPS: tuple[OpSpec, ...] = _load_shipped()
_BY_NAME: dict[str, OpSpec] = {s.name: s for s in OPS}


def all_ops() -> tuple[OpSpec, ...]:
    """Shipped ops, then any registered by `registered` (tests)."""
    return OPS + tuple(_EXTRA.values())


def op_names() -> tuple[str, ...]:
    """The names of every registered op, in order."""
    return tuple(s.name for s in all_ops())


def op_spec(name: str) -> OpSpec:
    """The declaration of op `name`; `UnknownOpError` (a ValueError and a KeyError) listing the known ops otherwise,
    `TypeError` when `name` is not a string."""
    if not isinstance(name, str):
        raise TypeError(f"an op name must be a str, got {type(name).__name__}")
    spec = _BY_NAME.get(name) or _EXTRA.get(name)
    if spec is None:
        known = ", ".join(op_names()) or "none"
        raise UnknownOpError(f"unknown cake op {name!r} (known: {known})")
    return spec


@contextlib.contextmanager
def registered(spec: OpSpec):
    """Register `spec` for the duration of the block (synthetic ops in tests); configuration is reset around it."""
    from . import config

    if spec.name in _BY_NAME or spec.name in _EXTRA:
        raise ValueError(f"op {spec.name!r} is already registered")
    _EXTRA[spec.name] = spec
    config.configure()
    try:
        yield spec
    finally:
        _EXTRA.pop(spec.name, None)
        config.configure()


def prebuild(op: str, *, device=None, max_workers=None, **model_params):
    """Compile every kernel route of `op` for `device`'s architecture. See `build.prebuild`.

    An unknown `op` raises `UnknownOpError` (a ValueError) before anything is imported or built."""
    from . import build

    return build.prebuild(op, device=device, max_workers=max_workers, **model_params)


def release(op: str | None = None) -> int:
    """Forget prebuild records (of `op`, or all) and free every pooled workspace buffer; returns bytes freed.

    Torch-free when nothing was ever built or pooled. An unknown `op` raises `UnknownOpError` (a ValueError).
    """
    import sys

    if op is not None:
        op_spec(op)
    freed = 0
    build = sys.modules.get("miles_ext_kernels.cake._runtime.build")
    if build is not None:
        build.forget_prebuilt(op)
    workspace = sys.modules.get("miles_ext_kernels.cake._runtime.workspace")
    if workspace is not None:
        freed = workspace.release()
    return freed
