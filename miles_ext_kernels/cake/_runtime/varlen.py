"""Varlen tables from cu_seqlens, one launch each, no device->host sync; shared by the ops that take packed documents.

Every table kernel clamps the boundaries it reads, and the op's other kernels read the clamped copy it writes, never
cu_seqlens itself: no content of cu_seqlens makes a kernel read or write outside its tensors (a malformed call gives
garbage in its own outputs, never a bad access). Valid boundaries (0 = c_0 <= ... <= c_N <= T) pass unchanged.

- `chunk_table` (chunked linear attention: gdn, kda): per chunk slot (sequence, chunk index), and each sequence's
  (bos, eos) clamped into [0, T].
- `tile_prefix` (attention: gqa): both boundary arrays made non-decreasing in [0, T] from 0 (segments then tile the
  rows without gaps or overlaps), and the running count of row tiles per segment of one of them.
"""
import torch
import triton
import triton.language as tl

from .launch import launch

CHUNK_TABLE_BP = 128  # chunk slots per program of the chunk-table kernel
TILE_PREFIX_BLOCK = {"gpu": 1024, "interpreter": 64}  # boundaries per step of the (one-program) tile-prefix kernel


@triton.jit
def _seq_bounds(cu, n, T, mask):
    """(bos, eos) of sequence n from cu_seqlens, clamped so that 0 <= bos <= eos <= T whatever cu holds: every row a
    kernel touches lies in [bos, eos), so no content of cu_seqlens makes a kernel leave its tensors (a malformed
    cu_seqlens gives garbage in the outputs, never a bad access)."""
    bos = tl.minimum(tl.maximum(tl.load(cu + n, mask=mask, other=0), 0), T)
    eos = tl.minimum(tl.maximum(tl.load(cu + n + 1, mask=mask, other=0), bos), T)
    return bos, eos


