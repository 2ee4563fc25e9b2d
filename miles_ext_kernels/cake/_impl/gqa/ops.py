"""`gqa` implementation: operand checks, launchers, autograd.

Layers: kernels.py (@triton.jit) and gluon_*.py (sm_90a) -> launchers `gqa_forward` / `gqa_backward` (allocate, pick
the route, launch through `_runtime.launch.launch`; no autograd) -> `GQA`, the op's `KernelOp` (custom ops
`miles_ext_kernels::gqa_fwd` / `gqa_bwd` under torch.compile, the launchers directly in eager mode) ->
`varlen_gqa_attention`. `routes()` runs the launchers on meta tensors, so prebuild compiles what they launch.
"""
from __future__ import annotations

import functools
import heapq
import math

import torch

from ..._runtime import checks, config, varlen, workspace
from ..._runtime.autograd import KernelOp
from ..._runtime.build import INTERPRET, INTERPRETER_ARCH, cdiv, device_arch
from ..._runtime.launch import arch_of, collect_routes, launch
from ..._runtime.operands import operand
from ...gqa import HEAD_DIM  # the declaration owns the served head dim
from ...gqa import OP as SPEC
from . import configs
from . import kernels as K
from .configs import CONFIGS

try:  # the sm_90a kernels; Gluon has no interpreter, so CPU runs use the Triton kernels
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor

    from . import gluon_bwd as GB
    from . import gluon_fwd as G
except ImportError:  # a triton without Gluon: the Triton kernels everywhere
    G = GB = None

OP = SPEC.name
DEFAULT_SCALE = HEAD_DIM ** -0.5
SCRATCH_ROLE = (OP, "bwd_scratch")


