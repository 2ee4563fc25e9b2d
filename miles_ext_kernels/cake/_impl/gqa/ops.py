"""`gqa` implementation: operand checks, launchers, torch.library custom ops (+ fakes) and autograd.

Layers: kernels.py (@triton.jit) -> launchers `gqa_forward` / `gqa_backward` (allocate, grid, no autograd) ->
custom ops `miles_ext_kernels::gqa_fwd` / `gqa_bwd` with autograd registered (traced by torch.compile) and `_GQAFn`
(a plain autograd.Function: eager calls) -> `varlen_gqa_attention`.
"""
from __future__ import annotations

import functools
import heapq
import math

import torch
from torch.autograd.function import once_differentiable

from ..._runtime import checks, config, varlen, workspace
from ..._runtime.build import INTERPRET, INTERPRETER_ARCH, cdiv, check_device, device_guard
from ...gqa import HEAD_DIM  # the declaration owns the served head dim
from . import kernels as K

try:  # the sm_90a forward; Gluon has no interpreter, so CPU runs use the Triton forward
    from triton.experimental.gluon import language as _gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as _GluonDescriptor

    from . import gluon_bwd as GB
    from . import gluon_fwd as G
except ImportError:  # a triton without Gluon: the Triton kernels everywhere
    G = GB = None

OP_NAME = "gqa"
DEFAULT_SCALE = HEAD_DIM ** -0.5

# Fixed configs per arch (no runtime autotune: a new process picks the same config, hence the same bits).
# Nothing here depends on T or B, so a document's bits do not depend on the pack it sits in.
CONFIGS = {
    "sm_90a": {
        # DIAG_ONLY: the causal mask is computed only for key blocks on the diagonal (a branch, not a second loop)
        "fwd": dict(BM=128, BN=64, num_warps=8, num_stages=2, DIAG_ONLY=True),
        # the Gluon forward (gluon_fwd.py: a TMA loader warp and one partition per 64-row warpgroup; 4 warps is the
        # default partition of a 12-warp CTA, 168 registers a thread before reallocation, then 240 for each
        # warpgroup and 24 for the loader's) with the same BM, BN and the same bits; operands whose heads are not
        # contiguous within a row take the Triton forward above
        "fwd_gluon": dict(BM=128, BN=64, num_warps=4, maxnreg=168),
        "dq": dict(BM=128, BN=64, num_warps=8, num_stages=1),
        # the Gluon dQ pass (gluon_bwd.py): same tiles; operands the Gluon forward cannot read take "dq" above
        "dq_gluon": dict(BM=128, BN=64, num_warps=8),
        # S = Q K^T with 128 query rows as M: both warpgroups share the work (a 64-row M replicates it)
        # PAIR "auto": programs take key tiles i and n-1-i of a segment where a model of the schedule says it
        # shortens it (near-equal documents, few programs per SM); the bits are the same either way
        "dkdv": dict(BM=128, BN=64, num_warps=8, num_stages=1, S_ROWS=True, PAIR="auto"),
        # the Gluon dK/dV pass (gluon_bwd.py: a TMA loader warp and two warpgroups, one per accumulator); 4 warps
        # is its default partition (the CTA has 12 warps: 4 + 4 + the loader's warpgroup; 168 registers a thread
        # before reallocation, then 240 for each compute warpgroup and 24 for the loader's). Operands the Gluon
        # forward cannot read take "dkdv" above
        # ROUND "auto": on near-equal documents, tile j of every segment runs before tile j + 1 of any (the heaviest
        # tiles of the last segments no longer start last); the order of programs only, never the bits
        "dkdv_gluon": dict(BM=64, BN=64, num_warps=4, maxnreg=168, ROUND="auto"),
        "delta": dict(BR=32, num_warps=4, num_stages=1),
        "cast": dict(BLOCK=4096, num_warps=4, num_stages=1),
    },
    # the interpreter (CPU tests): small blocks so tiny shapes still cross tile and mask boundaries
    INTERPRETER_ARCH: {
        "fwd": dict(BM=16, BN=16, num_warps=4, num_stages=1, DIAG_ONLY=True),
        "dq": dict(BM=16, BN=16, num_warps=4, num_stages=1),
        "dkdv": dict(BM=16, BN=16, num_warps=4, num_stages=1, S_ROWS=True, PAIR=True),
        "delta": dict(BR=16, num_warps=4, num_stages=1),
        "cast": dict(BLOCK=1024, num_warps=4, num_stages=1),
    },
}

