"""Launches described once: every op launches its kernels through `launch`, and its `routes()` runs the same
launchers on meta tensors under `collect_routes()`, which records each launch's specialization instead of running
it. The set of routes prebuild compiles is therefore the set the launchers launch: they cannot drift apart.

    launch(kn.fwd_o_kernel, (P, HV), q=q, k=k, ..., K=K, BT=BT, num_warps=4)   # keyword arguments only

A route is keyed by what Triton specializes on: tensor dtype and 16-byte alignment, int arguments by value class
(== 1, % 16 == 0, 32 / 64 bit; only the width for `do_not_specialize` arguments), constexprs and launch options by
value. Meta tensors stand for real ones (their start counts as aligned, as real operands are after the operand
checks). Torch is imported by the functions that need it.

On a GPU, a launch whose specialization this process has launched before calls the compiled kernel's launcher
directly (`_DirectLaunch`): Triton's own launch path binds the arguments by name, computes its specialization key
and builds launch metadata on every call, ~20-25 us of host time for a kernel of ~25 arguments on the H200's host,
more than most of our kernels run at small shapes. Set MILES_EXT_KERNELS_TRITON_LAUNCH=1 to launch through Triton's
path every time; it is also taken under Triton's interpreter, while a launch hook (a profiler) is installed, and for
any argument the key below does not describe.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import os
import threading

from .build import INTERPRET, Route, check_device

_collecting = threading.local()  # .routes: the RouteSet a `collect_routes()` block fills, on this thread

_LAUNCH_OPTIONS = ("num_warps", "num_stages", "maxnreg", "num_ctas")


def launch(kernel, grid: tuple, **kwargs) -> None:
    """kernel[grid](**kwargs), or (inside `collect_routes()`) record its route instead."""
    rs = getattr(_collecting, "routes", None)
    if rs is not None:
        rs.add_launch(kernel, kwargs)
    else:
        direct = _make_direct() if _direct is None else _direct
        if not direct or not direct.launch(kernel, grid, kwargs):
            kernel[grid](**kwargs)


_MISSING = object()


def _int_class(v: int) -> tuple:
    """What Triton's specialization can see of an int argument: its type by range, == 1, divisibility by 16."""
    return (-2 ** 31 <= v < 2 ** 31, -2 ** 63 <= v < 2 ** 63, v == 1, v % 16 == 0)


