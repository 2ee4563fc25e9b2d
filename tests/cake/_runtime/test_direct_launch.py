"""`launch`'s direct path (`_runtime.launch._DirectLaunch`) on a stand-in kernel, no GPU: which launches reuse a
compiled kernel (same key) and which go through Triton's path (a new key: Triton compiles or looks it up), and the
arguments the launcher receives (parameter order, defaults filled, constexprs included, as Triton's binder).
tests/cake/_runtime/test_direct_launch_gpu.py checks the same against real kernels."""
import inspect

import pytest
import torch

from miles_ext_kernels.cake._runtime import launch as L


class _Param:
    def __init__(self, name, is_constexpr):
        self.name, self.is_constexpr = name, is_constexpr


class _Compiled:
    """What Triton's launch returns: `run` (the launcher), `function`, `packed_metadata`."""

    def __init__(self, log):
        self.function, self.packed_metadata, self._log = "function", "metadata", log

    @property
    def run(self):
        return lambda *a: self._log.append(("direct", a))


class _Kernel:
    """A JIT function's surface as `_DirectLaunch` reads it; `kernel[grid](**kw)` logs a Triton-path launch."""
    device_caches: dict = {}

    def __init__(self):
        def fn(x, y, n, m, scale, flag, opt, BLOCK, MODE=0):
            pass
        self.fn = fn
        self.params = [_Param(p, p.isupper()) for p in inspect.signature(fn).parameters]
        self.pre_run_hooks = []
        self.log = []

    def __getitem__(self, grid):
        def run(**kw):
            self.log.append(("triton", grid, kw))
            return _Compiled(self.log)
        return run


@pytest.fixture
def kernel(monkeypatch):
    direct = L._DirectLaunch(device=lambda: 0, stream=lambda index: 1234)
    monkeypatch.setattr(L, "_direct", direct)
    return _Kernel()


def _args(**over):
    buf = torch.empty(64, dtype=torch.float32)
    args = dict(x=buf, y=buf[4:], n=32, m=17, scale=0.5, flag=True, opt=None, BLOCK=64, num_warps=4)
    args.update(over)
    return args


def _paths(k):
    return [e[0] for e in k.log]


def test_second_launch_of_a_key_is_direct_with_parameters_in_order(kernel):
    a = _args()
    L.launch(kernel, (3, 2), **a)
    L.launch(kernel, (3, 2), **a)
    assert _paths(kernel) == ["triton", "direct"]
    got = kernel.log[1][1]
    assert got[:9] == (3, 2, 1, 1234, "function", "metadata", None, None, None)
    assert got[9] is a["x"] and got[10] is a["y"]
    assert got[11:] == (32, 17, 0.5, True, None, 64, 0)  # MODE's default filled in


@pytest.mark.parametrize("change", [
    dict(y=torch.empty(64, dtype=torch.float32)[1:]),  # a start that is not 16-byte aligned
    dict(x=torch.empty(64, dtype=torch.bfloat16)),  # another dtype
    dict(n=1), dict(n=48 + 1), dict(m=32), dict(m=2 ** 31), dict(m=2 ** 63),  # another int class
    dict(flag=False), dict(opt=3), dict(BLOCK=128), dict(MODE=1), dict(num_warps=8), dict(num_stages=3),
    dict(BLOCK=64.0),  # equal to 64, another constexpr
], ids=lambda c: next(iter(c)))
def test_what_triton_specializes_on_makes_a_new_key(kernel, change):
    L.launch(kernel, (1,), **_args())
    L.launch(kernel, (1,), **_args(**change))
    L.launch(kernel, (1,), **_args(**change))
    assert _paths(kernel) == ["triton", "triton", "direct"]


@pytest.mark.parametrize("change", [dict(m=33), dict(n=64), dict(scale=2.0), dict(x=torch.empty(128))],
                         ids=["int_same_class", "int_mult16", "float", "other_aligned_tensor"])
