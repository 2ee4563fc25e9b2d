"""What gdn's and kda's ops.py share outside their launchers: the config readers bound to one op, the operand checks
both make (in the order both make them), and the sizes their fake forwards and their `routes()` start from.

Both ops launch the same kernels in either variant: no kernel uses atomics and every split sum is added in one
fixed order, so `fast` is `det`. Launch configs: each op's configs.py (fixed per arch). Every launch goes through
`_runtime.launch.launch`; each op's `routes()` runs its launchers on meta tensors, so prebuild compiles exactly what
they launch.
"""
from __future__ import annotations

import math
from functools import partial

import torch

from miles_ext_kernels.cake._runtime import build
from miles_ext_kernels.cake._runtime.checks import check_same_device, check_tensor

from . import common
from . import launchers as core

CU_DTYPES = (torch.int32, torch.int64)


def bind(op: str, cm) -> tuple:
    """(cfg, state_cfg, dqkw_cfg, rows_cfg, ws, c) of op `op` whose configs module is `cm` (read when a call runs):
    cfg(tab, name) launch options; state_cfg(tab, name, V, seq_heads) (config name, BV) of a state kernel;
    dqkw_cfg(tab, phase); rows_cfg(tab, name) BR and launch options; ws(role, shape, dtype, device) scratch;
    c(x, name) x contiguous and 16-byte aligned."""
    cfg = partial(core.launch_opts, cm=cm)

    def rows_cfg(tab: dict, name: str) -> dict:
        return dict(BR=tab[name]["BR"], **cfg(tab, name))

    def dense(x: torch.Tensor, name: str) -> torch.Tensor:
        """Contiguous and 16-byte aligned (the kernels index rows densely and are specialized on aligned
        pointers)."""
        return core.dense(x, op, name)

    return (cfg, partial(core.state_cfg, cm=cm), partial(core.dqkw_opts, cm=cm), rows_cfg,
            partial(core.scratch, op), dense)


# ----------------------------------------------------------------------------------------------------------------
# checks
def check_flags(pairs) -> None:
    """Each (name, value) of `pairs` a bool (TypeError otherwise)."""
    for name, flag in pairs:
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")


