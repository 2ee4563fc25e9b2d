"""The benchmark harness: timers, environment record, results JSON, and `Bench` / `run`.

Every `bench/<op>.py` declares a `Bench` (shapes, the inputs they share, providers = ours and the peers, modes
among fwd / bwd / full, FLOPs or bytes per call) and calls `run`, which times every provider x shape x mode in
one process with each timer (`median_ms` = synced, `device_ms` = device, optionally `queued_ms`), checks det bits
where a provider declares it, prints one table and writes `bench/results/<name>.json`: the environment (GPU,
torch / triton versions, date, commit) and one flat row per (op, shape, provider, mode), e.g.
  {"op": "gqa", "shape": "16x2048 Hq16/Hkv2", "provider": "cake det", "mode": "bwd", "synced_ms": 4.06,
   "device_ms": 3.59, "synced_tflops": 338.5, "device_tflops": 383.3, "bits_repeat": true}
plus `accuracy` rows (relative RMS of each provider's outputs and gradients against a reference), `skipped`
and `failures`. `bench/plot.py` draws the README plots and tables from those files. `--dry-run` runs every
declaration on tiny shapes, one call per mode (on CPU through Triton's interpreter): tests/bench checks it.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib
import json
import os
import platform
import subprocess
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
    def git(*args):
        return subprocess.run(["git", *args], cwd=RESULTS.parent, timeout=10, capture_output=True, text=True,
                              check=False).stdout.strip()

    try:
        info["commit"] = git("rev-parse", "--short", "HEAD") or None
        # a copied tree may carry git metadata of another commit: then the commit alone does not say what ran
        info["tree_differs_from_commit"] = bool(git("status", "--porcelain", "--untracked-files=no")) \
            if info["commit"] else None
    except (OSError, subprocess.SubprocessError):
        info["commit"] = None  # a copy of the tree without git
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


def host_ms(fn, warmup: int = 20, rep: int = 200) -> float:
    """Wall-clock time per call of `rep` calls queued back to back with one sync at the end, in ms. On operands so
    small that every kernel is shorter than its launch, the GPU waits on the host: this is the host's time per call
    (Python, autograd, checks, launches). `device_ms` beside it says how much of it the GPU needed."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(rep):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / rep


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


def write_results(name: str, rows: list[dict], extra: dict | None = None, out_dir: Path | None = None) -> Path:
    """Write `<out_dir>/<name>.json` (default bench/results; env + rows) and return its path; $BENCH_OUT (a
    folder) gets a copy unless the document is a dry run's."""
    out_dir = Path(out_dir) if out_dir is not None else RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {"bench": name, **env_info(), **(extra or {}), "rows": rows}
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, indent=1))
    out = os.environ.get("BENCH_OUT")
    if out and not doc.get("dry_run"):
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"{name}.json").write_text(json.dumps(doc, indent=1))
    return path


def print_table(rows: list[dict], cols: list[str]) -> None:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3f}" if v == 0 or abs(v) >= 0.01 else f"{v:.3e}"  # errors and dry-run metrics are tiny
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max([len(c)] + [len(x[i]) for x in cells]) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))


# ---------------------------------------------------------------------------------------------------- harness
# A benchmark file declares what to time (`Bench`: shapes, one input factory, providers, modes, work per mode) and
# hands it to `run`, which times every provider x shape x mode with each timer, in one process, and writes one
# flat row per (op, shape, provider, mode). Modes:
#   fwd   the forward as a training step runs it: autograd records (the inputs to differentiate require grad)
#   bwd   the backward alone: autograd.grad on one forward's graph, kept (retain_graph=True) and replayed
#   full  forward + backward, a fresh graph each call
# Backward on a retained graph (as Liger's benchmarks do) rather than (fwd + bwd) - fwd: one measurement, not a
# difference of two noisy ones, and it is the same for every provider.
MODES = ("fwd", "bwd", "full")
TIMERS = {"synced": median_ms, "device": device_ms, "queued": queued_ms, "host": host_ms}
TIMER_DOC = {
    "synced": "`median_ms`: one sync per call, the host's launch path included",
    "device": "`device_ms`: each call queued behind a GPU spin, so the host's launch work is hidden, as in a "
              "training step whose host runs ahead",
    "queued": "`queued_ms`: calls back to back, host-bound where a launch path is slower than its kernels",
    "host": "`host_ms`: wall clock per call of calls back to back on tiny operands (the host's launch path)",
}
FORMAT = 2  # results-file layout: one row per (op, shape, provider, mode); plot.py also reads the layout before it