# fast variant: dQ summed with fp32 atomics inside the dK/dV kernel (False: fast runs the det kernels)
FAST_FUSED_DQ = {"sm_90a": False, INTERPRETER_ARCH: False}

SCRATCH_ROLE = (OP_NAME, "bwd_scratch")
SCHEDULE_MAX_WAVES = 12  # "auto" orders are modelled only up to this many dK/dV programs per SM
# PAIR "auto" pairs only where the model's makespan drops below this fraction: on the H200 the paired kernel spills a
# little more, and a predicted -20 % (16 x 2048, 3 query heads over 1) measured -7.5 % while a predicted -7 %
# (16 x 2048, 16 over 2) measured +1 % (H200, triton 3.6, 2026-11-30)
PAIR_GAIN = 0.85
# ROUND "auto" (Gluon dK/dV) orders by rounds only where the model's makespan drops below this fraction: rounds
# spread the running programs over every segment and kv head, which costs L2 locality: predicted -9 / -20 / -20 %
# measured -3.5 / -16 / -15 % (16 x 2048 with 16/2, 8/1, 3/1 query/kv heads), while predicted +0.4 % measured +10 %
# (24/4) and a forced round order on the irregular layout +18 % (H200, triton 3.6, 2026-11-30)
ROUND_GAIN = 0.95


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
    if B * cdiv(max_seqlen_k, bn) * H_kv > SCHEDULE_MAX_WAVES * n_sm:
        return False
    return _order_gain(order, B, max_seqlen_k, H_kv, group, n_sm, bn, bm) < gain


def _use_pair(mode, B, T_k, max_seqlen_k, H_kv, group, device, c) -> bool:
    """PAIR config of the Triton dK/dV kernel: True / False, or "auto" (`_auto_order`)."""
    if mode != "auto":
        return bool(mode)
    return _auto_order("pair", B, T_k, max_seqlen_k, H_kv, group, device, c["BN"], c["BM"], PAIR_GAIN)


def _use_round(mode, B, T_k, max_seqlen_k, H_kv, group, device, c) -> bool:
    """ROUND config of the Gluon dK/dV pass: True / False, or "auto" (`_auto_order`). Needs the caller's
    max_seqlen_k (it sizes the grid) and two segments."""
    if max_seqlen_k is None or B < 2 or max_seqlen_k <= 0:
        return False
    if mode != "auto":
        return bool(mode)
    return _auto_order("round", B, T_k, max_seqlen_k, H_kv, group, device, c["BN"], c["BM"], ROUND_GAIN)


# The kernels form `head * head_stride` and `row_in_tile * token_stride` in int32 (only a tile's first token offset is
# int64): a layout where either reaches 2^31 elements (e.g. a head-major [H, T, D] buffer viewed as [T, H, D] at
# ~0.5M tokens) is copied first. TILE_ROWS bounds the rows of any tile in CONFIGS.
_INT32_LIMIT = 2 ** 31
_TILE_ROWS = 128


def _ready(t: torch.Tensor) -> torch.Tensor:
    """A [T, H, D] operand the kernels can read in place: 16-byte aligned start, row strides multiple of 16, and
    head / in-tile row offsets within int32; a contiguous copy otherwise."""
    T, H, _ = t.shape
    st = t.stride(0) if T > 1 else H * HEAD_DIM
    sh = t.stride(1) if H > 1 else HEAD_DIM
    if ((t.numel() > 0 and t.data_ptr() % 16) or st % 16 or sh % 16 or t.stride(2) != 1
            or (H - 1) * sh >= _INT32_LIMIT or _TILE_ROWS * st >= _INT32_LIMIT):
        t = t.clone(memory_format=torch.contiguous_format)
    return t


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


