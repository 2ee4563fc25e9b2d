"""Implementation of packed causal GQA attention, head dim 256 (see `cake/gqa.py`)."""
from .demo import demo
from .ops import routes, varlen_gqa_attention

__all__ = ["varlen_gqa_attention", "routes", "demo"]
