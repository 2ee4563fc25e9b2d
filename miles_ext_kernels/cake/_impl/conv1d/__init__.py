"""Implementation of the cake op conv1d (see `miles_ext_kernels.cake.conv1d`)."""
from .demo import demo
from .ops import causal_conv1d, routes

__all__ = ["causal_conv1d", "routes", "demo"]
