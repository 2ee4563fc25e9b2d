"""Triton build bookkeeping: devices and archs, routes, `prebuild`, `no_build`.

Torch and triton are imported inside the functions that need them, so importing this module stays cheap.

A *route* is one kernel specialization an op can launch: (kernel, argument specialization, constexprs, num_warps,
num_stages). Each op's implementation package declares all of its routes in `routes(**model_params)`; runtime sizes
are kept out of the specialization (`do_not_specialize`) so that set is finite. `prebuild` compiles every route for
the device's arch, in parallel; `no_build()` turns any code generation into a `RuntimeError`, which proves that a
prebuilt process never compiles on the training path.
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from .spec import ARCH_BY_CAPABILITY

# Whether kernels run through Triton's interpreter (CPU tests). Read once: triton.jit decides at decoration time.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"


def device_arch(device=None) -> str:
    """Arch name of a CUDA device (default: the current one); `NotImplementedError` for a GPU no op serves."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA GPU is visible: cake kernels need one (or TRITON_INTERPRET=1 with CPU tensors)")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device_arch needs a CUDA device, got {dev}")
    cap = torch.cuda.get_device_capability(dev)
    arch = ARCH_BY_CAPABILITY.get(tuple(cap))
    if arch is None:
        raise NotImplementedError(
            f"{torch.cuda.get_device_name(dev)} (compute capability {cap[0]}.{cap[1]}) is not served by "
            f"miles_ext_kernels; served: {sorted(ARCH_BY_CAPABILITY.values())}")
    return arch


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on host ints, for launch grids. (`triton.cdiv` is a jitted function in triton 3.9: ~5-20 us per
    host call, which matters on the launch path of memory-bound ops.)"""
    return -(-a // b)


_NO_GUARD = contextlib.nullcontext()


def device_guard(t):
    """Context that makes `t`'s GPU current, so kernels launch there even when another GPU is current (Triton
    launches on the current device, and streams, pool buffers and counters are looked up on it); a no-op for CPU
    tensors (interpreter) and when `t`'s GPU is already current (the common case: no device switch)."""
    import torch

    if t.device.type != "cuda":
        return _NO_GUARD
    index = t.get_device()
    return _NO_GUARD if index == torch.cuda.current_device() else torch.cuda.device(index)


def on_input_device(fn):
    """Decorator for launchers whose first argument is a tensor: runs `fn` under `device_guard` of that tensor."""

    @functools.wraps(fn)
    def launcher(t, *args, **kwargs):
        with device_guard(t):
            return fn(t, *args, **kwargs)
    return launcher


# Arch name for CPU tensors run through the interpreter: ops key an "interpreter" config table by it.
INTERPRETER_ARCH = "interpreter"

_arch_by_index: dict[int, str] = {}  # CUDA device index -> arch (checked once per device)


def check_device(t, name: str, archs: tuple[str, ...] = ("sm_90a",)) -> str:
    """The arch whose config table a call on tensor `t` uses; a clear error unless the op's kernels can run there.

    CUDA tensors: the device's arch must be in `archs` (NotImplementedError otherwise). CPU tensors run only
    through Triton's interpreter (TRITON_INTERPRET=1, which tests use) and get `INTERPRETER_ARCH`. The hot path is
    `t.get_device()` and one dict look-up: the arch of each device is computed once.
    """
    idx = t.get_device()
    arch = _arch_by_index.get(idx)
    if arch is not None and arch in archs and t.is_cuda:
        return arch
    if idx >= 0 and t.is_cuda:  # (another accelerator's tensor has an index too: never take it for a GPU's)
        if arch is None:
            import torch

            arch = _arch_by_index[idx] = device_arch(torch.device("cuda", idx))
        if arch not in archs:
            raise NotImplementedError(f"{name} is on a {arch} GPU; this op serves {archs}")
        return arch
    dev = t.device
    if dev.type == "cpu" and INTERPRET:
        return INTERPRETER_ARCH
    if dev.type == "cpu":
        raise ValueError(f"{name} is a CPU tensor: cake ops run on CUDA GPUs (CPU tensors only through Triton's "
                         f"interpreter, TRITON_INTERPRET=1, set before import)")
    raise ValueError(f"{name} is on device {dev}: cake ops run on CUDA GPUs")


