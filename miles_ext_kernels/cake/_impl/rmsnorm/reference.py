"""FP64 PyTorch reference of the zero-centred RMSNorm (Qwen3NextRMSNorm's semantics), for tests and docs."""
import torch


def zero_centered_rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """y = x * rsqrt(mean(x^2, -1) + eps) * (1 + w), in float64 (differentiable; returns float64)."""
    x64 = x.to(torch.float64)
    rstd = torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return x64 * rstd * (1.0 + weight.to(torch.float64))


def zero_centered_rmsnorm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """What a model runs without us (fp32 math, output in x's dtype): the eager / torch.compile peer."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def grads_ref(x, weight, dy, eps=1e-6):
    """(y, dx, dw) of the FP64 reference for upstream gradient dy."""
    xr = x.detach().to(torch.float64).requires_grad_(True)
    wr = weight.detach().to(torch.float64).requires_grad_(True)
    y = zero_centered_rmsnorm_ref(xr, wr, eps)
    dx, dw = torch.autograd.grad(y, (xr, wr), dy.to(torch.float64))
    return y.detach(), dx, dw