def check_optional_float(name: str, value) -> None:
    """None, an int or a float (not a bool): TypeError otherwise."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise TypeError(f"{name} must be a float or None, got {type(value).__name__}")


def check_operands(q, k, v, g, beta, scale, *, head_dims, in_dtypes, g_dtypes, beta_dtypes, gate_per_key: bool):
    """q, k `[B, T, H, K]`, v `[B, T, HV, V]` (HV a multiple of H, K and V in `head_dims`), g `[B, T, HV]` (with
    `gate_per_key`: `[B, T, HV, K]`), beta `[B, T, HV]`, at least one token, scale None or finite.
    Returns (B, T, H, K, HV, V)."""
    check_tensor("q", q, dtype=in_dtypes, ndim=4)
    check_tensor("k", k, dtype=in_dtypes, ndim=4)
    check_tensor("v", v, dtype=in_dtypes, ndim=4)
    check_tensor("g", g, dtype=g_dtypes, ndim=4 if gate_per_key else 3)
    check_tensor("beta", beta, dtype=beta_dtypes, ndim=3)
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, H, K = q.shape
    if v.shape[0] != B or v.shape[1] != T:
        raise ValueError(f"v must be [B, T, HV, V] = [{B}, {T}, HV, V], got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if H < 1 or HV < 1 or HV % H != 0:
        raise ValueError(f"v's head count HV={HV} must be a positive multiple of q/k's head count H={H}")
    if K not in head_dims:
        raise ValueError(f"q/k head dim K={K} is not served (served: {head_dims})")
    if V not in head_dims:
        raise ValueError(f"v head dim V={V} is not served (served: {head_dims})")
    g_shape, g_dims = ((B, T, HV, K), "[B, T, HV, K]") if gate_per_key else ((B, T, HV), "[B, T, HV]")
    if tuple(g.shape) != g_shape:
        raise ValueError(f"g must be {g_dims} = {g_shape}, got {tuple(g.shape)}")
    if tuple(beta.shape) != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    if T < 1 or B < 1:
        raise ValueError(f"q must hold at least one token, got shape {tuple(q.shape)}")
    per_token = HV * max(K, V, common.BT)  # elements of the widest per-token buffer ([T, HV, K | V | chunk])
    if B * T * per_token >= 2 ** 31:
        raise ValueError(f"q holds B * T = {B * T} tokens: at HV={HV}, K={K}, V={V} the per-token buffers would "
                         f"hold {B * T * per_token} elements, past the kernels' 32-bit offsets (2**31); split the "
                         f"call (at most {(2 ** 31 - 1) // per_token} tokens)")
    check_optional_float("scale", scale)
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return B, T, H, K, HV, V


def check_packing(q, cu_seqlens, initial_state, named: list, HV: int, K: int, V: int, *, state_dtypes,
                  transpose_state: bool = False) -> int:
    """cu_seqlens (None, or int32 / int64 `[N + 1]` with B = 1; checked in full when it and q are host tensors),
    initial_state (None or `[N, HV, K, V]`, `[N, HV, V, K]` with `transpose_state`) and one device for all of
    `named` (which gains them). Returns N."""
    B, T = q.shape[0], q.shape[1]
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, dtype=CU_DTYPES, ndim=1)
        if B != 1:
            raise ValueError(f"with cu_seqlens the batch size must be 1 (packed documents), got B={B}")
        if cu_seqlens.numel() < 2:
            raise ValueError("cu_seqlens must hold at least 2 offsets ([0, ..., T])")
        if cu_seqlens.device.type == "cpu" and q.device.type == "cpu" and not torch.compiler.is_compiling():
            cu = cu_seqlens.tolist()  # host tensor next to host data (interpreter): cheap to check fully
            if cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu[:-1], cu[1:])):
                raise ValueError(f"cu_seqlens must rise from 0 to T={T}, got {cu}")
        named.append(("cu_seqlens", cu_seqlens))
        N = cu_seqlens.numel() - 1
    else:
        N = B
    if initial_state is not None:
        check_tensor("initial_state", initial_state, dtype=state_dtypes, ndim=4)
        want = (N, HV, V, K) if transpose_state else (N, HV, K, V)
        if tuple(initial_state.shape) != want:
            lay = "[N, HV, V, K]" if transpose_state else "[N, HV, K, V]"
            raise ValueError(f"initial_state must be {lay} = {want}, got {tuple(initial_state.shape)}")
        named.append(("initial_state", initial_state))
    check_same_device(named)
    build.check_device(q, "q")
    return N


# ----------------------------------------------------------------------------------------------------------------
# sizes of the fake forwards and of routes()
def fake_sizes(q, v, cu_seqlens) -> tuple:
    """(B, T, H, K, HV, V, N, B T, P) of a forward: N sequences, P chunk slots (as `launchers.chunk_setup`)."""
    B, T, H, K = q.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return B, T, H, K, v.shape[2], v.shape[3], N, B * T, build.cdiv(B * T, common.BT) + N


def route_arch(head_k_dim: int, head_v_dim: int, head_dims) -> str:
    """The arch routes() records its launches for (the interpreter's, or the device's), once the head dims are
    checked."""
    if head_k_dim not in head_dims or head_v_dim not in head_dims:
        raise ValueError(f"head dims must be in {head_dims}, got head_k_dim={head_k_dim}, head_v_dim={head_v_dim}")
    return build.INTERPRETER_ARCH if core.INTERPRET else build.device_arch()


def route_operands(n_seq: int, cu_dtype, H: int, HV: int, K: int, V: int) -> tuple:
    """(cu, B, Tb, q, v) on the meta device for `n_seq` sequences of one chunk each: B sequences of Tb tokens, or
    with `cu_dtype` one pack of n_seq documents (cu_seqlens `cu`)."""
    meta = dict(device="meta")
    T = common.BT * n_seq
    cu = None if cu_dtype is None else torch.empty(n_seq + 1, dtype=cu_dtype, **meta)
    B = n_seq if cu is None else 1
    Tb = T // B
    return (cu, B, Tb, torch.empty(B, Tb, H, K, dtype=torch.bfloat16, **meta),
            torch.empty(B, Tb, HV, V, dtype=torch.bfloat16, **meta))