# --------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Route:
    """One kernel specialization: `kernel.warmup(*args, grid=grid, **constexprs)` compiles what a call launches.

    Torch dtypes stand in for tensors in `args` (positional, or keyword arguments as recorded by
    `launch.collect_routes`); `constexprs` holds the kernel's constexpr arguments plus `num_warps` / `num_stages`
    (with keyword `args` they are in `args`). `label` names the route in progress output and errors.
    """

    kernel: Any
    args: Any
    grid: tuple
    constexprs: dict
    label: str

    def warmup(self):
        if isinstance(self.args, dict):
            # warmup wraps torch dtypes into its mock tensors only when they come positionally
            from triton.runtime.jit import MockTensor

            args = {k: MockTensor.wrap_dtype(v) for k, v in self.args.items()}
            return self.kernel.warmup(grid=self.grid, **args, **self.constexprs)
        return self.kernel.warmup(*self.args, grid=self.grid, **self.constexprs)


class RouteSet:
    """Collects an op's routes, dropping exact repeats (several table entries can resolve to one specialization)."""

    def __init__(self):
        self.routes: list[Route] = []
        self._seen: set = set()

    def add(self, kernel, args: tuple, constexprs: dict, label: str, grid: tuple = (1,)) -> None:
        key = (id(kernel), args, tuple(sorted(constexprs.items())))
        if key not in self._seen:
            self._seen.add(key)
            self.routes.append(Route(kernel, args, grid, constexprs, label))


@dataclass(frozen=True)
class PrebuildResult:
    op: str
    device_index: int
    arch: str
    triton_version: str
    cache_dir: str
    params: tuple
    routes: tuple[str, ...]
    generated: int  # routes whose code was generated now (the rest came from the on-disk cache)
    seconds: float = field(compare=False)

    def __str__(self):
        return (f"prebuild {self.op} on cuda:{self.device_index} ({self.arch}, triton {self.triton_version}): "
                f"{len(self.routes)} routes, {self.generated} generated, "
                f"{len(self.routes) - self.generated} from cache, {self.seconds:.1f} s")


_prebuilt: dict[tuple, PrebuildResult] = {}
_prebuild_lock = threading.Lock()


def _cache_dir() -> str:
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return str(knobs.cache.dir)
    return os.environ.get("TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache"))


def prebuild(op: str, *, device=None, max_workers=None, **model_params) -> PrebuildResult:
    """Compile every route of `op` for `device`'s arch (default: the current CUDA device), in parallel.

    `model_params` must be exactly the op's `prebuild_params` (TypeError otherwise, before anything compiles).
    The result is remembered per (op, device, arch, triton version, cache dir, params) until `release()`: a second
    call with the same arguments does nothing and returns the same result.
    """
    from . import registry

    spec = registry.op_spec(op)
    unknown = sorted(set(model_params) - set(spec.prebuild_params))
    missing = [p for p in spec.prebuild_params if p not in model_params]
    if unknown or missing:
        parts = []
        if unknown:
            parts.append(f"unknown model parameter(s) {unknown}")
        if missing:
            parts.append(f"missing model parameter(s) {missing}")
        raise TypeError(f"prebuild({op!r}): {'; '.join(parts)}; it takes exactly {list(spec.prebuild_params)}")
    if max_workers is not None and (isinstance(max_workers, bool) or not isinstance(max_workers, int)
                                    or max_workers < 1):
        raise ValueError(f"max_workers must be a positive int, got {max_workers!r}")
    if INTERPRET:
        raise RuntimeError("prebuild compiles for a CUDA GPU; TRITON_INTERPRET=1 is set, so nothing would be built")
    import torch
    import triton

    if not torch.cuda.is_available():
        raise RuntimeError("prebuild compiles for a CUDA GPU and none is visible here")
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"prebuild needs a CUDA device, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    arch = device_arch(dev)
    if arch not in spec.archs:
        raise NotImplementedError(f"op {op!r} serves {spec.archs}, not {arch}")
    params = tuple(sorted(model_params.items()))
    key = (op, dev.index, arch, triton.__version__, _cache_dir(), params)
    with _prebuild_lock:
        done = _prebuilt.get(key)
        if done is not None:
            return done
        routes = list(spec.impl().routes(**model_params))
        labels = tuple(r.label for r in routes)
        if len(set(labels)) != len(labels):
            raise RuntimeError(f"op {op!r} declares duplicate route labels")
        start = time.perf_counter()
        counter = _CompileCounter(len(routes), op)
        with torch.cuda.device(dev), counter:
            _compile_all(routes, max_workers)
        result = PrebuildResult(op, dev.index, arch, triton.__version__, key[4], params, labels,
                                counter.generated, time.perf_counter() - start)
        _prebuilt[key] = result
        return result