class AtenFA2Varlen(torch.autograd.Function):
    """torch's own FlashAttention-2 varlen kernels (`aten._flash_attention_forward / _backward`, in every CUDA build
    of torch, flash_attn package or not) as one autograd function: causal, GQA native, dropout 0. q [T, Hq, D],
    k / v [T, Hkv, D], cu int32 [N + 1]; returns o [T, Hq, D]. The FA2 peer of bench/model.py and bench/step.py
    (bench/gqa.py calls the same ops without autograd)."""

    @staticmethod
    def forward(ctx, q, k, v, cu, max_len: int, scale: float):
        o, lse, seed, off, _ = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_len, max_len, 0.0, True,
                                                                        False, scale=scale)
        ctx.save_for_backward(q, k, v, o, lse, cu, seed, off)
        ctx.max_len, ctx.scale = max_len, scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, cu, seed, off = ctx.saved_tensors
        dq, dk, dv = torch.ops.aten._flash_attention_backward(do.contiguous(), q, k, v, o, lse, cu, cu, ctx.max_len,
                                                              ctx.max_len, 0.0, True, seed, off, scale=ctx.scale)
        return dq, dk, dv, None, None, None


def has_aten_fa2() -> bool:
    return hasattr(torch.ops.aten, "_flash_attention_forward")


class Skip(Exception):
    """Raised by a provider's factory: the provider does not run on this shape (the message says why)."""


@dataclass
class Autograd:
    """A differentiable call: `fn(*args)` returns a tensor or a tuple of tensors (the outputs the backward
    starts from, matched to `grad_outputs`); the gradients are taken w.r.t. `args[i]` for i in `wrt`. The harness
    makes its own leaves (`detach().requires_grad_()`) of those args, so one set of inputs serves every provider.
    `context` (optional) is entered around every call (e.g. `sdpa_kernel(...)`)."""
    fn: Callable[..., Any]
    args: Sequence[Any]
    wrt: Sequence[int]
    grad_outputs: Any
    context: Callable[[], Any] | None = None


@dataclass
class Calls:
    """Explicit callables per mode, for a provider that is not an autograd function (e.g. FA2's aten ops).
    `result()` returns the tensors the accuracy table compares (outputs then gradients), if any."""
    fwd: Callable[[], Any] | None = None
    bwd: Callable[[], Any] | None = None
    full: Callable[[], Any] | None = None
    result: Callable[[], Sequence[Any]] | None = None


@dataclass
class Provider:
    """One implementation. `make(inputs, params)` builds an `Autograd` or `Calls` from the shape's shared inputs,
    or raises `Skip`.
    config:   `miles_ext_kernels.configure(**config)` while it is built and timed (reset afterwards)
    requires: modules that must import (peers such as fla, liger_kernel); otherwise skipped, reason printed
    det:      check that two forward + backward calls repeat bit for bit (`bits_repeat` in its rows)
    ours:     a failure of this provider makes `run` return 1 (a peer's failure is printed and recorded only)
    on_cpu:   False where it needs CUDA (FA2, cuDNN, torch.compile, fla, Liger): skipped in a CPU dry run
    when:     `when(label, params)` False leaves a shape out (a plan, not a skip: nothing printed)
    accuracy: False leaves it out of the accuracy table (its outputs are in another layout)"""
    name: str
    make: Callable[[dict, dict], Autograd | Calls]
    config: dict = field(default_factory=dict)
    requires: tuple = ()
    det: bool = False
    ours: bool = False
    on_cpu: bool = True
    when: Callable[[str, dict], bool] | None = None
    accuracy: bool = True


@dataclass
class Bench:
    """What one op's benchmark times.
    shapes / dry_shapes:   label -> params (dry_shapes: tiny ones for `--dry-run`)
    inputs(params, device): the tensors every provider of a shape shares (dict)
    flops / io_bytes(params, mode): work per call for TFLOP/s / TB/s (None: not reported; "full" defaults to
                           fwd + bwd)
    timers:                among TIMERS; warmup / rep / lead_ms go to the timers (lead_ms: device_ms's spin)
    reference:             accuracy reference: a provider's name, or `reference(inputs, params)` -> tensors
                           (outputs then gradients, named by `result_names`); compared by relative RMS in FP64
    accuracy / dry_accuracy: label -> params of the shapes the accuracy table is computed on (untimed)"""
    name: str
    shapes: dict
    dry_shapes: dict
    inputs: Callable[[dict, str], dict]
    providers: list
    modes: tuple = ("fwd", "bwd")
    flops: Callable[[dict, str], float | None] | None = None
    io_bytes: Callable[[dict, str], float | None] | None = None
    timers: tuple = ("synced", "device")
    warmup: int = 5
    rep: int = 20
    lead_ms: float = 2.0
    reference: str | Callable[[dict, dict], Sequence[Any]] | None = None
    result_names: tuple = ()
    accuracy: dict = field(default_factory=dict)
    dry_accuracy: dict = field(default_factory=dict)


