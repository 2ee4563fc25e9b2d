"""Implementation of chunked Kimi Delta Attention (see `cake/kda.py`)."""
from .demo import demo
from .ops import chunk_kda, routes

__all__ = ["chunk_kda", "routes", "demo"]