def _compile_all(routes, max_workers):
    import triton

    workers = max_workers or min(32, (os.cpu_count() or 2))
    async_mode = getattr(triton, "AsyncCompileMode", None)
    if async_mode is None or workers == 1:
        for r in routes:
            r.warmup()
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool, async_mode(pool):
        for r in routes:
            r.warmup()


def prebuilt(op: str | None = None) -> list[PrebuildResult]:
    """What prebuild has built in this process (of `op`, or all), until `release()`."""
    return [r for r in _prebuilt.values() if op is None or r.op == op]


def forget_prebuilt(op: str | None = None) -> None:
    with _prebuild_lock:
        for key in [k for k in _prebuilt if op is None or k[0] == op]:
            del _prebuilt[key]


# --------------------------------------------------------------------------------------------------------------
# compilation listener: one slot in triton.knobs, chained to whatever was there
_listener_lock = threading.Lock()
_listener_installed = False
_no_build_depth = 0
_counters: list["_CompileCounter"] = []


def _describe(src) -> str:
    name = getattr(src, "name", None) or getattr(getattr(src, "fn", None), "__name__", "?")
    sig = getattr(src, "signature", {})
    consts = getattr(src, "constants", {})
    fn = getattr(src, "fn", None)
    arg_names = getattr(fn, "arg_names", None) or []
    named = {}
    for k, v in consts.items():
        idx = k[0] if isinstance(k, tuple) and len(k) == 1 else k
        named[arg_names[idx] if isinstance(idx, int) and idx < len(arg_names) else str(k)] = v
    attrs = getattr(src, "attrs", {})
    return f"{name}(signature={dict(sig)}, constexprs={named}, attrs={attrs})"


def _install_listener():
    global _listener_installed
    with _listener_lock:
        if _listener_installed:
            return
        import triton

        knobs = triton.knobs
        previous = knobs.compilation.listener

        def listener(*, src, metadata, metadata_group, times, cache_hit):
            if previous is not None:
                previous(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit)
            for c in list(_counters):
                c.seen(cache_hit)
            if not cache_hit and _no_build_depth > 0:
                raise RuntimeError(f"cake.no_build(): Triton generated code for {_describe(src)}; prebuild the op "
                                   f"(cake.prebuild / python -m miles_ext_kernels prebuild) before this point")

        knobs.compilation.listener = listener
        _listener_installed = True


class _CompileCounter:
    """Counts compilations during a prebuild; draws a progress line on a TTY."""

    def __init__(self, total: int, op: str):
        self.total, self.op = total, op
        self.done = self.generated = 0
        self.tty = sys.stderr.isatty()
        self.lock = threading.Lock()

    def seen(self, cache_hit: bool):
        with self.lock:
            self.done += 1
            self.generated += not cache_hit
            if self.tty:
                n = min(self.done, self.total)
                bar = "#" * (30 * n // max(self.total, 1))
                sys.stderr.write(f"\rprebuild {self.op}: [{bar:<30}] {n}/{self.total}")
                sys.stderr.flush()

    def __enter__(self):
        _install_listener()
        _counters.append(self)
        return self

    def __exit__(self, *exc):
        _counters.remove(self)
        if self.tty:
            sys.stderr.write("\n")


@contextlib.contextmanager
def no_build():
    """Inside this block any Triton code generation raises `RuntimeError` naming the kernel and specialization.

    Loading a compiled kernel from the on-disk cache is not a build. The guard is process-wide (not per thread):
    autograd runs backward kernels on its own threads, and those must be covered too.
    """
    global _no_build_depth
    if not INTERPRET:
        _install_listener()
    with _listener_lock:
        _no_build_depth += 1
    try:
        yield
    finally:
        with _listener_lock:
            _no_build_depth -= 1