def _cu_ready(cu: torch.Tensor) -> torch.Tensor:
    return cu.clone() if cu.data_ptr() % 16 else cu


def _prefix(cu_a, cu_b, T_a: int, T_b: int, buf: torch.Tensor, tile: int) -> tuple:
    """(safe_a, safe_b, ts): both sides' boundaries clamped (no content makes a kernel leave its tensors; valid
    boundaries unchanged) and the tile prefix of side a, in one launch (`_runtime.varlen.tile_prefix`)."""
    return varlen.tile_prefix(cu_a, cu_b, T_a, T_b, buf, tile, INTERPRET)


# ----------------------------------------------------------------------------------------------------------------
# launchers
def gqa_forward(q, k, v, cu_q, cu_k, scale: float, cfg=None):
    """out [T_q, H_q, D] (q's dtype), lse fp32 [H_q, T_q]. Operands already checked."""
    cfg = cfg or CONFIGS[check_device(q, "q")]
    q, k, v = _ready(q), _ready(k), _ready(v)
    cu_q, cu_k = _cu_ready(cu_q), _cu_ready(cu_k)
    T_q, H_q, D = q.shape
    H_kv = k.shape[1]
    B = cu_q.shape[0] - 1
    out = torch.empty((T_q, H_q, D), dtype=q.dtype, device=q.device)
    lse = torch.empty((H_q, T_q), dtype=torch.float32, device=q.device)
    c = cfg["fwd"]
    upper = cdiv(T_q, c["BM"]) + B
    if upper * H_q == 0:
        return out, lse
    buf = torch.empty(3 * varlen.bounds_buffer(B + 1), dtype=torch.int32, device=q.device)
    cu_q, cu_k, ts = _prefix(cu_q, cu_k, T_q, k.shape[0], buf, c["BM"])
    sqt, sqh = _strides(q)
    skt, skh = _strides(k)
    svt, svh = _strides(v)
    cg = cfg.get("fwd_gluon")
    if cg is not None and G is not None and not INTERPRET and _gluon_fwd_fits(q, k, v):
        assert cg["BM"] == c["BM"]  # the tile prefix above counts tiles of BM rows
        rows = cg["BM"] // 2  # Q and the output move in the two warpgroups' halves of the tile
        G.fwd_kernel[(upper * H_q,)](
            _gluon_desc(q, rows), _gluon_desc(k, cg["BN"]), _gluon_desc(v, cg["BN"]), _gluon_desc(out, rows),
            out, lse, cu_q, cu_k, ts,
            float(scale), T_q, B, B.bit_length(), H_q, H_q // H_kv, out.stride(0), out.stride(1),
            D=D, BM=cg["BM"], BN=cg["BN"], num_warps=cg["num_warps"], maxnreg=cg["maxnreg"])
        return out, lse
    K._fwd_kernel[(upper * H_q,)](
        q, k, v, out, lse, cu_q, cu_k, ts,
        float(scale), T_q, B, B.bit_length(), H_q, H_q // H_kv,
        sqt, sqh, skt, skh, svt, svh, out.stride(0), out.stride(1),
        D=D, BM=c["BM"], BN=c["BN"], DIAG_ONLY=c.get("DIAG_ONLY", False), INTERPRET=INTERPRET,
        num_warps=c["num_warps"], num_stages=c["num_stages"])
    return out, lse


def _align(n: int) -> int:
    return cdiv(n, 256) * 256


