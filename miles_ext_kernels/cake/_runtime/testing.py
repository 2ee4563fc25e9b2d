"""Accuracy helpers shared by the tests, the demo and the benchmarks.

Accuracy is the relative RMS error against an FP64 reference: ||got - ref|| / ||ref||. A per-tensor budget is
useful only if it would reject a wrong result, so `check_budget` also proves the budget rejects `got` scaled by
1.02 (a deliberately 2 % wrong result).
"""
from __future__ import annotations

import torch


def rel_rms(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (NaN anywhere gives inf; an all-zero ref compares absolutely)."""
    g = got.detach().to(torch.float64).cpu()
    r = ref.detach().to(torch.float64).cpu()
    if g.shape != r.shape:
        raise ValueError(f"shape mismatch: {tuple(g.shape)} vs {tuple(r.shape)}")
    if not torch.isfinite(g).all():
        return float("inf")
    num = torch.linalg.vector_norm(g - r).item()
    den = torch.linalg.vector_norm(r).item()
    return num / den if den > 0 else num


def check_budget(name: str, got: torch.Tensor, ref: torch.Tensor, budget: float) -> float:
    """Assert rel_rms(got, ref) <= budget and that a 2 %-wrong result (got * 1.02) would fail it; return the error."""
    err = rel_rms(got, ref)
    assert err <= budget, f"{name}: relative RMS error {err:.3e} exceeds budget {budget:.3e}"
    wrong = rel_rms(got.detach().to(torch.float64) * 1.02, ref)
    assert wrong > budget, f"{name}: budget {budget:.3e} is too loose: it accepts a 2 % error ({wrong:.3e})"
    return err


def peer_budget(peer_err: float, our_err: float) -> float:
    """DESIGN.md: budget = min(peer's error x 1.1, 2 x our measured error)."""
    return min(peer_err * 1.1, 2.0 * our_err)
