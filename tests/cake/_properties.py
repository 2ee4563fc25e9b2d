"""Shared by the property suites (tests/cake/<op>/test_<op>_properties.py): bounded hypothesis settings and the
checks each drawn example makes.

Every suite draws random valid layouts at tiny sizes (the interpreter costs ~1.6 ms per program instance) and
checks, per example: each output and gradient against the FP64 reference within the budget the op's CPU tests use
(`check_budget` also proves that budget rejects the result scaled by 1.02), every output and gradient finite, and
the det bits of a repeat. The settings are reproducible (derandomize: the same examples on every run) and bounded
(at most 40 examples per op, no deadline, no shrinking: a failure reports the drawn example as is, so even a
failing run stays short; no example database is written).
"""
from __future__ import annotations

import torch
from hypothesis import HealthCheck, Phase, settings

from miles_ext_kernels.cake._runtime.testing import check_budget

MAX_EXAMPLES = 40  # per op; the slow ops (gqa at head dim 256, gdn) run fewer


def bounded(max_examples: int) -> settings:
    assert 1 <= max_examples <= MAX_EXAMPLES
    return settings(max_examples=max_examples, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=(HealthCheck.too_slow, HealthCheck.data_too_large))


def check_reference(name: str, got: torch.Tensor, ref: torch.Tensor, budget: float, zero_atol: float = 0.0) -> float:
    """`check_budget`; where the reference has no nonzero element (an empty tensor, keys no query sees, ...) no
    relative error exists: the result must be zero, exactly unless `zero_atol` allows the rounding residue of a
    difference that is zero only in exact arithmetic."""
    assert got.shape == ref.shape, (name, tuple(got.shape), tuple(ref.shape))
    if not ref.detach().to(torch.float64).any():
        g = got.detach().to(torch.float64)
        assert torch.isfinite(g).all() and (g.abs().max().item() if g.numel() else 0.0) <= zero_atol, \
            f"{name}: the reference is 0, got max |x| {g.abs().max().item():.3e} (allowed {zero_atol:.1e})"
        return 0.0
    return check_budget(name, got, ref, budget)


def check_finite(tensors: dict) -> None:
    for name, t in tensors.items():
        assert torch.isfinite(t).all(), f"{name}: not finite for finite inputs"


def check_same_bits(first: dict, again: dict) -> None:
    assert first.keys() == again.keys()
    for name, t in first.items():
        assert torch.equal(t, again[name]), f"{name}: det bits differ on a repeat"
