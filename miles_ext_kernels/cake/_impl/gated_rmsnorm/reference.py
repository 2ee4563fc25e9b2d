"""FP64 PyTorch reference of the gated RMSNorm RMSNorm(x) * w * SiLU(z), for tests and docs."""
import torch


def rmsnorm_silu_gate_ref(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2, -1) + eps) * w * silu(z), in float64 (differentiable; returns float64)."""
    x64 = x.to(torch.float64)
    z64 = z.to(torch.float64)
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return x64 * rstd * weight.to(torch.float64) * (z64 * torch.sigmoid(z64))


def rmsnorm_silu_gate_eager(x, z, weight, eps: float = 1e-6):
    """What a model runs without us (fp32 math, output in x's dtype): the eager / torch.compile peer."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (y * torch.nn.functional.silu(z.float())).to(x.dtype)


def grads_ref(x, z, weight, dy, eps=1e-6):
    """(y, dx, dz, dw) of the FP64 reference for upstream gradient dy."""
    xr = x.detach().to(torch.float64).requires_grad_(True)
    zr = z.detach().to(torch.float64).requires_grad_(True)
    wr = weight.detach().to(torch.float64).requires_grad_(True)
    y = rmsnorm_silu_gate_ref(xr, zr, wr, eps)
    dx, dz, dw = torch.autograd.grad(y, (xr, zr, wr), dy.to(torch.float64))
    return y.detach(), dx, dz, dw
