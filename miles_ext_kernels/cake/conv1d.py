"""conv1d: the short causal depthwise convolution (+SiLU) of linear-attention layers. Torch-free declaration.

Gated DeltaNet and KDA layers run it on their q/k/v projection: kernel width 2..4, no bias, SiLU, over packed
variable-length documents, forward and backward. Selected by `--linear-attention-conv-backend cake`.

    y[t, d] = act( sum_{i < W} weight[d, i] * x[t - W + 1 + i, d] )

where rows before the start of the token's document count as zero, or, given an initial state, are that document's
W-1 rows of it (context parallelism: the previous rank's last rows of a document that continues here).

Variants: `det` (y, dx and dw repeat bit for bit: dw is reduced over token blocks in a fixed order) and `fast`,
which runs the same kernels (an fp32-atomic dw reduction was measured slower than the fixed-order one on the H200),
so both give the same bits.
Option `--cake-conv1d-silu-grad-preactivation {bf16,fp32}` (default bf16): the backward recomputes the
pre-activation from x and weight in fp32; with `bf16` it evaluates SiLU' at that value rounded to bf16 (what
PyTorch's eager `silu(conv1d(x))` in bf16 does, since autograd saves the bf16 conv output), with `fp32` at the
exact fp32 value.
Prebuild parameter: `weight_dtype`, the dtype of the conv weight as a string, "float32" or "bfloat16"
(`cake.prebuild("conv1d", weight_dtype="bfloat16")`); it builds every route of both variants and both options.
"""
from __future__ import annotations

from ._runtime.spec import Flag, OpSpec

WIDTHS = (2, 3, 4)
ACTIVATIONS = (None, "silu", "swish")
WEIGHT_DTYPES = ("float32", "bfloat16")


def _validate(args) -> None:
    """Startup checks: a conv width the kernels serve, when miles' args carry one."""
    width = getattr(args, "linear_conv_kernel_dim", None)
    if width is not None and width not in WIDTHS:
        raise ValueError(f"cake conv1d serves kernel widths {WIDTHS}, got linear_conv_kernel_dim={width}")


OP = OpSpec(
    "conv1d",
    variants=("det", "fast"),
    selected_by=(("linear_attention_conv_backend", "cake"),),
    entry_points=("causal_conv1d",),
    options=(
        Flag("silu_grad_preactivation",
             "backward: evaluate SiLU' at the fp32 pre-activation recomputed from x and weight rounded to bf16 "
             "(bf16, matches PyTorch eager) or exact (fp32)",
             choices=("bf16", "fp32"), default="bf16"),
    ),
    validate=_validate,
    prebuild_params=("weight_dtype",),
    archs=("sm_90a",),
)


def check_supported(*, kernel_size: int = 4, activation: str | None = "silu", has_bias: bool = False,
                    weight_dtype: str = "float32", x_dtype: str = "bfloat16") -> None:
    """Raise ValueError unless the kernels serve this configuration (torch-free; call at model build time).

    kernel_size in (2, 3, 4); activation "silu"/"swish" or None; no bias (a biased layer would silently lose its
    bias); weight_dtype "float32" or "bfloat16"; x_dtype "bfloat16".
    """
    if isinstance(kernel_size, bool) or not isinstance(kernel_size, int) or kernel_size not in WIDTHS:
        raise ValueError(f"kernel_size must be one of {WIDTHS}, got {kernel_size!r}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if has_bias:
        raise ValueError("has_bias=True: cake conv1d has no bias term (the bias would be silently dropped); "
                         "use a bias-free conv or another backend")
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype must be one of {WEIGHT_DTYPES}, got {weight_dtype!r}")
    if x_dtype != "bfloat16":
        raise ValueError(f"x_dtype must be 'bfloat16', got {x_dtype!r}")


def causal_conv1d(x, weight, *, cu_seqlens=None, activation="silu", initial_state=None, cp_context=None):
    """Causal depthwise conv over packed documents, then SiLU (or nothing); differentiable in x, weight and
    initial_state.

    x:          [T, D] bfloat16, packed tokens; may be a column slice of a wider tensor (unit last stride; read in
                place when it starts 16-byte aligned, copied otherwise).
    weight:     [D, W] float32 or bfloat16, W in (2, 3, 4), on x's device (ValueError otherwise).
    cu_seqlens: [N + 1] int32/int64 on x's device, cu_seqlens[0] == 0, non-decreasing, cu_seqlens[-1] <= T
                (document starts; empty documents allowed); None means one document. Rows past cu_seqlens[-1]
                (padding) count as one more document: they never read the last document's rows, nor it theirs.
                Never read on the host (not validated: boundaries that break this give garbage outputs, never a read
                or write outside the tensors).
    activation: "silu" (alias "swish") or None.
    initial_state: None (rows before a document's start are zeros) or [N, D, W] in x's dtype on x's device, fla's
                layout: N the documents of cu_seqlens (1 without it), and initial_state[n, d, W - k] is x[s - k, d]
                for k = 1..W-1, s document n's start (initial_state[n, :, W - 1] the row just before it); entry 0 of
                the last dim is not read (its gradient is 0). Rows past cu_seqlens[-1] (padding) have none. Any
                layout (copied unless contiguous). Its gradient has its shape and dtype; that of an empty document is
                0.
    cp_context: context parallelism (`cake.build_cp_context(cu_seqlens_global, group, conv1d_kernel_size=W,
                layout=...)`) with x the rank's tokens [T_rank, D] in layout order: the documents come from the
                context (cu_seqlens and initial_state must be None); each piece that continues a document on another
                rank reads that document's previous W - 1 inputs (the halo: one all_gather of 2 (W - 1) D bytes per
                piece that continues on another rank, forward, and of the halo's gradient, backward). dweight is this
                rank's partial sum: the caller's data-parallel / CP all-reduce adds them. Eager only.
    Returns y [T, D] bfloat16 (contiguous). The variant (det/fast) and the silu-grad option are read when the call
    runs; the backward runs what its forward read.
    """
    from ._impl import conv1d as impl  # a static import: torch.compile traces it (importlib it cannot)

    return impl.causal_conv1d(x, weight, cu_seqlens=cu_seqlens, activation=activation, initial_state=initial_state,
                              cp_context=cp_context)
