"""Launches described once: every op launches its kernels through `launch`, and its `routes()` runs the same
launchers on meta tensors under `collect_routes()`, which records each launch's specialization instead of running
it. The set of routes prebuild compiles is therefore the set the launchers launch: they cannot drift apart.

    launch(kn.fwd_o_kernel, (P, HV), q=q, k=k, ..., K=K, BT=BT, num_warps=4)   # keyword arguments only

A route is keyed by what Triton specializes on: tensor dtype and 16-byte alignment, int arguments by value class
(== 1, % 16 == 0, 32 / 64 bit; only the width for `do_not_specialize` arguments), constexprs and launch options by
value. Meta tensors stand for real ones (their start counts as aligned, as real operands are after the operand
checks). Torch is imported by the functions that need it.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import threading

from .build import Route, check_device

_collecting = threading.local()  # .routes: the RouteSet a `collect_routes()` block fills, on this thread

_LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")


def launch(kernel, grid: tuple, **kwargs) -> None:
    """kernel[grid](**kwargs), or (inside `collect_routes()`) record its route instead."""
    rs = getattr(_collecting, "routes", None)
    if rs is None:
        kernel[grid](**kwargs)
    else:
        rs.add_launch(kernel, kwargs)


@functools.lru_cache(maxsize=None)
def _kernel_info(kernel) -> tuple:
    """(name, argument names, constexpr names, do_not_specialize names) of a Triton or Gluon kernel, compiled or
    interpreted."""
    fn = getattr(kernel, "fn", kernel)
    names = list(getattr(kernel, "arg_names", None) or inspect.signature(fn).parameters)
    params = getattr(kernel, "params", None)
    if params is not None:
        consts = {p.name for p in params if p.is_constexpr}
        dns = {p.name for p in params if getattr(p, "do_not_specialize", False)}
    else:  # the interpreter's InterpretedFunction
        sig = inspect.signature(fn).parameters
        consts = {n for n, p in sig.items() if "constexpr" in str(p.annotation)}
        raw = (getattr(kernel, "kwargs", None) or {}).get("do_not_specialize") or ()
        dns = {names[i] if isinstance(i, int) else i for i in raw}
    return fn.__name__, tuple(names), frozenset(consts), frozenset(dns)


def _spec_of(value, do_not_specialize: bool):
    """What Triton's specialization sees of a runtime argument (the route's key), and the stand-in for warmup."""
    import torch

    if isinstance(value, torch.Tensor):
        aligned = value.device.type == "meta" or value.data_ptr() % 16 == 0
        return ("tensor", str(value.dtype), aligned), value.dtype
    if isinstance(value, bool) or value is None:
        return value, value
    if isinstance(value, int):
        wide = not -2 ** 31 <= value < 2 ** 31
        if do_not_specialize:
            return ("int", wide), value
        return ("int", wide, value == 1, value % 16 == 0), value
    if isinstance(value, float):
        return "fp32", value
    return ("obj", type(value).__name__, repr(getattr(value, "block_shape", None)),
            repr(getattr(value, "layout", None))), value


class RouteSet:
    """The distinct routes of the launches recorded in a `collect_routes()` block, labelled by kernel, constexprs,
    launch options and integer tensors' dtypes (a label shared by routes that differ elsewhere gets a #n suffix)."""

    def __init__(self):
        self.routes: list[Route] = []
        self._seen: set = set()
        self._labels: dict = {}

    def add_launch(self, kernel, kwargs: dict) -> None:
        name, arg_names, consts, dns = _kernel_info(kernel)
        unknown = set(kwargs) - set(arg_names) - set(_LAUNCH_OPTIONS)
        if unknown:
            raise TypeError(f"{name}: unknown launch arguments {sorted(unknown)}")
        key, args, shown = [], {}, []
        for k in sorted(kwargs):
            v = kwargs[k]
            if k in consts or k in _LAUNCH_OPTIONS:
                key.append((k, v))
                args[k] = v
                if k != "INTERPRET":
                    shown.append(f"{k}={v}")
            else:
                spec, stand_in = _spec_of(v, k in dns)
                key.append((k, spec))
                args[k] = stand_in
                if isinstance(spec, tuple) and spec[0] == "tensor" and "int" in spec[1]:  # e.g. cu_seqlens' dtype
                    shown.append(f"{k}:{spec[1].replace('torch.', '')}")
        key = (name, tuple(key))
        if key in self._seen:
            return
        self._seen.add(key)
        label = f"{name}[{','.join(shown)}]"
        n = self._labels.get(label, 0)
        self._labels[label] = n + 1
        if n:  # same constexprs and dtypes, other alignment or int classes
            label += f"#{n + 1}"
        self.routes.append(Route(kernel, args, (1,), {}, label))


@contextlib.contextmanager
def collect_routes(arch: str):
    """Inside the block, `launch` records routes into the yielded `RouteSet` instead of launching (this thread), and
    `arch_of` gives meta tensors `arch` (the config table the routes are planned for)."""
    if getattr(_collecting, "routes", None) is not None:
        raise RuntimeError("collect_routes() blocks do not nest")
    rs = _collecting.routes = RouteSet()
    _collecting.arch = arch
    try:
        yield rs
    finally:
        _collecting.routes = _collecting.arch = None


def arch_of(t, name: str, archs: tuple = ("sm_90a",)) -> str:
    """The arch whose config table a call on `t` uses (`build.check_device`); a meta tensor inside
    `collect_routes(arch)` (an op's routes() planning its launches) gets that arch."""
    if t.device.type == "meta":
        arch = getattr(_collecting, "arch", None)
        if arch is None:
            raise ValueError(f"{name} is a meta tensor: cake ops run on CUDA GPUs")
        return arch
    return check_device(t, name, archs)
