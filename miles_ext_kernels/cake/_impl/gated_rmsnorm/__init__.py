"""Implementation of the gated RMSNorm RMSNorm(x) * w * SiLU(z) (see `cake/gated_rmsnorm.py`)."""
from .demo import demo
from .ops import rmsnorm_silu_gate, routes

__all__ = ["rmsnorm_silu_gate", "routes", "demo"]
