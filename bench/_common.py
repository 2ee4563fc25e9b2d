"""Shared benchmark helpers: environment record, CUDA-event medians, results JSON.

Every benchmark prints a table and writes `bench/results/<name>.json` with the GPU name, torch / triton versions,
the date and its rows (medians); `bench/plot.py` draws the README plots from those files.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
# Measured on our H200 (ANCHORS.md): the two ceilings the floors are computed against.
MATMUL_TFLOPS = 760.0
COPY_TBPS = 4.3


def env_info() -> dict:
    info = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["capability"] = list(torch.cuda.get_device_capability())
        info["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    return info


def median_ms(fn, warmup: int = 5, rep: int = 20, setup=None) -> float:
    """Median wall time of `fn()` on the device, in ms, from CUDA events around each repetition.

    `setup` (optional) runs before each repetition outside the timed region (e.g. to rotate inputs or zero grads).
    """
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rep):
        if setup:
            setup()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _event_median(fn, warmup: int, rep: int, lead_cycles: int = 0) -> float:
    """Median of `rep` CUDA-event pairs around `fn()`, queued back to back with one sync at the end; with
    `lead_cycles` > 0 the GPU first spins that long before each start event (`torch.cuda._sleep`)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(rep)]
    for start, end in events:
        if lead_cycles:
            torch.cuda._sleep(lead_cycles)
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return times[len(times) // 2]


def queued_ms(fn, warmup: int = 5, rep: int = 30) -> float:
    """Median per-call time with calls queued back to back (events around each call, one sync at the end), as in a
    training step where the host runs ahead: host launch overhead is hidden when it is shorter than the kernel.
    `median_ms` syncs after every call instead, so it also counts each launch's host time."""
    return _event_median(fn, warmup, rep)


_SLEEP_CYCLES_PER_MS: dict = {}


def _sleep_cycles_per_ms() -> float:
    """GPU clock cycles of `torch.cuda._sleep` per ms on the current device (measured once)."""
    dev = torch.cuda.current_device()
    if dev not in _SLEEP_CYCLES_PER_MS:
        cycles = 20_000_000
        torch.cuda._sleep(1000)  # load the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        torch.cuda.synchronize()
        _SLEEP_CYCLES_PER_MS[dev] = cycles / start.elapsed_time(end)
    return _SLEEP_CYCLES_PER_MS[dev]


def device_ms(fn, warmup: int = 5, rep: int = 30, lead_ms: float = 2.0) -> float:
    """Median GPU time of one call, in ms, with the host's launch work hidden: before each repetition the GPU
    spins for `lead_ms` (`torch.cuda._sleep`), so the host has queued the whole call before its start event fires.
    What is measured is the kernels' time plus the gaps between them on the GPU: the time a training step sees
    when its host runs ahead of the GPU. `queued_ms` and `median_ms` also count host time the host cannot hide
    (short kernels behind a long Python launch path)."""
    return _event_median(fn, warmup, rep, max(1, int(lead_ms * _sleep_cycles_per_ms())))


def write_results(name: str, rows: list[dict], extra: dict | None = None) -> Path:
    """Write `bench/results/<name>.json` (env + rows) and return its path; $BENCH_OUT (a folder) gets a copy."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    doc = {"bench": name, **env_info(), **(extra or {}), "rows": rows}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1))
    out = os.environ.get("BENCH_OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(doc, indent=1))
    return path


def print_table(rows: list[dict], cols: list[str]) -> None:
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))
