"""Implementation of the synthetic ops the runtime tests register: a tiny real Triton kernel and its routes."""
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