def parser(description: str | None = None) -> argparse.ArgumentParser:
    """The options every benchmark takes; a file adds its own and passes the parsed namespace to `run`."""
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true",
                    help="tiny shapes, one call per mode, wall-clock times (meaningless: checks that every "
                         "declaration builds and runs; on CPU through Triton's interpreter)")
    ap.add_argument("--out", default=None,
                    help="folder for <name>.json (default bench/results; a dry run: a temporary folder)")
    ap.add_argument("--name", default=None, help="results file stem (default: the benchmark's name)")
    ap.add_argument("--only", default=None, help="only shapes whose label contains this")
    ap.add_argument("--providers", default=None, help="comma-separated providers to run (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated providers to leave out")
    ap.add_argument("--modes", default=None, help="comma-separated modes among fwd,bwd,full (default: the bench's)")
    ap.add_argument("--rep", type=int, default=None, help="timed repetitions per timer (default: the bench's)")
    ap.add_argument("--device", default=None, help="default: cuda, or cpu in a dry run without a GPU")
    return ap


def parse_peer_args(description: str | None, argv, peer: str, quick: str) -> argparse.Namespace:
    """`parser(description)` with --no-fla (adds the provider `peer` to --skip) and --quick (help `quick`), parsed."""
    ap = parser(description)
    ap.add_argument("--no-fla", action="store_true", help="leave fla out")
    ap.add_argument("--quick", action="store_true", help=quick)
    args = ap.parse_args(argv)
    if args.no_fla:
        args.skip += f",{peer}"
    return args


def rel_rms(got, ref) -> float:
    """||got - ref|| / ||ref|| in FP64, on the tensors' device (benchmark tensors are GBs)."""
    r = ref.detach().to(torch.float64)
    d = torch.linalg.vector_norm(got.detach().to(torch.float64) - r)
    n = torch.linalg.vector_norm(r)
    return float(d / n) if float(n) else float(d)


def _dry_ms(fn, device: str) -> float:
    """One call's wall time: a dry run checks that the call works, it does not measure it."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _outs(y) -> tuple:
    return tuple(y) if isinstance(y, (tuple, list)) else (y,)


class Timed:
    """The callables of one built provider: `builder(mode)` returns the callable to time (None: not offered);
    `result()` one forward + backward's tensors (outputs, then gradients)."""

    def __init__(self, built):
        self.built = built
        if isinstance(built, Autograd):
            wrt = set(built.wrt)
            self.leaves = [a.detach().requires_grad_(True) if i in wrt else a for i, a in enumerate(built.args)]
            self.wrt = [self.leaves[i] for i in built.wrt]
            self.grads = _outs(built.grad_outputs)
            self.ctx = built.context or contextlib.nullcontext
        elif not isinstance(built, Calls):
            raise TypeError(f"a provider's factory returns Autograd or Calls, got {type(built).__name__}")

    def _call(self):
        with self.ctx():
            return self.built.fn(*self.leaves)

    def _grad(self, y, retain):
        with self.ctx():
            return torch.autograd.grad(_outs(y), self.wrt, self.grads, retain_graph=retain)

    def builder(self, mode):
        b = self.built
        if isinstance(b, Calls):
            fn = getattr(b, mode)
            if fn is None and mode == "full" and b.fwd is not None and b.bwd is not None:
                return lambda: (b.fwd(), b.bwd())
            return fn
        if mode == "fwd":
            return self._call
        if mode == "bwd":
            y = self._call()  # the graph every timed backward replays
            return lambda: self._grad(y, True)
        return lambda: self._grad(self._call(), False)

    def result(self):
        b = self.built
        if isinstance(b, Calls):
            return None if b.result is None else [t.detach() for t in b.result()]
        y = _outs(self._call())
        return [t.detach() for t in y] + list(self._grad(y, False))


@contextlib.contextmanager
def configured(config: dict):
    """`miles_ext_kernels.configure(**config)` inside the block, the defaults after it."""
    import miles_ext_kernels as mek

    mek.configure(**config)
    try:
        yield
    finally:
        mek.configure()


