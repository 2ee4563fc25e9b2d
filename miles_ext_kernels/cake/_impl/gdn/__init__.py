"""Implementation of the chunked Gated DeltaNet (see `cake/gdn.py`)."""
from .demo import demo
from .ops import chunk_gated_delta_rule, routes

__all__ = ["chunk_gated_delta_rule", "routes", "demo"]
