"""Operands, calls and checks shared by the two norms' tests (tests/cake/rmsnorm, tests/cake/gated_rmsnorm), on CPU
and GPU."""
import torch

from miles_ext_kernels.cake._runtime.testing import check_budget

BF, F32 = torch.bfloat16, torch.float32


def norm_operands(shape, wdtype, seed=0, *, gated: bool, weight_mean: float, weight_scale=0.2, device="cpu") -> tuple:
    """bf16 x (and, `gated`, z) of `shape`, a weight of `wdtype` over the last dim (weight_mean + weight_scale x
    N(0, 1)) and a bf16 dy, drawn in that order from one generator seeded `seed`, then moved to `device`."""
    g = torch.Generator().manual_seed(seed)
    xz = [torch.randn(shape, generator=g).to(BF) for _ in range(2 if gated else 1)]
    w = weight_scale * torch.randn(shape[-1], generator=g)
    if weight_mean:
        w = weight_mean + w
    dy = torch.randn(shape, generator=g).to(BF)
    return tuple(t.to(device) for t in (*xz, w.to(wdtype), dy))


def forward_backward(fn, operands, dy, *args, clone=()) -> tuple:
    """`fn(*leaves, *args)` on leaves detached from `operands` (copied first at the positions in `clone`), then its
    backward from `dy`: (y detached, each leaf's gradient)."""
    leaves = [(t.detach().clone() if i in clone else t.detach()).requires_grad_(True) for i, t in enumerate(operands)]
    y = fn(*leaves, *args)
    y.backward(dy)
    return (y.detach(), *(t.grad for t in leaves))


def check_within(names, got, ref, budgets) -> dict:
    """check_budget of each named tensor of `got` (brought to the CPU) against `ref` within `budgets[name]`; the
    errors by name."""
    return {name: check_budget(name, g.cpu(), r, budgets[name]) for name, g, r in zip(names, got, ref)}


def every_route_det_bits(op: str, call, rows, shape_of, *, gated: bool, weight_mean: float) -> dict:
    """For the prebuild checks: for each row count T of `rows`, weight dtype (fp32, bf16) and variant (det, fast),
    `call`'s forward and backward on the GPU on norm_operands(shape_of(T), weight dtype, seed T, weight weight_mean +
    0.1 N(0, 1)); the det variant's y and gradients, as fp32 CPU tensors named f"{T}/{weight dtype}/{name}"."""
    import miles_ext_kernels as mek

    names = ("y", "dx", "dz", "dw") if gated else ("y", "dx", "dw")
    out = {}
    for T in rows:
        for wdt in (F32, BF):
            for variant in ("det", "fast"):
                mek.configure(**{f"{op}_variant": variant})
                *operands, dy = norm_operands(shape_of(T), wdt, T, gated=gated, weight_mean=weight_mean,
                                              weight_scale=0.1, device="cuda")
                got = forward_backward(call, operands, dy)
                if variant == "det":
                    for name, t in zip(names, got):
                        out[f"{T}/{wdt}/{name}"] = t.detach().float().cpu()
    return out
