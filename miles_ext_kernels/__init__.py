"""miles_ext_kernels: training kernels for the miles RL framework's hybrid models (Megatron backend), on Hopper.

The four hooks miles calls (torch-free: importing this package imports neither torch nor triton):

    add_arguments(parser)   add every op's selector, variant and option flags, and the workspace pool bound
    validate_args(args)     resolve each selected op's variant (written back onto args) and check the flags
    configure(args=None, *, deterministic_mode=False, workspace_pool_bytes=0, **per_op)
                            replace the process' configuration (miles: configure(args); direct callers:
                            configure(gqa_variant="fast"); configure() resets to defaults)
    release()               free pooled workspace memory and prebuild records; returns bytes freed

The ops live in `miles_ext_kernels.cake` (see its docstring and README.md).
"""
from .cake._runtime.config import add_arguments, configure, release, validate_args

SOURCES = ("cake",)
__version__ = "0.1.0"

__all__ = ["SOURCES", "add_arguments", "validate_args", "configure", "release", "__version__"]
