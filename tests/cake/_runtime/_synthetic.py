"""Implementation of the synthetic ops the runtime tests register: a tiny real Triton kernel and its routes."""
from typing import Optional

import torch
import triton
import triton.language as tl

from miles_ext_kernels.cake._runtime import build, config, workspace


@triton.jit(do_not_specialize=["n", "alpha"])
def _axpb_kernel(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, x * alpha + 1.0, mask=mask)


BLOCKS = {"det": 128, "fast": 256}


def axpb(x: torch.Tensor, alpha: float) -> torch.Tensor:
    """y = alpha * x + 1 (float32), the block size picked by the variant configured when the call runs."""
    build.check_device(x, "x")
    block = BLOCKS[config.variant("synthetic")]
    y = torch.empty_like(x)
    _axpb_kernel[(triton.cdiv(x.numel(), block),)](x, y, x.numel(), alpha, BLOCK=block, num_warps=4, num_stages=1)
    return y


def which_variant() -> str:
    return config.variant("synthetic")


def scratch(nbytes: int, device="cpu", stream=None):
    return workspace.take(("synthetic", "scratch"), nbytes, device=device, stream=stream)


def routes(*, width: int):
    return [build.Route(_axpb_kernel, (torch.float32, torch.float32, width, 0.5), (1,),
                        {"BLOCK": block, "num_warps": 4, "num_stages": 1}, f"axpb[{v}]")
            for v, block in BLOCKS.items()]


@triton.jit(do_not_specialize=["n"])
def _scale_kernel(x_ptr, y_ptr, n, m, BLOCK: tl.constexpr):
    """y = x * 2 (float32); `m` is an int Triton specializes on (by value class), `n` one it does not."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 2.0, mask=mask)


def _mul_forward(x: torch.Tensor, w: torch.Tensor, scale: float, variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(y = x * w * scale, the variant's code as a tensor: 1 det, 2 fast) — a KernelOp forward without Triton."""
    code = torch.full((1,), 1.0 if variant == "det" else 2.0, device=x.device)
    return x * w * scale, code


def _mul_forward_fake(x, w, scale, variant):
    return torch.empty_like(x), x.new_empty((1,))


def _mul_setup(inputs, res):
    x, w, scale, variant = inputs
    return (x, w), (scale, variant)


def _mul_backward(dy: torch.Tensor, dcode: Optional[torch.Tensor], x: torch.Tensor, w: torch.Tensor, scale: float,
                  variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    return dy * w * scale, (dy * x * scale).sum(0)


def _mul_backward_fake(dy, dcode, x, w, scale, variant):
    return torch.empty_like(x), torch.empty_like(w)
