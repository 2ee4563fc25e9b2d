"""Test set-up shared by every test.

Where no CUDA GPU is visible, kernels run through Triton's interpreter: TRITON_INTERPRET=1 is set here, before any
kernel module is imported (triton.jit decides at decoration time). Markers:
  interpreter  real kernels on CPU tensors through the interpreter; run only when the interpreter is on
  gpu          needs a served CUDA GPU; skipped on CPU machines and under the interpreter
  multi_gpu    needs two served GPUs
Unmarked tests (the torch-free ones) run everywhere.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def _gpu_count() -> int:
    if INTERPRET:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    n = None
    for item in items:
        if "interpreter" in item.keywords and not INTERPRET:
            item.add_marker(pytest.mark.skip(reason="interpreter tests need TRITON_INTERPRET=1 (CPU machines)"))
        if "gpu" in item.keywords or "multi_gpu" in item.keywords:
            if n is None:
                n = _gpu_count()
            need = 2 if "multi_gpu" in item.keywords else 1
            if n < need:
                why = "TRITON_INTERPRET=1 is set" if INTERPRET else f"needs {need} CUDA GPU(s), found {n}"
                item.add_marker(pytest.mark.skip(reason=why))