@triton.jit(do_not_specialize=["N", "P", "T", "steps"])
def chunk_table_kernel(cu, table, se, N, P, T, steps, BT: tl.constexpr, BP: tl.constexpr):
    """table[p] = (sequence n, chunk index) of chunk slot p, or (-1, _) for an unused slot; se[n] = (bos, eos) of
    sequence n clamped into [0, T] (`_seq_bounds`), which every later kernel reads instead of cu_seqlens. Sequence n
    owns the slots from start[n] = bos[n] // BT + n on (a bound that needs no device->host sync: for any clamped
    bounds its slots end below cdiv(T, BT) + N = P); a vectorised binary search finds the last n with
    start[n] <= p (`steps` >= log2(N + 1) halvings)."""
    ids = tl.program_id(0) * BP + tl.arange(0, BP)
    lo = tl.zeros([BP], dtype=tl.int32)
    hi = tl.zeros([BP], dtype=tl.int32) + N
    for _ in range(0, steps):
        go = lo < hi
        mid = (lo + hi) // 2
        b_mid = tl.minimum(tl.maximum(tl.load(cu + mid, mask=go, other=0), 0), T)
        start = b_mid // BT + mid
        up = go & (start <= ids)
        lo = tl.where(up, mid + 1, lo)
        hi = tl.where(go & (start > ids), mid, hi)
    n = tl.maximum(lo - 1, 0)
    m = ids < P
    bos, eos = _seq_bounds(cu, n, T, m)
    ic = ids - (bos // BT + n)
    nch = (eos - bos + BT - 1) // BT
    n = tl.where((ic >= 0) & (ic < nch), n, -1)
    tl.store(table + 2 * ids, n, mask=m)
    tl.store(table + 2 * ids + 1, ic.to(tl.int32), mask=m)
    ms = ids < N
    sb, sn = _seq_bounds(cu, ids, T, ms)
    tl.store(se + 2 * ids, sb.to(tl.int32), mask=ms)
    tl.store(se + 2 * ids + 1, sn.to(tl.int32), mask=ms)



@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _safe_bounds(CU, SAFE, idx, valid, has_next, carry, T):
    """SAFE[idx] for one block of boundaries: cu_seqlens made a non-decreasing sequence in [0, T] that starts at 0
    (a running maximum, clamped to T). Also the next boundary of each entry, and the new carry (the running max)."""
    x = tl.minimum(tl.load(CU + idx, mask=valid, other=0), T)
    x = tl.where(idx == 0, 0, x)
    run = tl.maximum(tl.associative_scan(x, 0, _max_combine), carry)
    tl.store(SAFE + idx, run.to(tl.int32), mask=valid)
    nxt = tl.minimum(tl.load(CU + idx + 1, mask=has_next, other=0), T)
    return run, tl.maximum(run, nxt), tl.max(tl.where(valid, run, carry), 0)


@triton.jit(do_not_specialize=["n_seg", "tile", "T_a", "T_b"])
def tile_prefix_kernel(CU_A, CU_B, SAFE_A, SAFE_B, TS, n_seg, tile, T_a, T_b, BLOCK: tl.constexpr):
    """SAFE_A, SAFE_B: cu_seqlens_a / _b (int32 or int64) as every later kernel reads them, made non-decreasing in
    [0, T] from 0 (`_safe_bounds`): for any content of cu_seqlens the segments tile [0, SAFE[n_seg]) without gaps or
    overlaps and the padding programs cover the rest, so no kernel reads or writes outside its tensors and every
    output row is written (a malformed cu_seqlens gives garbage in the outputs, never a bad access). Valid
    boundaries pass unchanged. TS[s] = number of `tile`-row tiles of the segments of A before s (n_seg + 1
    entries); one program."""
    tl.store(TS, 0)
    zero = tl.sum(tl.zeros([BLOCK], dtype=tl.int32), 0)
    carry = zero
    run_a = zero.to(CU_A.dtype.element_ty)
    run_b = zero.to(CU_B.dtype.element_ty)
    for c in range(0, n_seg + 1, BLOCK):
        idx = c + tl.arange(0, BLOCK)
        valid = idx <= n_seg
        seg = idx < n_seg
        lo, hi, run_a = _safe_bounds(CU_A, SAFE_A, idx, valid, seg, run_a, T_a)
        _l, _h, run_b = _safe_bounds(CU_B, SAFE_B, idx, valid, seg, run_b, T_b)
        cnt = tl.where(seg, ((hi - lo) + tile - 1) // tile, 0).to(tl.int32)
        cs = tl.cumsum(cnt, 0) + carry
        tl.store(TS + idx + 1, cs, mask=seg)
        carry += tl.sum(cnt, 0)


def chunk_table(cu: torch.Tensor, N: int, P: int, T: int, BT: int) -> tuple:
    """(table [P, 2] int32: slot -> (sequence, chunk index), sequence -1 for unused slots; se [N, 2] int32: each
    sequence's (bos, eos), cu clamped into [0, T], which the op's kernels read instead of cu). Sequence n owns the
    P = cdiv(T, BT) + N slots from bos[n] // BT + n on. `cu`: int32 or int64 `[N + 1]`."""
    table = torch.empty(P, 2, dtype=torch.int32, device=cu.device)
    se = torch.empty(N, 2, dtype=torch.int32, device=cu.device)
    BP = CHUNK_TABLE_BP
    launch(chunk_table_kernel, ((P + BP - 1) // BP,), cu=cu, table=table, se=se, N=N, P=P, T=T,
           steps=N.bit_length(), BT=BT, BP=BP, num_warps=4)
    return table, se


def bounds_buffer(n: int) -> int:
    """int32 entries of one boundary or tile-prefix array of n entries, padded so the next starts 16-byte aligned."""
    return -(-n // 4) * 4


def tile_prefix(cu_a, cu_b, T_a: int, T_b: int, buf: torch.Tensor, tile: int, interpreter: bool) -> tuple:
    """One launch: the safe boundaries of both sides and the tile prefix of side a. `cu_a`, `cu_b`: int32 or int64
    `[n]` (one dtype); `buf`: int32, at least 3 * bounds_buffer(n) entries. Returns (safe_a, safe_b, ts), each `[n]`
    int32: ts[s] = number of `tile`-row tiles of side a's segments before s."""
    n = cu_a.shape[0]
    m = bounds_buffer(n)
    safe_a, safe_b, ts = buf[:n], buf[m:m + n], buf[2 * m:2 * m + n]
    launch(tile_prefix_kernel, (1,), CU_A=cu_a, CU_B=cu_b, SAFE_A=safe_a, SAFE_B=safe_b, TS=ts, n_seg=n - 1,
           tile=tile, T_a=T_a, T_b=T_b, BLOCK=TILE_PREFIX_BLOCK["interpreter" if interpreter else "gpu"],
           num_warps=4, num_stages=1)
    return safe_a, safe_b, ts