def gqa_backward(do, q, k, v, out, lse, cu_q, cu_k, scale: float, variant: str, cfg=None, fused=None,
                 parts=("delta", "dkdv", "dq"), max_seqlen_k=None):
    """(dq, dk, dv) in the dtypes of q, k, v. `cfg`, `fused` and `parts` override the config (benchmarks only).
    `max_seqlen_k` (the caller's contract) lets the dK/dV launch pair key tiles (Triton, config PAIR "auto") or run
    in rounds (Gluon, ROUND "auto"); neither changes the bits, whatever value is given."""
    arch = check_device(q, "q")
    cfg = cfg or CONFIGS[arch]
    if fused is None:
        fused = variant == "fast" and FAST_FUSED_DQ[arch]
    q, k, v, do, out = _ready(q), _ready(k), _ready(v), _ready(do), _ready(out)
    cu_q, cu_k = _cu_ready(cu_q), _cu_ready(cu_k)
    T_q, H_q, D = q.shape
    T_k, H_kv = k.shape[:2]
    group = H_q // H_kv
    B = cu_q.shape[0] - 1
    dq = torch.empty((T_q, H_q, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((T_k, H_kv, D), dtype=k.dtype, device=k.device)
    dv = torch.empty((T_k, H_kv, D), dtype=v.dtype, device=v.device)
    cq, ckv, cd = cfg["dq"], cfg["dkdv"], cfg["delta"]
    # one scratch buffer: [fp32 dQ accumulator (fused only)] [delta fp32 H_q*T_q] [boundaries + tile prefix, q pass]
    # [boundaries + tile prefix, k pass]
    n_acc = _align(T_q * H_q * D * 4) if fused else 0
    n_delta = _align(H_q * T_q * 4)
    n_ts = _align(3 * varlen.bounds_buffer(B + 1) * 4)
    scratch = workspace.take(SCRATCH_ROLE, n_acc + n_delta + 2 * n_ts, device=q.device)
    dqa = scratch[:n_acc].view(torch.float32) if fused else scratch[:16].view(torch.float32)
    delta = scratch[n_acc:n_acc + n_delta].view(torch.float32)
    buf_q = scratch[n_acc + n_delta:n_acc + n_delta + n_ts].view(torch.int32)
    buf_k = scratch[n_acc + n_delta + n_ts:].view(torch.int32)
    cu_q_raw, cu_k_raw = cu_q, cu_k
    sqt, sqh = _strides(q)
    skt, skh = _strides(k)
    svt, svh = _strides(v)
    sdt, sdh = _strides(do)
    sot, soh = _strides(out)
    upper_q = cdiv(T_q, cq["BM"]) + B
    if not fused:
        # dQ first: its kernel also writes delta = rowsum(dO * O), which the dK/dV kernel reads
        if upper_q * H_q > 0 and "dq" in parts:
            cu_q, cu_k, ts_q = _prefix(cu_q_raw, cu_k_raw, T_q, T_k, buf_q, cq["BM"])
            cgq = cfg.get("dq_gluon")
            if cgq is not None and GB is not None and not INTERPRET and _gluon_bwd_fits(q, k, v, do):
                assert cgq["BM"] == cq["BM"]  # the tile prefix above counts tiles of BM rows
                GB.dq_kernel[(upper_q * H_q,)](
                    _gluon_desc(q, cgq["BM"]), _gluon_desc(k, cgq["BN"]), _gluon_desc(v, cgq["BN"]),
                    _gluon_desc(do, cgq["BM"]), out, lse, delta, dq, cu_q, cu_k, ts_q, float(scale), T_q, B,
                    B.bit_length(), H_q, group, sot, soh, dq.stride(0), dq.stride(1),
                    D=D, BM=cgq["BM"], BN=cgq["BN"], num_warps=cgq["num_warps"])
            else:
                K._bwd_dq_kernel[(upper_q * H_q,)](
                    q, k, v, do, out, lse, delta, dq, cu_q, cu_k, ts_q,
                    float(scale), T_q, B, B.bit_length(), H_q, group,
                    sqt, sqh, skt, skh, svt, svh, sdt, sdh, sot, soh, dq.stride(0), dq.stride(1),
                    D=D, BM=cq["BM"], BN=cq["BN"], INTERPRET=INTERPRET,
                    num_warps=cq["num_warps"], num_stages=cq["num_stages"])
    elif T_q * H_q > 0 and "delta" in parts:
        K._bwd_delta_kernel[(cdiv(T_q, cd["BR"]) * H_q,)](
            out, do, delta, T_q, H_q, sot, soh, sdt, sdh,
            D=D, BR=cd["BR"], INTERPRET=INTERPRET, num_warps=cd["num_warps"], num_stages=cd["num_stages"])
    cg = cfg.get("dkdv_gluon")
    gluon = (cg is not None and GB is not None and not INTERPRET and not fused and "dkdv" in parts
             and _gluon_bwd_fits(q, k, v, do))
    pair = "dkdv" in parts and not gluon and _use_pair(ckv.get("PAIR", False), B, T_k, max_seqlen_k, H_kv, group,
                                                       q.device, ckv)
    rounds = gluon and _use_round(cg.get("ROUND", False), B, T_k, max_seqlen_k, H_kv, group, q.device, cg)
    tile_k = (cg["BN"] if gluon else ckv["BN"]) * (2 if pair else 1)  # PAIR: the prefix counts pairs of key tiles
    # ROUND: n_kt_max programs per segment first (the grid's size only: the Gluon kernel's per-tile programs that
    # follow cover any tile past them, so an understated max_seqlen_k changes the order, never the result)
    n_kt_max = cdiv(max_seqlen_k, tile_k) if rounds else 0
    upper_k = n_kt_max * B + cdiv(T_k, tile_k) + B
    if fused:
        dqa.zero_()
    if upper_k * H_kv > 0 and "dkdv" in parts:
        cu_k, cu_q, ts_k = _prefix(cu_k_raw, cu_q_raw, T_k, T_q, buf_k, tile_k)
        if gluon:
            GB.dkdv_kernel[(upper_k * H_kv,)](
                _gluon_desc(q, cg["BM"]), _gluon_desc(k, cg["BN"]), _gluon_desc(v, cg["BN"]), _gluon_desc(do, cg["BM"]),
                lse, delta, dk, dv, cu_q, cu_k, ts_k, float(scale), T_q, T_k, B, B.bit_length(), H_kv, group,
                n_kt_max, dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
                D=D, BM=cg["BM"], BN=cg["BN"], num_warps=cg["num_warps"], maxnreg=cg["maxnreg"])
        else:
            sat, sah = H_q * D, D
            K._bwd_dkdv_kernel[(upper_k * H_kv,)](
                q, k, v, do, lse, delta, dk, dv, dqa, cu_q, cu_k, ts_k,
                float(scale), T_q, T_k, B, B.bit_length(), H_kv, group,
                sqt, sqh, skt, skh, svt, svh, sdt, sdh, sat, sah, dk.stride(0), dk.stride(1), dv.stride(0),
                dv.stride(1),
                D=D, BM=ckv["BM"], BN=ckv["BN"], FUSE_DQ=fused, S_ROWS=ckv.get("S_ROWS", False),
                INTERPRET=INTERPRET, PAIR=pair,
                num_warps=ckv["num_warps"], num_stages=ckv["num_stages"])
    if fused:
        n = T_q * H_q * D
        if n > 0 and "dq" in parts:
            cc = cfg["cast"]
            K._dq_cast_kernel[(cdiv(n, cc["BLOCK"]),)](dqa, dq, n, float(scale), BLOCK=cc["BLOCK"],
                                                        num_warps=cc["num_warps"], num_stages=cc["num_stages"])
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------------
# routes: every kernel specialization a call can launch (prebuild compiles these; no_build proves it is enough)
def routes(**model_params):
    """The kernel routes of gqa on the current device's arch (head dim fixed at 256: no model parameters)."""
    from ..._runtime.build import Route, device_arch

    if model_params:
        raise TypeError(f"gqa routes take no model parameters, got {sorted(model_params)}")
    arch = device_arch()
    cfg = CONFIGS[arch]
    bf, f32, i32 = torch.bfloat16, torch.float32, torch.int32
    n, st, sh = 1000, 4096, 256  # runtime ints (not specialized) and row strides (multiples of 16 elements)

    def launch(c):
        return {"num_warps": c["num_warps"], "num_stages": c["num_stages"]}

    # (the dK/dV kernel's S_ROWS flag is part of the fixed config)

    out = [Route(varlen.tile_prefix_kernel, (cu_t, cu_t, i32, i32, i32, n, 64, n, n), (1,),
                 {"BLOCK": varlen.TILE_PREFIX_BLOCK["gpu"], "num_warps": 4, "num_stages": 1},
                 f"tile_prefix[{str(cu_t)[6:]}]") for cu_t in (i32, torch.int64)]
    c = cfg["fwd"]
    out.append(Route(K._fwd_kernel, (bf, bf, bf, bf, f32, i32, i32, i32, 0.0625, n, n, n, n, n) + (st, sh) * 4,
                     (1,), {"D": HEAD_DIM, "BM": c["BM"], "BN": c["BN"], "DIAG_ONLY": c.get("DIAG_ONLY", False),
                            "INTERPRET": False, **launch(c)}, "fwd"))

    def desc(rows):  # descriptors on meta tensors stand in for the real ones (specialized on block shape, layout)
        return _GluonDescriptor(torch.empty(rows, HEAD_DIM, dtype=bf, device="meta"), [rows, HEAD_DIM],
                                [HEAD_DIM, 1], [rows, HEAD_DIM], _tile_layout(rows))

    cg = cfg.get("fwd_gluon")
    if cg is not None and G is not None:
        dq_, dk_ = desc(cg["BM"] // 2), desc(cg["BN"])
        out.append(Route(G.fwd_kernel, (dq_, dk_, dk_, dq_, bf, f32, i32, i32, i32, 0.0625, n, n, n, n, n, st, sh),
                         (1,), {"D": HEAD_DIM, "BM": cg["BM"], "BN": cg["BN"], "num_warps": cg["num_warps"],
                                "maxnreg": cg["maxnreg"]}, "fwd_gluon"))
    cb = cfg.get("dq_gluon")
    if cb is not None and GB is not None:
        out.append(Route(GB.dq_kernel, (desc(cb["BM"]), desc(cb["BN"]), desc(cb["BN"]), desc(cb["BM"]), bf, f32, f32,
                                        bf, i32, i32, i32, 0.0625, n, n, n, n, n, st, sh, st, sh), (1,),
                         {"D": HEAD_DIM, "BM": cb["BM"], "BN": cb["BN"], "num_warps": cb["num_warps"]},
                         "bwd_dq_gluon"))
    cb = cfg.get("dkdv_gluon")
    if cb is not None and GB is not None:
        # (one route for both launch orders: ROUND only changes the runtime n_kt_max and the grid)
        out.append(Route(GB.dkdv_kernel, (desc(cb["BM"]), desc(cb["BN"]), desc(cb["BN"]), desc(cb["BM"]), f32, f32,
                                          bf, bf, i32, i32, i32, 0.0625, n, n, n, n, n, n, n, st, sh, st, sh), (1,),
                         {"D": HEAD_DIM, "BM": cb["BM"], "BN": cb["BN"], "num_warps": cb["num_warps"],
                          "maxnreg": cb["maxnreg"]}, "bwd_dkdv_gluon"))
    if FAST_FUSED_DQ[arch]:
        c = cfg["delta"]
        out.append(Route(K._bwd_delta_kernel, (bf, bf, f32, n, n) + (st, sh) * 2, (1,),
                         {"D": HEAD_DIM, "BR": c["BR"], "INTERPRET": False, **launch(c)}, "bwd_delta"))
    c = cfg["dq"]
    out.append(Route(K._bwd_dq_kernel, (bf, bf, bf, bf, bf, f32, f32, bf, i32, i32, i32, 0.0625, n, n, n, n, n)
                     + (st, sh) * 6, (1,),
                     {"D": HEAD_DIM, "BM": c["BM"], "BN": c["BN"], "INTERPRET": False, **launch(c)}, "bwd_dq"))
    c = cfg["dkdv"]
    for fused in (False, True) if FAST_FUSED_DQ[arch] else (False,):
        # PAIR "auto" takes either route per call
        pairs = {"auto": (False, True), True: (True,), False: (False,)}[c.get("PAIR", False)]
        for pair in pairs:
            out.append(Route(K._bwd_dkdv_kernel, (bf, bf, bf, bf, f32, f32, bf, bf, f32, i32, i32, i32, 0.0625, n, n,
                                                  n, n, n, n) + (st, sh) * 7, (1,),
                             {"D": HEAD_DIM, "BM": c["BM"], "BN": c["BN"], "FUSE_DQ": fused,
                              "S_ROWS": c.get("S_ROWS", False), "INTERPRET": False, "PAIR": pair, **launch(c)},
                             f"bwd_dkdv{'_fused_dq' if fused else ''}{'_pair' if pair else ''}"))
    if FAST_FUSED_DQ[arch]:
        c = cfg["cast"]
        out.append(Route(K._dq_cast_kernel, (f32, bf, n, 0.0625), (1,), {"BLOCK": c["BLOCK"], **launch(c)},
                         "dq_cast"))
    return out


# ----------------------------------------------------------------------------------------------------------------
# torch.library custom ops, so torch.compile(fullgraph=True) traces the op
@torch.library.custom_op("miles_ext_kernels::gqa_fwd", mutates_args=())
def gqa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, softmax_scale: float, variant: str,
            max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    # out and LSE come from the same kernel in both variants
    with device_guard(q):
        return gqa_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale)


@gqa_fwd.register_fake
def _gqa_fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, variant, max_seqlen_k):
    T_q, H_q, D = q.shape
    return q.new_empty((T_q, H_q, D)), q.new_empty((H_q, T_q), dtype=torch.float32)


@torch.library.custom_op("miles_ext_kernels::gqa_bwd", mutates_args=())
def gqa_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, softmax_scale: float,
            variant: str, max_seqlen_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    with device_guard(q):
        return gqa_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, variant,
                            max_seqlen_k=max_seqlen_k)