def test_values_triton_does_not_specialize_on_share_a_key(kernel, change):
    L.launch(kernel, (1,), **_args())
    a = _args(**change)
    L.launch(kernel, (1,), **a)
    assert _paths(kernel) == ["triton", "direct"]
    want = [a[n] for n in ("x", "y", "n", "m", "scale", "flag", "opt", "BLOCK")] + [0]
    assert all(g is w or g == w for g, w in zip(kernel.log[1][1][9:], want, strict=True))


def test_unknown_keyword_unsupported_type_and_hooks_take_tritons_path(kernel, monkeypatch):
    L.launch(kernel, (1,), **_args())
    L.launch(kernel, (1,), **_args(bogus=1))
    L.launch(kernel, (1,), **_args(opt=[1, 2]))
    hooks = L._direct._runtime.launch_enter_hook
    hooks.add(print)
    try:
        L.launch(kernel, (1,), **_args())
    finally:
        hooks.remove(print)
    kernel.pre_run_hooks.append(print)
    L.launch(kernel, (1,), **_args())
    kernel.pre_run_hooks.clear()
    L.launch(kernel, (1,), **_args())
    assert _paths(kernel) == ["triton"] * 5 + ["direct"]


def test_a_wrapper_without_a_jit_surface_takes_tritons_path(kernel):
    class Wrapped:  # e.g. an autotuner: launchable, but not a JIT function
        log = []
        __getitem__ = _Kernel.__getitem__
    w = Wrapped()
    L.launch(w, (1,), **_args())
    L.launch(w, (1,), **_args())
    assert _paths(w) == ["triton", "triton"]


def test_a_changed_global_takes_tritons_path(kernel):
    scope = {"FLAG": 1}
    kernel.used_global_vals = {("FLAG", 0): (1, scope)}
    L.launch(kernel, (1,), **_args())
    L.launch(kernel, (1,), **_args())
    scope["FLAG"] = 2  # Triton's own launch raises on this; the direct path hands it over
    L.launch(kernel, (1,), **_args())
    assert _paths(kernel) == ["triton", "direct", "triton"]


def test_missing_argument_is_left_to_triton(kernel):
    a = _args()
    del a["m"]
    L.launch(kernel, (1,), **a)
    L.launch(kernel, (1,), **a)
    assert _paths(kernel) == ["triton", "triton"]


def test_the_interpreter_and_the_switch_take_tritons_path(monkeypatch):
    monkeypatch.setattr(L, "_direct", None)
    monkeypatch.setattr(L, "INTERPRET", True)
    assert L._make_direct() is False
    monkeypatch.setattr(L, "INTERPRET", False)
    monkeypatch.setenv("MILES_EXT_KERNELS_TRITON_LAUNCH", "1")
    assert L._make_direct() is False


def test_num_warps_as_a_kernel_parameter_is_direct(kernel):
    """A Gluon kernel takes num_warps as a constexpr parameter as well as a launch option: it is one of the kernel's
    arguments (passed to the launcher in its place), and the launch is direct with or without other options."""
    def fn(x, n, BLOCK, num_warps):
        pass
    kernel.fn = fn
    kernel.params = [_Param(p, p.isupper() or p == "num_warps") for p in inspect.signature(fn).parameters]
    buf = torch.empty(64, dtype=torch.float32)
    # maxnreg None is Triton's default, so it shares the key of a launch without it
    for opts, want in ((dict(), ["triton", "direct"]), (dict(maxnreg=168), ["triton", "direct"]),
                       (dict(maxnreg=None), ["direct", "direct"])):
        kernel.log.clear()
        L.launch(kernel, (1,), x=buf, n=32, BLOCK=64, num_warps=4, **opts)
        L.launch(kernel, (1,), x=buf, n=32, BLOCK=64, num_warps=4, **opts)
        assert _paths(kernel) == want, opts
        assert kernel.log[-1][1][9:] == (buf, 32, 64, 4)
