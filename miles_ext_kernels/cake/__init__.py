"""cake: the kernels miles selects with `... cake` backends, on one shared runtime. Torch-free at import.

    OPS                     the shipped ops' declarations (OpSpec), in order
    op_spec(name)           one op's declaration
    prebuild(op, ...)       compile every kernel route of an op for a device (see _runtime/build.py)
    no_build()              context manager: any Triton code generation inside raises RuntimeError
    release(op=None)        forget prebuild records, free the workspace pool; returns bytes freed
    device_arch(device)     "sm_90a" for an H100/H200; NotImplementedError for a GPU no op serves
    ARCH_BY_CAPABILITY      {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}
    build_cp_context(...)   the context parallelism plan of one step, for gdn / kda / conv1d's `cp_context=`

Each op's public functions are importable from its declaration module (`cake.gqa.varlen_gqa_attention`) and
from here (`cake.varlen_gqa_attention`); the implementation (torch, triton) loads on first call.
"""
from ._runtime.registry import OPS, op_spec, prebuild, release
from ._runtime.spec import ARCH_BY_CAPABILITY


def device_arch(device=None) -> str:
    from ._runtime import build

    return build.device_arch(device)


def build_cp_context(cu_seqlens_global, group, *, conv1d_kernel_size=None, layout="contiguous",
                     state_exchanges=None):
    """The context-parallel (CP) plan of one step, for `cp_context=` of gdn, kda and conv1d (build it once per step,
    pass it to every layer).

    - cu_seqlens_global: int32 / int64 `[N + 1]` of the whole packed stream (host or device: read on the host once,
      here).
    - group: a torch.distributed process group (NCCL for GPU tensors; gloo runs CPU tensors).
    - layout="contiguous": rank r holds tokens [r T / W, (r + 1) T / W) (T % W == 0, else ValueError);
      layout="zigzag": Megatron's THD CP layout: every document cut in 2W equal chunks, rank r holds chunks r and
      2W - 1 - r of each document, documents in order (each length a multiple of 2W, else ValueError).
      Documents may straddle ranks anywhere.
    - conv1d_kernel_size: the width W_conv of the conv1d calls that will use the context (their halo is the last
      W_conv - 1 inputs of a document before a rank's piece).
    - state_exchanges: all_gathers per pass of gdn / kda (None: 2 for zigzag, 1 for contiguous). A piece in a
      document's middle either runs one extra state pass before the exchange (its transition from a zero start) or
      waits for its true incoming state; with E exchanges up to E - 1 middle pieces per document wait (the longest
      first: under zigzag, rank W - 1's piece), which saves their extra pass and puts their own pass between two
      exchanges. More exchanges: less compute, a longer chain of dependent steps across ranks.
    The ops then take the rank's tokens (B = 1, in layout order) with `cp_context=ctx`; `ctx.cu_seqlens` are the
    rank's pieces as local documents. Each layer call runs a fixed number of all_gathers sized by states / halos
    (never by T) and no host sync; det bits repeat for a given (layout, W,
    cu_seqlens_global, state_exchanges).
    """
    from ._runtime import cp

    return cp.build_cp_context(cu_seqlens_global, group, conv1d_kernel_size=conv1d_kernel_size, layout=layout,
                               state_exchanges=state_exchanges)


def no_build():
    from ._runtime import build

    return build.no_build()


def __getattr__(name):
    for spec in OPS:
        if name in spec.entry_points:
            import importlib

            return getattr(importlib.import_module(f"{__name__}.{spec.name}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["OPS", "op_spec", "prebuild", "no_build", "release", "device_arch", "ARCH_BY_CAPABILITY",
           "build_cp_context"] + [
    e for s in OPS for e in s.entry_points]