@gqa_bwd.register_fake
def _gqa_bwd_fake(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, softmax_scale, variant, max_seqlen_k):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape))


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, scale, variant, max_seqlen_k = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.scale = scale
    ctx.max_seqlen_k = max_seqlen_k
    ctx.variant = variant  # a backward runs the variant its forward ran
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    dq, dk, dv = torch.ops.miles_ext_kernels.gqa_bwd(dout, q, k, v, out, lse, cu_q, cu_k, ctx.scale, ctx.variant,
                                                     ctx.max_seqlen_k)
    return dq, dk, dv, None, None, None, None, None


gqa_fwd.register_autograd(_backward, setup_context=_setup_context)


# eager autograd: a plain autograd.Function with the same forward and backward (a torch.library custom op costs
# ~100 us of host time per call in eager mode); torch.compile traces the custom ops above instead
class _GQAFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, scale, variant, max_seqlen_k):
        with device_guard(q):
            out, lse = gqa_forward(q, k, v, cu_q, cu_k, scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
        ctx.scale, ctx.variant, ctx.max_seqlen_k = scale, variant, max_seqlen_k
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable  # a second derivative raises instead of silently carrying no history
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
        with device_guard(q):
            dq, dk, dv = gqa_backward(dout, q, k, v, out, lse, cu_q, cu_k, ctx.scale, ctx.variant,
                                      max_seqlen_k=ctx.max_seqlen_k)
        return dq, dk, dv, None, None, None, None, None


# ----------------------------------------------------------------------------------------------------------------
# operand checks
def _check_operands(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_k, softmax_scale, return_lse):
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.check_tensor(name, t, dtype=torch.bfloat16, ndim=3, last_stride_one=True)
    for name, t in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        checks.check_tensor(name, t, dtype=(torch.int32, torch.int64), ndim=1, last_stride_one=True)
    checks.check_same_device([("q", q), ("k", k), ("v", v), ("cu_seqlens_q", cu_seqlens_q),
                              ("cu_seqlens_k", cu_seqlens_k)])
    check_device(q, "q")
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
    variant = config.variant(OP_NAME)
    if config.option(OP_NAME, "check_seqlens"):
        check_seqlens(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_k)
    scale = DEFAULT_SCALE if softmax_scale is None else float(softmax_scale)
    if torch.compiler.is_compiling():
        out, lse = torch.ops.miles_ext_kernels.gqa_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, variant,
                                                       int(max_seqlen_k))
    else:
        out, lse = _GQAFn.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, scale, variant, int(max_seqlen_k))
    return (out, lse) if return_lse else out