@functools.lru_cache(maxsize=256)
def _order_gain(order: str, n_seg: int, length: int, h_kv: int, group: int, n_sm: int, bn: int, bm: int) -> float:
    """Makespan of the dK/dV programs of `n_seg` documents of `length` tokens in `order` ("pair": a program takes key
    tiles i and n-1-i; "round": tile j of every segment before tile j + 1 of any), over that of the plain order
    (segment by segment, tiles in order, kv heads inner): greedy list schedule on `n_sm` SMs (one program per SM at
    a time), cost = the query blocks a program runs. Only the launch order depends on it, never the bits."""
    n_kt = -(-length // bn)

    def cost(j):
        return group * -(-(length - (j * bn // bm) * bm) // bm) + 1.0

    def makespan(costs):
        sms = [0.0] * n_sm
        heapq.heapify(sms)
        for c in costs:
            heapq.heappush(sms, heapq.heappop(sms) + c)
        return max(sms)

    plain = [cost(j) for _ in range(n_seg) for j in range(n_kt) for _ in range(h_kv)]
    if order == "pair":
        other = [cost(i) + (cost(n_kt - 1 - i) - 1.0 if n_kt - 1 - i != i else 0)
                 for _ in range(n_seg) for i in range(-(-n_kt // 2)) for _ in range(h_kv)]
    else:
        other = [cost(j) for j in range(n_kt) for _ in range(n_seg) for _ in range(h_kv)]
    return makespan(other) / makespan(plain)


def _auto_order(order, B, T_k, max_seqlen_k, H_kv, group, device, bn, bm, gain) -> bool:
    """"auto" for PAIR / ROUND: only on documents that look equal (B * max_seqlen_k within 10 % of T_k, so every
    document is near max_seqlen_k long), at most SCHEDULE_MAX_WAVES programs per SM (more: the tail is short anyway,
    and the model would cost ms), and where the model's makespan drops below `gain`."""
    if max_seqlen_k is None or B < 2 or max_seqlen_k <= 0 or not T_k * 0.9 <= B * max_seqlen_k <= T_k * 1.1:
        return False
    n_sm = torch.cuda.get_device_properties(device).multi_processor_count
    if B * cdiv(max_seqlen_k, bn) * H_kv > configs.SCHEDULE_MAX_WAVES * n_sm:
        return False
    return _order_gain(order, B, max_seqlen_k, H_kv, group, n_sm, bn, bm) < gain


def _use_pair(mode, B, T_k, max_seqlen_k, H_kv, group, device, c) -> bool:
    """PAIR config of the Triton dK/dV kernel: True / False, or "auto" (`_auto_order`)."""
    if mode != "auto":
        return bool(mode)
    return _auto_order("pair", B, T_k, max_seqlen_k, H_kv, group, device, c["BN"], c["BM"], configs.PAIR_GAIN)


def _use_round(mode, B, T_k, max_seqlen_k, H_kv, group, device, c) -> bool:
    """ROUND config of the Gluon dK/dV pass: True / False, or "auto" (`_auto_order`). Needs the caller's
    max_seqlen_k (it sizes the grid) and two segments."""
    if max_seqlen_k is None or B < 2 or max_seqlen_k <= 0:
        return False
    if mode != "auto":
        return bool(mode)
    return _auto_order("round", B, T_k, max_seqlen_k, H_kv, group, device, c["BN"], c["BM"], configs.ROUND_GAIN)


# The kernels form `head * head_stride` and `row_in_tile * token_stride` in int32 (only a tile's first token offset is
# int64): a layout where either reaches 2^31 elements (e.g. a head-major [H, T, D] buffer viewed as [T, H, D] at
# ~0.5M tokens) is copied first. TILE_ROWS bounds the rows of any tile in CONFIGS.
_INT32_LIMIT = 2 ** 31
_TILE_ROWS = 128


def _offsets_fit(t: torch.Tensor) -> bool:
    T, H, _ = t.shape
    st, sh = _strides(t)
    return (H - 1) * sh < _INT32_LIMIT and _TILE_ROWS * st < _INT32_LIMIT


def _ready(t: torch.Tensor, name: str) -> torch.Tensor:
    """A [T, H, D] operand the kernels can read in place: 16-byte aligned start, token and head strides multiples
    of 16 elements (the Triton kernels are specialized on them, the Gluon ones read 16-byte rows), head and in-tile
    row offsets within int32; a contiguous copy otherwise."""
    return operand(t, OP, name, stride_multiple=16, fits=_offsets_fit)


def _strides(t: torch.Tensor):
    """Row strides (token, head) as passed to the kernels; size-1 dims get a canonical stride (any value works)."""
    T, H, _ = t.shape
    return (t.stride(0) if T > 1 else H * HEAD_DIM), (t.stride(1) if H > 1 else HEAD_DIM)


def _gluon_fwd_fits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Gluon forward can read q, k, v as [tokens, heads * D] TMA tensors: at least one token (a
    descriptor has no empty dims), the heads of a token contiguous (head stride D) and rows that do not overlap
    (token stride >= heads * D: not an expanded or overlapping view). Other operands take the Triton forward."""
    for t in (q, k, v):
        T, H, _ = t.shape
        st, sh = _strides(t)
        if T == 0 or sh != HEAD_DIM or st < H * HEAD_DIM:
            return False
    return True


def _gluon_bwd_fits(q, k, v, do) -> bool:
    """Whether the Gluon backward passes can read their operands as TMA tensors (the forward's condition, and dO's)."""
    return _gluon_fwd_fits(q, k, v) and _gluon_fwd_fits(do, k, v)


def _gluon_desc(t: torch.Tensor, rows: int) -> "_GluonDescriptor":
    """TMA descriptor of a [tokens, heads, D] operand (heads of a token contiguous) as [tokens, heads * D], read in
    [rows, D] tiles."""
    st, _ = _strides(t)
    return _GluonDescriptor(t, [t.shape[0], t.shape[1] * HEAD_DIM], [st, 1], [rows, HEAD_DIM], _tile_layout(rows))


@functools.lru_cache(maxsize=8)
def _tile_layout(rows: int):
    """Shared-memory layout of a [rows, HEAD_DIM] bf16 TMA tile (cached: the forward's host path is exposed on small
    calls)."""
    return _gl.NVMMASharedLayout.get_default_for([rows, HEAD_DIM], _gl.bfloat16)


def _cu_ready(cu: torch.Tensor, name: str) -> torch.Tensor:
    return operand(cu, OP, name)  # a 16-byte aligned start: the tile-prefix kernel is specialized on it


def _prefix(cu_a, cu_b, T_a: int, T_b: int, buf: torch.Tensor, tile: int) -> tuple:
    """(safe_a, safe_b, ts): both sides' boundaries clamped (no content makes a kernel leave its tensors; valid
    boundaries unchanged) and the tile prefix of side a, in one launch (`_runtime.varlen.tile_prefix`)."""
    return varlen.tile_prefix(cu_a, cu_b, T_a, T_b, buf, tile, INTERPRET)


# ----------------------------------------------------------------------------------------------------------------
# launchers
def _route_configs(cfg: dict, name: str, gluon: bool, max_seqlen_k: int | None, bound: int) -> tuple[dict, dict | None]:
    """(Triton config, Gluon config or None) of pass `name` ("fwd" or "dq"): the short-document route
    (`<name>_short` / `<name>_gluon_short`: 64-row tiles of one warpgroup) where the Gluon kernel runs and the host's
    max_seqlen_k is at most `bound`, else `<name>` / `<name>_gluon`. Both routes give the same bits (a 64-row tile
    runs the rows of one warpgroup of a 128-row tile, in the same order); the choice depends on host values only."""
    cg = cfg.get(f"{name}_gluon") if gluon else None
    if cg is not None and f"{name}_gluon_short" in cfg and max_seqlen_k is not None and max_seqlen_k <= bound:
        return cfg[f"{name}_short"], cfg[f"{name}_gluon_short"]
    return cfg[name], cg


def gqa_forward(q, k, v, cu_q, cu_k, scale: float, cfg=None, max_seqlen_k: int | None = None):
    """out [T_q, H_q, D] (q's dtype), lse fp32 [H_q, T_q]. Operands already checked; `max_seqlen_k` (host int, or
    None: the long-document route) picks the route; `cfg` overrides the config table (tests and benchmarks)."""
    cfg = cfg or CONFIGS[arch_of(q, "q")]
    q, k, v = _ready(q, "q"), _ready(k, "k"), _ready(v, "v")
    cu_q, cu_k = _cu_ready(cu_q, "cu_seqlens_q"), _cu_ready(cu_k, "cu_seqlens_k")
    T_q, H_q, D = q.shape
    H_kv = k.shape[1]
    B = cu_q.shape[0] - 1
    out = torch.empty((T_q, H_q, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((H_q, T_q), dtype=torch.float32, device=q.device)
    c, cg = _route_configs(cfg, "fwd", G is not None and not INTERPRET and _gluon_fwd_fits(q, k, v), max_seqlen_k,
                           configs.SHORT_MAX_SEQLEN_K)
    upper = cdiv(T_q, c["BM"]) + B
    if upper * H_q == 0:
        return out, lse
    buf = torch.empty(3 * varlen.bounds_buffer(B + 1), dtype=torch.int32, device=q.device)
    cu_q, cu_k, ts = _prefix(cu_q, cu_k, T_q, k.shape[0], buf, c["BM"])
    n_prog = upper * H_q
    runtime = dict(O=out, LSE=lse, CU_Q=cu_q, CU_K=cu_k, TS=ts, sm_scale=float(scale), T_q=T_q, n_seg=B,
                   n_iter=B.bit_length(), H_q=H_q, group=H_q // H_kv, sot=out.stride(0), soh=out.stride(1))
    sqt, sqh = _strides(q)
    skt, skh = _strides(k)
    svt, svh = _strides(v)
    strided = dict(Q=q, K=k, V=v, sqt=sqt, sqh=sqh, skt=skt, skh=skh, svt=svt, svh=svh, D=D, BM=c["BM"], BN=c["BN"],
                   DIAG_ONLY=c.get("DIAG_ONLY", False), INTERPRET=INTERPRET, num_warps=c["num_warps"],
                   num_stages=c["num_stages"])
    if cg is not None:
        assert cg["BM"] == c["BM"] and cg["BN"] == c["BN"]  # the tile prefix and the second pass count these tiles
        rows = 64  # Q and the output move in the warpgroups' 64-row parts of the tile
        descs = dict(q_desc=_gluon_desc(q, rows), k_desc=_gluon_desc(k, cg["BN"]), v_desc=_gluon_desc(v, cg["BN"]),
                     o_desc=_gluon_desc(out, rows))
        if cg.get("SELF_LOADING"):  # one warpgroup that issues its own loads (gluon_fwd.fwd_short_kernel)
            launch(G.fwd_short_kernel, (n_prog,), **descs, **runtime, D=D, BM=cg["BM"], BN=cg["BN"],
                   num_warps=cg["num_warps"])
        else:
            launch(G.fwd_kernel, (n_prog,), **descs, **runtime, D=D, BM=cg["BM"], BN=cg["BN"], STAGES=cg["STAGES"],
                   num_warps=cg["num_warps"], maxnreg=cg["maxnreg"])
    else:
        launch(K._fwd_kernel, (n_prog,), **runtime, **strided)
    # tiles with a non-finite row (LSE NaN), again with non-finite V rows kept from the rows that mask their key out
    ch = configs.FIX_CHUNK
    launch(K._fwd_fix_kernel, (min(cdiv(H_q * T_q, ch), _fix_programs(q.device)),), **runtime, **strided, CH=ch)
    return out, lse


@functools.lru_cache(maxsize=16)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _fix_programs(device: torch.device) -> int:
    """Programs of the second forward pass: one per SM (a persistent grid: a clean chunk of LSE costs one load)."""
    if device.type != "cuda":
        return configs.FIX_PROGRAMS_OFF_GPU
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _align(n: int) -> int:
    return cdiv(n, 256) * 256


def gqa_backward(do, q, k, v, out, lse, cu_q, cu_k, scale: float, variant: str, cfg=None,
                 parts=("dkdv", "dq"), max_seqlen_k=None, pair=None, rounds=None):
    """(dq, dk, dv) in the dtypes of q, k, v. Both variants run these kernels (no atomics). `cfg` and `parts`
    override the config (tests and benchmarks); `pair` / `rounds` force the dK/dV launch order (routes() planning;
    otherwise the config's, "auto" deciding per call from host shapes). `max_seqlen_k` (the caller's contract) lets
    the dK/dV launch pair key tiles (Triton) or run in rounds (Gluon); neither changes the bits, whatever value is
    given."""
    cfg = cfg or CONFIGS[arch_of(q, "q")]
    q, k, v, do, out = _ready(q, "q"), _ready(k, "k"), _ready(v, "v"), _ready(do, "dout"), _ready(out, "out")
    cu_q, cu_k = _cu_ready(cu_q, "cu_seqlens_q"), _cu_ready(cu_k, "cu_seqlens_k")
    T_q, H_q, D = q.shape
    T_k, H_kv = k.shape[:2]
    group = H_q // H_kv
    B = cu_q.shape[0] - 1
    dq = torch.empty((T_q, H_q, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((T_k, H_kv, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((T_k, H_kv, D), dtype=v.dtype, device=v.device)
    ckv = cfg["dkdv"]
    # one scratch buffer: [delta fp32 H_q * T_q] [boundaries + tile prefix, q pass] [boundaries + tile prefix, k pass]
    n_delta = _align(H_q * T_q * 4)
    n_ts = _align(3 * varlen.bounds_buffer(B + 1) * 4)
    scratch = workspace.take(SCRATCH_ROLE, n_delta + 2 * n_ts, device=q.device)
    delta = scratch[:n_delta].view(torch.float32)
    buf_q = scratch[n_delta:n_delta + n_ts].view(torch.int32)
    buf_k = scratch[n_delta + n_ts:].view(torch.int32)
    cu_q_raw, cu_k_raw = cu_q, cu_k
    sqt, sqh = _strides(q)
    skt, skh = _strides(k)
    svt, svh = _strides(v)
    sdt, sdh = _strides(do)
    gluon_bwd = GB is not None and not INTERPRET and _gluon_bwd_fits(q, k, v, do)
    cq, cgq = _route_configs(cfg, "dq", gluon_bwd, max_seqlen_k, configs.SHORT_DQ_MAX_SEQLEN_K)
    # dQ first: its kernel also writes delta = rowsum(dO * O), which the dK/dV kernel reads
    upper_q = cdiv(T_q, cq["BM"]) + B
    if upper_q * H_q > 0 and "dq" in parts:
        cu_q, cu_k, ts_q = _prefix(cu_q_raw, cu_k_raw, T_q, T_k, buf_q, cq["BM"])
        runtime = dict(O=out, LSE=lse, DELTA=delta, DQ=dq, CU_Q=cu_q, CU_K=cu_k, TS=ts_q, sm_scale=float(scale),
                       T_q=T_q, n_seg=B, n_iter=B.bit_length(), H_q=H_q, group=group, sot=_strides(out)[0],
                       soh=_strides(out)[1], sdqt=dq.stride(0), sdqh=dq.stride(1))
        if cgq is not None:
            assert cgq["BM"] == cq["BM"]  # the tile prefix above counts tiles of BM rows
            launch(GB.dq_kernel, (upper_q * H_q,), q_desc=_gluon_desc(q, cgq["BM"]), k_desc=_gluon_desc(k, cgq["BN"]),
                   v_desc=_gluon_desc(v, cgq["BN"]), do_desc=_gluon_desc(do, cgq["BM"]), **runtime, D=D,
                   BM=cgq["BM"], BN=cgq["BN"], num_warps=cgq["num_warps"])
        else:
            launch(K._bwd_dq_kernel, (upper_q * H_q,), Q=q, K=k, V=v, DO=do, **runtime, sqt=sqt, sqh=sqh, skt=skt,
                   skh=skh, svt=svt, svh=svh, sdt=sdt, sdh=sdh, D=D, BM=cq["BM"], BN=cq["BN"], INTERPRET=INTERPRET,
                   num_warps=cq["num_warps"], num_stages=cq["num_stages"])
    cg = cfg.get("dkdv_gluon")
    gluon = cg is not None and gluon_bwd and "dkdv" in parts
    if pair is None:
        pair = "dkdv" in parts and not gluon and _use_pair(ckv.get("PAIR", False), B, T_k, max_seqlen_k, H_kv, group,
                                                           q.device, ckv)
    if rounds is None:
        rounds = gluon and _use_round(cg.get("ROUND", False), B, T_k, max_seqlen_k, H_kv, group, q.device, cg)
    pair, rounds = pair and not gluon, rounds and gluon  # PAIR is the Triton kernel's order, ROUND the Gluon one's
    tile_k = (cg["BN"] if gluon else ckv["BN"]) * (2 if pair else 1)  # PAIR: the prefix counts pairs of key tiles
    # ROUND: n_kt_max programs per segment first (the grid's size only: the Gluon kernel's per-tile programs that
    # follow cover any tile past them, so an understated max_seqlen_k changes the order, never the result)
    n_kt_max = cdiv(max_seqlen_k, tile_k) if rounds else 0
    upper_k = n_kt_max * B + cdiv(T_k, tile_k) + B
    if upper_k * H_kv > 0 and "dkdv" in parts:
        cu_k, cu_q, ts_k = _prefix(cu_k_raw, cu_q_raw, T_k, T_q, buf_k, tile_k)
        runtime = dict(LSE=lse, DELTA=delta, DK=dk, DV=dv, CU_Q=cu_q, CU_K=cu_k, TS=ts_k, sm_scale=float(scale),
                       T_q=T_q, T_k=T_k, n_seg=B, n_iter=B.bit_length(), H_kv=H_kv, group=group, sdkt=dk.stride(0),
                       sdkh=dk.stride(1), sdvt=dv.stride(0), sdvh=dv.stride(1))
        if gluon:
            launch(GB.dkdv_kernel, (upper_k * H_kv,), q_desc=_gluon_desc(q, cg["BM"]), k_desc=_gluon_desc(k, cg["BN"]),
                   v_desc=_gluon_desc(v, cg["BN"]), do_desc=_gluon_desc(do, cg["BM"]), **runtime, n_kt_max=n_kt_max,
                   D=D, BM=cg["BM"], BN=cg["BN"], num_warps=cg["num_warps"], maxnreg=cg["maxnreg"])
        else:
            launch(K._bwd_dkdv_kernel, (upper_k * H_kv,), Q=q, K=k, V=v, DO=do, **runtime, sqt=sqt, sqh=sqh,
                   skt=skt, skh=skh, svt=svt, svh=svh, sdt=sdt, sdh=sdh, D=D, BM=ckv["BM"], BN=ckv["BN"],
                   S_ROWS=ckv.get("S_ROWS", False), INTERPRET=INTERPRET, PAIR=pair, num_warps=ckv["num_warps"],
                   num_stages=ckv["num_stages"])
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------------
# autograd: one KernelOp (eager: the launchers; torch.compile: the custom ops gqa_fwd / gqa_bwd)
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
             cu_seqlens_k: torch.Tensor, softmax_scale: float, max_seqlen_k: int,
             variant: str) -> tuple[torch.Tensor, torch.Tensor]:
    # out and LSE: one kernel, both variants
    return gqa_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, max_seqlen_k=max_seqlen_k)


def _forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, max_seqlen_k, variant):
    T_q, H_q, D = q.shape
    return q.new_empty((T_q, H_q, D)), q.new_empty((H_q, T_q), dtype=torch.float32)


def _setup(inputs, res):
    q, k, v, cu_q, cu_k, scale, max_seqlen_k, variant = inputs
    out, lse = res
    return (q, k, v, out, lse, cu_q, cu_k), (scale, max_seqlen_k, variant)


def _backward(dout: torch.Tensor | None, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              out: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
              softmax_scale: float, max_seqlen_k: int,
              variant: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if dout is None:  # only the LSE reached the loss: it is not differentiable, so every gradient is 0
        dout = torch.zeros_like(out)
    return gqa_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, variant,
                        max_seqlen_k=max_seqlen_k)


def _backward_fake(dout, dlse, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, max_seqlen_k, variant):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


GQA = KernelOp(OP, forward=_forward, forward_fake=_forward_fake, setup=_setup, backward=_backward,
               backward_fake=_backward_fake, grad_inputs=(0, 1, 2), n_outputs=2, non_differentiable=(1,))


# ----------------------------------------------------------------------------------------------------------------
# routes: the launchers above, run on meta tensors, record every specialization a call can launch
def routes(**model_params):
    """The kernel routes of gqa on the current device's arch (head dim fixed at 256: no model parameters): both
    variants (same kernels), the Gluon route (heads of a token contiguous) and the Triton route (wider head stride),
    the forward's and the dQ pass's long- and short-document routes, int32 and int64 cu_seqlens, both dK/dV launch
    orders."""
    if model_params:
        raise TypeError(f"gqa routes take no model parameters, got {sorted(model_params)}")
    arch = INTERPRETER_ARCH if INTERPRET else device_arch()
    meta, bf = "meta", torch.bfloat16
    with collect_routes(arch) as rs:
        for cu_dtype in (torch.int32, torch.int64):
            cu = torch.empty(3, dtype=cu_dtype, device=meta)
            for head_stride in (HEAD_DIM, 2 * HEAD_DIM):  # heads of a token contiguous (Gluon on sm_90a), or not
                q = torch.empty(4096, 2, head_stride, dtype=bf, device=meta)[:, :, :HEAD_DIM]
                k = v = torch.empty(4096, 1, HEAD_DIM, dtype=bf, device=meta)
                for max_seqlen_k in (2048, configs.SHORT_MAX_SEQLEN_K):  # long and short documents
                    out, lse = gqa_forward(q, k, v, cu, cu, DEFAULT_SCALE, max_seqlen_k=max_seqlen_k)
                for pair, rounds in ((False, False), (True, False), (False, True)):
                    gqa_backward(q, q, k, v, out, lse, cu, cu, DEFAULT_SCALE, "det", max_seqlen_k=2048, pair=pair,
                                 rounds=rounds)
                # the dQ pass's short-document route (the dK/dV orders above need long documents)
                gqa_backward(q, q, k, v, out, lse, cu, cu, DEFAULT_SCALE, "det", max_seqlen_k=1, parts=("dq",))
    return rs.routes


# ----------------------------------------------------------------------------------------------------------------
# operand checks
def _check_operands(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale, return_lse):
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t, dtype=torch.bfloat16, ndim=3, last_stride_one=True)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        checks.check_tensor(name, t, dtype=(torch.int32, torch.int64), ndim=1, last_stride_one=True)
    checks.check_same_device([("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                              ("cu_seqlens_k", cu_seqlens_k)])
    arch_of(q, "q")
    T_q, H_q, D = q.shape
    T_k, H_kv, D_k = k.shape
    if D != HEAD_DIM:
        raise ValueError(f"q: head dim must be {HEAD_DIM}, got shape {tuple(q.shape)}")
    if D_k != HEAD_DIM:
        raise ValueError(f"k: head dim must be {HEAD_DIM}, got shape {tuple(k.shape)}")
    if tuple(v.shape) != tuple(k.shape):
        raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if H_q == 0 or H_kv == 0:
        raise ValueError(f"q and k need at least one head, got H_q={H_q}, H_kv={H_kv}")
    if H_q % H_kv:
        raise ValueError(f"q's heads ({H_q}) must be a multiple of k's heads ({H_kv})")
    if cu_seqlens_q.shape[0] < 1:
        raise ValueError("cu_seqlens_q must hold at least one entry (B + 1 boundaries)")
    if cu_seqlens_k.dtype != cu_seqlens_q.dtype:
        raise TypeError(f"cu_seqlens_k must have cu_seqlens_q's dtype {cu_seqlens_q.dtype}, got {cu_seqlens_k.dtype}")
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(f"cu_seqlens_k must have cu_seqlens_q's shape {tuple(cu_seqlens_q.shape)}, got "
                         f"{tuple(cu_seqlens_k.shape)}")
    checks.check_host_int("max_seqlen_k", max_seqlen_k, minimum=0)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")


def check_seqlens(cu_seqlens_q, cu_seqlens_k, T_q: int, T_k: int, max_seqlen_k: int) -> None:
    """Validate the boundaries on the host (one device sync). ValueError naming the argument."""
    checks.check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, T_q)
    c = checks.check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, T_k)
    if c.shape[0] > 1:
        longest = int((c[1:] - c[:-1]).max())
        if longest > max_seqlen_k:
            raise ValueError(f"max_seqlen_k={max_seqlen_k} but a segment has {longest} keys")


def varlen_gqa_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_k, softmax_scale=None,
                         return_lse=False):
    """See `miles_ext_kernels.cake.gqa.varlen_gqa_attention`."""
    _check_operands(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale, return_lse)
    if config.option(OP, "check_seqlens"):
        check_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_k)
    scale = DEFAULT_SCALE if softmax_scale is None else float(softmax_scale)
    out, lse = GQA(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, int(max_seqlen_k))
    return (out, lse) if return_lse else out
