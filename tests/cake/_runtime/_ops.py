"""Synthetic op declarations for the runtime tests (torch-free)."""
from miles_ext_kernels.cake._runtime.spec import Flag, OpSpec


def _validate(args):
    if getattr(args, "synthetic_heads", 1) < 1:
        raise ValueError("synthetic op: heads must be >= 1")


SYNTHETIC = OpSpec(
    "synthetic",
    selected_by=(("synthetic_backend", "cake"),),
    entry_points=("axpb", "which_variant"),
    options=(Flag("check_inputs", "check inputs before launch"),
             Flag("precision", "accumulation precision", choices=("bf16", "fp32"))),
    validate=_validate,
    prebuild_params=("width",),
    impl_path="tests.cake._runtime._synthetic",
)

FAST_ONLY = OpSpec(
    "fastonly",
    variants=("fast",),
    selected_by=(("fastonly_backend", "cake"),),
    impl_path="tests.cake._runtime._synthetic",
)

DET_CLI_ONLY = OpSpec(  # ships both, but miles' command line may only pick det: the variant flag is hidden
    "detcli",
    cli_variants=("det",),
    selected_by=(("detcli_backend", "cake"),),
    impl_path="tests.cake._runtime._synthetic",
)
