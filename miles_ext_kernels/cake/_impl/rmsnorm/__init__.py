"""Implementation of the zero-centred RMSNorm (see `cake/rmsnorm.py`)."""
from .demo import demo
from .ops import ZeroCenteredRMSNorm, routes, zero_centered_rmsnorm

__all__ = ["ZeroCenteredRMSNorm", "zero_centered_rmsnorm", "routes", "demo"]
