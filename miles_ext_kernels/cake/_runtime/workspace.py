"""The workspace pool: scratch buffers that may be kept between calls, bounded.

`take(role, nbytes)` returns a uint8 tensor of `nbytes` whose content is undefined (kernels that need zeros zero
it); `take_tensor(role, shape, dtype, device=...)` the same as a typed tensor. With the bound at 0 (the default,
`--cake-workspace-pool-bytes`) nothing is kept: `take` is a plain `torch.empty` on the current stream, and the
buffer dies with the call. Above 0 the pool keeps one buffer per
(device, stream, role), grows it on demand, and evicts least-recently-used buffers of the same device to stay
under the bound. A buffer is only ever handed to work on the stream it is keyed by, so stream order alone makes
reuse safe — given that one host thread at a time enqueues an op's launches on a stream (as autograd's per-device
thread does): an op that launches two kernels around one buffer must not be interleaved with another thread's call
of the same op on the same stream. A stream that is capturing a CUDA graph allocates outside the pool (the graph's
private pool owns that memory). A lock keeps the pool consistent across threads (autograd runs backward on its own
threads).
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict

import torch

from . import config

_lock = threading.Lock()
_buffers: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()  # (device, stream key, role) -> buffer, LRU first
_held: dict[torch.device, int] = {}
_stats = {"hits": 0, "misses": 0, "evictions": 0, "bypass": 0}


def _stream_key(device: torch.device, stream):
    if stream is None:
        if device.type == "cuda":
            return torch.cuda.current_stream(device).cuda_stream
        return None
    # CUDA streams by handle; anything else (CPU-simulated streams in tests) by identity of the given key
    return getattr(stream, "cuda_stream", stream)


def _normalize(device) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _empty(nbytes: int, device: torch.device, stream) -> torch.Tensor:
    if device.type == "cuda" and stream is not None:
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def take_tensor(role, shape, dtype, *, device) -> torch.Tensor:
    """A `shape` tensor of `dtype` (undefined content) for `role` on `device`'s current stream: `take`'s buffer viewed
    as it, or with the bound at 0 one plain allocation (the pool's bookkeeping and the views cost more host time)."""
    if config.pool_bytes() == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    size = math.prod(shape) * dtype.itemsize
    return take(role, max(size, 16), device=device)[:size].view(dtype).view(shape)


def take(role, nbytes: int, *, device=None, stream=None) -> torch.Tensor:
    """A uint8 buffer of `nbytes` (undefined content) for `role` on `device` / `stream` (default: current)."""
    bound = config.pool_bytes()
    if bound == 0:
        return _empty(nbytes, _normalize(device), stream)
    device = _normalize(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        with _lock:
            _stats["bypass"] += 1
        return _empty(nbytes, device, stream)
    key = (device, _stream_key(device, stream), role)
    with _lock:
        buf = _buffers.get(key)
        if buf is not None and buf.numel() >= nbytes:
            _stats["hits"] += 1
            _buffers.move_to_end(key)
            return buf[:nbytes]
        _stats["misses"] += 1
        if buf is not None:  # too small: drop it, then grow
            del _buffers[key]
            _held[device] -= buf.numel()
        if nbytes > bound:  # larger than the whole pool: serve it unpooled
            return _empty(nbytes, device, stream)
        _evict(device, bound - nbytes)
        buf = _empty(nbytes, device, stream)
        _buffers[key] = buf
        _held[device] = _held.get(device, 0) + nbytes
        return buf


def _evict(device: torch.device, keep_at_most: int) -> None:
    """Drop least-recently-used buffers of `device` until it holds at most `keep_at_most` bytes (lock held)."""
    for key in list(_buffers):
        if _held.get(device, 0) <= keep_at_most:
            break
        if key[0] != device:
            continue
        buf = _buffers.pop(key)
        _held[device] -= buf.numel()
        _stats["evictions"] += 1


def shrink_to_bound() -> None:
    """Evict down to the configured bound (called when `configure` lowers it)."""
    bound = config.pool_bytes()
    with _lock:
        for device in list(_held):
            _evict(device, bound)


def release() -> int:
    """Free every pooled buffer; returns the bytes freed."""
    with _lock:
        freed = sum(_held.values())
        _buffers.clear()
        _held.clear()
    return freed


def stats() -> dict:
    """Held bytes (total and per device), buffers, hits, misses, evictions, graph-capture bypasses, bound."""
    with _lock:
        return {
            "held_bytes": sum(_held.values()),
            "held_bytes_by_device": {str(d): n for d, n in _held.items() if n},
            "buffers": len(_buffers),
            **_stats,
            "bound": config.pool_bytes(),
        }


def reset_stats() -> None:
    with _lock:
        for k in _stats:
            _stats[k] = 0
