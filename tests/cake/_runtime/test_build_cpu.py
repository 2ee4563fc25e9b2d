"""Build bookkeeping checks that need no GPU: argument errors before anything compiles, device errors."""
import contextlib

import pytest
import torch

from miles_ext_kernels import cake
from miles_ext_kernels.cake._runtime import build
from tests.cake._runtime._ops import SYNTHETIC

pytestmark = pytest.mark.registered_ops(SYNTHETIC)


def test_prebuild_rejects_unknown_and_missing_params_first():
    with pytest.raises(TypeError, match=r"unknown model parameter\(s\) \['depth'\]"):
        cake.prebuild("synthetic", width=8, depth=2)
    with pytest.raises(TypeError, match=r"missing model parameter\(s\) \['width'\]"):
        cake.prebuild("synthetic")
    with pytest.raises(KeyError):
        cake.prebuild("nosuch")
    with pytest.raises(ValueError, match="max_workers"):
        cake.prebuild("synthetic", width=8, max_workers=0)


def test_arch_table():
    assert cake.ARCH_BY_CAPABILITY[(9, 0)] == "sm_90a"


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU machine behaviour")
def test_no_gpu_gives_clear_errors():
    with pytest.raises(RuntimeError, match="no CUDA GPU"):
        cake.device_arch()
    if build.INTERPRET:
        assert build.check_device(torch.zeros(1), "x") == build.INTERPRETER_ARCH  # CPU: through the interpreter
    with pytest.raises(RuntimeError):
        cake.prebuild("synthetic", width=8)


def test_cpu_tensor_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setattr(build, "INTERPRET", False)
    with pytest.raises(ValueError, match="x is a CPU tensor.*TRITON_INTERPRET"):
        build.check_device(torch.zeros(1), "x")


def test_other_accelerator_tensor_is_refused(monkeypatch):
    # a tensor of another accelerator (mps, xpu, ...) has device index 0 like cuda:0: it must not get cuda:0's arch
    class Other:
        device = torch.device("xpu", 0)
        is_cuda = False

        def get_device(self):
            return 0

    monkeypatch.setitem(build._arch_by_index, 0, "sm_90a")  # as after a call on cuda:0
    with pytest.raises(ValueError, match="^x is on device xpu:0: cake ops run on CUDA GPUs"):
        build.check_device(Other(), "x")


@pytest.mark.interpreter
def test_synthetic_kernel_runs_through_interpreter_per_variant():
    import miles_ext_kernels as mek

    x = torch.randn(1000)
    for v in ("det", "fast"):
        mek.configure(synthetic_variant=v)
        y = SYNTHETIC.impl().axpb(x, 0.5)
        torch.testing.assert_close(y, x * 0.5 + 1.0)
    mek.configure()
    with contextlib.ExitStack() as s:  # no_build is harmless where nothing compiles
        s.enter_context(cake.no_build())
        SYNTHETIC.impl().axpb(x, 2.0)