def _work(fn, params, mode):
    if fn is None:
        return None
    v = fn(params, mode)
    if v is None and mode == "full":
        f, b = fn(params, "fwd"), fn(params, "bwd")
        v = None if f is None or b is None else f + b
    return v


class _Run:
    """The state of one `run`: options, and the rows / accuracy / skips / failures collected so far."""

    def __init__(self, args, device):
        self.args, self.device, self.dry = args, device, args.dry_run
        self.rows, self.accuracy, self.skipped, self.failures = [], [], [], []
        self.want = set(filter(None, (args.providers or "").split(","))) or None
        self.skip = set(filter(None, args.skip.split(",")))

    def note_skip(self, op, shape, provider, reason):
        print(f"skip {op} / {shape} / {provider}: {reason}", flush=True)
        self.skipped.append({"op": op, "shape": shape, "provider": provider, "reason": reason})

    def note_failure(self, op, shape, provider, err, ours):
        reason = f"{type(err).__name__}: {err}"[:300]
        print(f"FAILED {op} / {shape} / {provider}: {reason}", flush=True)
        if ours:
            traceback.print_exc()
        self.failures.append({"op": op, "shape": shape, "provider": provider, "reason": reason, "ours": ours})

    def providers(self, bench):
        """The providers this run times, after --providers / --skip, import checks and the device."""
        out = []
        for p in bench.providers:
            if (self.want and p.name not in self.want) or p.name in self.skip:
                continue
            if self.device == "cpu" and not p.on_cpu:
                self.note_skip(bench.name, "*", p.name, "needs a CUDA GPU")
                continue
            try:
                for m in p.requires:
                    importlib.import_module(m)
            except Exception as e:  # noqa: BLE001 - a peer that does not import is skipped, whatever the reason
                self.note_skip(bench.name, "*", p.name, f"{m} does not import: {e!r}"[:300])
                continue
            out.append(p)
        return out

    def time(self, bench, fn):
        if self.dry:
            ms = _dry_ms(fn, self.device)
            return {t: ms for t in bench.timers}
        rep = self.args.rep or bench.rep
        out = {}
        for t in bench.timers:
            kw = {"warmup": bench.warmup, "rep": rep}
            if t == "device":
                kw["lead_ms"] = bench.lead_ms
            out[t] = TIMERS[t](fn, **kw)
        return out

    def time_shape(self, bench, providers, modes, label, params):
        inputs = bench.inputs(params, self.device)
        for p in providers:
            if p.when is not None and not p.when(label, params):
                continue
            base = {"op": bench.name, "shape": label, "provider": p.name}
            try:
                with configured(p.config):
                    timed = Timed(p.make(inputs, params))
                    rows = []
                    for mode in modes:
                        fn = timed.builder(mode)
                        if fn is None:
                            continue
                        row = dict(base, mode=mode)
                        times = self.time(bench, fn)
                        del fn
                        fl, nb = _work(bench.flops, params, mode), _work(bench.io_bytes, params, mode)
                        for t, ms in times.items():
                            row[f"{t}_ms"] = ms
                            if fl is not None:
                                row[f"{t}_tflops"] = fl / ms / 1e9
                            if nb is not None:
                                row[f"{t}_tbps"] = nb / ms / 1e9
                        rows.append(row)
                        print(_line(row), flush=True)
                    if p.det:
                        a, b = timed.result(), timed.result()
                        if a is None:
                            raise TypeError("det=True needs the provider's result() (Autograd, or Calls.result)")
                        same = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
                        for row in rows:
                            row["bits_repeat"] = same
                        print(f"  {p.name} / {label}: det bits repeat: {same}", flush=True)
                    self.rows += rows
            except Skip as e:
                self.note_skip(bench.name, label, p.name, str(e))
            except Exception as e:  # noqa: BLE001 - recorded; one provider's failure does not stop the others
                self.note_failure(bench.name, label, p.name, e, p.ours)
            finally:
                timed = None
                _empty_cache(self.device)

    def accuracy_shape(self, bench, providers, label, params):
        inputs = bench.inputs(params, self.device)
        if callable(bench.reference):
            ref = [t.detach() for t in bench.reference(inputs, params)]
        else:
            p = next((q for q in providers if q.name == bench.reference), None)
            if p is None:
                self.note_skip(bench.name, label, "accuracy", f"reference {bench.reference!r} does not run here")
                return
            try:
                with configured(p.config):
                    ref = Timed(p.make(inputs, params)).result()
            except Exception as e:  # noqa: BLE001
                self.note_failure(bench.name, label, f"accuracy reference {p.name}", e, False)
                return
        for p in providers:
            if not p.accuracy or p.name == bench.reference or (p.when is not None and not p.when(label, params)):
                continue
            try:
                with configured(p.config):
                    got = Timed(p.make(inputs, params)).result()
                if got is None:
                    continue
                if len(got) != len(ref):
                    raise ValueError(f"{len(got)} result tensors, the reference has {len(ref)}")
                names = bench.result_names or tuple(f"t{i}" for i in range(len(ref)))
                row = {"op": bench.name, "shape": label, "provider": p.name}
                row.update({f"err_{n}": rel_rms(g, r) for n, g, r in zip(names, got, ref)})
                self.accuracy.append(row)
                print(_line(row), flush=True)
            except Skip as e:
                self.note_skip(bench.name, label, p.name, str(e))
            except Exception as e:  # noqa: BLE001
                self.note_failure(bench.name, label, f"accuracy {p.name}", e, p.ours)
            finally:
                got = None
                _empty_cache(self.device)