class _DirectLaunch:
    """Compiled kernels by (kernel, device, key), launched without Triton's per-call binding.

    The key holds, per argument in the kernel's parameter order: constexprs by value (and type, but for ints);
    tensors by dtype and 16-byte alignment of their start; ints by `_int_class`; bools and None by value; floats as
    one class; Gluon / TMA tensor descriptors by type, base dtype, block shape, layout, padding and the int class of
    every shape and stride entry; launch options by value. That is at least everything Triton 3.6 specializes a
    compiled kernel on, so two launches with one key run one binary; as Triton's, a launch checks that the globals
    the kernel read when it compiled still hold their values (else Triton's path, which raises). A first launch of a
    key goes through Triton (compiling if needed), which returns the compiled kernel that later launches of the key
    call directly. Any other argument type falls back to Triton's path."""

    def __init__(self, device=None, stream=None):
        import torch
        from triton import knobs

        self._device = device or torch._C._cuda_getDevice  # () -> the current device's index
        self._stream = stream or torch._C._cuda_getCurrentRawStream  # (index) -> its current stream's handle
        self._tensor = torch.Tensor
        self._runtime = knobs.runtime
        self._compiled: dict = {}
        self._params: dict = {}

    def _hooked(self) -> bool:
        rt = self._runtime
        return bool(getattr(rt.launch_enter_hook, "calls", True) or getattr(rt.launch_exit_hook, "calls", True))

    def _param_list(self, kernel):
        """(names, constexpr flags, defaults) in the kernel's parameter order (`_kernel_info`'s), or False: Triton's
        path always."""
        if not hasattr(kernel, "device_caches") or not hasattr(kernel, "params"):
            got = False  # not a plain JIT function (an autotuner, a heuristics wrapper): Triton's path
        else:
            _, names, consts, _ = _kernel_info(kernel)
            sig = inspect.signature(kernel.fn).parameters
            # launch options that are not also parameters (a Gluon kernel takes num_warps as a constexpr)
            opts = tuple(o for o in _LAUNCH_OPTIONS if o not in names)
            got = names, tuple(n in consts for n in names), tuple(sig[n].default for n in names), opts
        self._params[id(kernel)] = got
        return got

    def _key_of(self, v):
        """One non-constexpr argument's part of the key, or None where the key cannot describe it."""
        if v is None or isinstance(v, bool):
            return v
        if isinstance(v, self._tensor):
            return v.dtype, v.data_ptr() % 16 == 0
        if isinstance(v, int):
            return _int_class(v)
        if isinstance(v, float):
            return float
        if hasattr(v, "base") and hasattr(v, "block_shape") and isinstance(v.base, self._tensor):
            return (type(v), v.base.dtype, tuple(v.block_shape), v.layout, getattr(v, "padding", None),
                    tuple(_int_class(int(x)) for x in v.shape), tuple(_int_class(int(x)) for x in v.strides))
        return None

    def launch(self, kernel, grid: tuple, kwargs: dict) -> bool:
        """Launch directly and return True, or return False (the caller launches through Triton)."""
        params = self._params.get(id(kernel))
        if params is None:
            params = self._param_list(kernel)
        if not params or getattr(kernel, "pre_run_hooks", None) or self._hooked():
            return False
        names, const, defaults, opts = params
        options = tuple(kwargs.get(o) for o in _LAUNCH_OPTIONS)
        n_args = len(kwargs) - sum(o in kwargs for o in opts)  # the kernel's own arguments among the keywords
        try:
            values = [kwargs[n] for n in names]
        except KeyError:  # defaults fill what the call leaves out; a missing argument is Triton's error to raise
            empty = inspect.Parameter.empty
            values = [kwargs.get(n, d) for n, d in zip(names, defaults)]
            if any(v is empty for v in values):
                return False
            n_args += sum(n not in kwargs for n in names)
        if n_args != len(names):
            return False  # an unknown keyword: Triton names it
        device = self._device()
        key = [id(kernel), device, options]
        tensor, key_of = self._tensor, self._key_of
        for v, c in zip(values, const):
            if c:
                key.append(v if type(v) is int else (type(v), v))  # 1, 1.0, True: equal keys, not one constexpr
            elif type(v) is tensor:  # the common cases first
                key.append((v.dtype, v.data_ptr() % 16 == 0))
            elif type(v) is int:  # `_int_class` inline: the call would cost more than the key
                key.append((-2 ** 31 <= v < 2 ** 31, -2 ** 63 <= v < 2 ** 63, v == 1, v % 16 == 0))
            else:
                k = key_of(v)
                if k is None and v is not None:
                    return False
                key.append(k)
        try:
            key = tuple(key)
            entry = self._compiled.get(key)
        except TypeError:  # an unhashable constexpr or layout
            return False
        if entry is None:
            compiled = kernel[grid](**kwargs)  # launches, and returns the compiled kernel
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            if compiled is not None and hasattr(compiled, "packed_metadata"):
                run = compiled.run  # (its first access loads the binary)
                self._compiled[key] = (run, compiled.function, compiled.packed_metadata)
            return True
        for (name, _), (value, scope) in getattr(kernel, "used_global_vals", {}).items():
            if scope.get(name, _MISSING) != value:
                return False  # a global the kernel reads changed since it compiled: Triton's path raises
        run, function, packed_metadata = entry
        n = len(grid)
        run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, self._stream(device), function,
            packed_metadata, None, None, None, *values)
        return True


_direct = None  # the process's _DirectLaunch, made at the first launch; False where Triton's path is always taken


def _make_direct():
    global _direct
    _direct = False
    if not INTERPRET and os.environ.get("MILES_EXT_KERNELS_TRITON_LAUNCH", "0") != "1":
        try:
            _direct = _DirectLaunch()
        except Exception:  # noqa: BLE001 - a torch / triton without these entry points: Triton's own path
            _direct = False
    return _direct


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