def _empty_cache(device):
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _line(row: dict) -> str:
    return "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


def run(benches, args=None, *, extra: dict | None = None) -> int:
    """Time `benches` (one `Bench` or several written to one file) and write `<out>/<name>.json`; print one
    table of times (and one of accuracy). `args`: a namespace from `parser()` (plus a file's own options), an
    argv list, or None (sys.argv). Returns 0, or 1 when one of our providers failed."""
    benches = [benches] if isinstance(benches, Bench) else list(benches)
    if args is None or isinstance(args, (list, tuple)):
        args = parser().parse_args(args)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and not args.dry_run:
        raise SystemExit("the benchmarks time kernels on a CUDA GPU; --dry-run runs them on CPU (interpreter)")
    if device == "cpu" and not torch.cuda.is_available():
        # before any kernel module is imported (triton.jit reads it when a kernel is decorated); never where a GPU
        # is visible, where other code in this process may launch real kernels
        os.environ.setdefault("TRITON_INTERPRET", "1")
    name = args.name or benches[0].name
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "mek-bench-dry-run" if args.dry_run
                                           else RESULTS)
    timers = list(dict.fromkeys(t for b in benches for t in b.timers))
    r = _Run(args, device)

    def write(complete: bool) -> Path:
        doc = {"format": FORMAT, "dry_run": bool(args.dry_run), "complete": complete, "device": device,
               "timers": timers, "timer_note": "Times: " + "; ".join(f"{t} = {TIMER_DOC[t]}" for t in timers) + ".",
               "modes_note": "fwd: the forward with autograd recording; bwd: autograd.grad on a retained graph; "
                             "full: forward + backward.",
               "accuracy": r.accuracy, "skipped": r.skipped, "failures": r.failures, **(extra or {})}
        return write_results(name, r.rows, doc, out_dir=out)

    for bench in benches:
        modes = tuple(args.modes.split(",")) if args.modes else bench.modes
        bad = [m for m in modes if m not in MODES] + [t for t in bench.timers if t not in TIMERS]
        if bad:
            raise SystemExit(f"{bench.name}: unknown modes / timers {bad}")
        providers = r.providers(bench)
        shapes = bench.dry_shapes if args.dry_run else bench.shapes
        for label, params in shapes.items():
            if args.only and args.only not in label:
                continue
            r.time_shape(bench, providers, modes, label, params)
            write(False)  # a run cut short (a timeout) still leaves the shapes it finished
            print(f"{bench.name} / {label}: done", flush=True)
        if bench.reference is not None:
            for label, params in (bench.dry_accuracy if args.dry_run else bench.accuracy).items():
                if args.only and args.only not in label:
                    continue
                r.accuracy_shape(bench, providers, label, params)
    path = write(True)
    metric = [m for m in ("tflops", "tbps") if any(f"{timers[0]}_{m}" in row for row in r.rows)]
    print()
    print_table(r.rows, ["shape", "provider", "mode"] + [f"{t}_ms" for t in timers]
                + [f"{t}_{m}" for m in metric for t in timers] + (["bits_repeat"] if any(
                    "bits_repeat" in row for row in r.rows) else []))
    if r.accuracy:
        print()
        print_table(r.accuracy, list(dict.fromkeys(k for row in r.accuracy for k in row)))
    for f in r.failures:
        print(f"FAILED {f['op']} / {f['shape']} / {f['provider']}: {f['reason']}")
    print(f"wrote {path}" + (" (dry run: the times are one call's wall time, not measurements)"
                             if args.dry_run else ""))
    return 1 if any(f["ours"] for f in r.failures) else 0
