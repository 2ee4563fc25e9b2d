"""Where the host time of our ops goes: cProfile of each op's det forward + backward on bench/host.py's tiny shapes.

For every op of bench/host.py (its declaration, its tiny shape, the provider "cake det"): host time per call of
fwd and full (`_common.host_ms`), then `--calls` full calls under cProfile: the kernel launches per call and the
top functions by own time.
`--floor` also times bare Triton launches (one kernel with 1 and with 24 arguments, keyword and positional) and an
empty autograd.Function forward + backward: the floors the host path stands on.

    python bench/host_profile.py [--ops rmsnorm,gdn] [--calls 200] [--top 25] [--floor]    # on the GPU
    python bench/host_profile.py --no-launch     # CPU tensors through the interpreter's tables, every launch skipped:
                                                  # the Python path alone (checks, tables, autograd, allocation)
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))
if "--no-launch" in sys.argv:  # before triton is imported: its jit reads it when a kernel is decorated
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _one(x):
    pass


@triton.jit
def _many(a0, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, n0, n1, n2, n3, n4, n5, n6, n7,
          C0: tl.constexpr, C1: tl.constexpr, C2: tl.constexpr, C3: tl.constexpr):
    pass


class _SkipLaunches:
    """Stands in for `collect_routes()`'s RouteSet: `launch` hands it each launch, which it drops."""

    def add_launch(self, kernel, kwargs):
        pass


def _floor(host_ms) -> None:
    import torch

    t = [torch.empty(16, device="cuda") for _ in range(12)]
    ints = [i * 16 + 64 for i in range(8)]
    kw = {f"a{i}": t[i] for i in range(12)} | {f"n{i}": ints[i] for i in range(8)} | dict(C0=1, C1=2, C2=4, C3=8)
    pos = t + ints + [1, 2, 4, 8]

    class Empty(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            return g

    x = torch.empty(16, device="cuda", requires_grad=True)
    from miles_ext_kernels.cake._runtime.launch import launch

    rows = [("triton launch, 1 argument", lambda: _one[(1,)](t[0])),
            ("triton launch, 24 arguments by keyword", lambda: _many[(1,)](**kw)),
            ("our launch(), 24 arguments (direct path once compiled)", lambda: launch(_many, (1,), **kw)),
            ("triton launch, 24 arguments by position", lambda: _many[(1,)](*pos)),
            ("torch.empty(64 x 2048 bf16) on cuda", lambda: torch.empty(64, 2048, dtype=torch.bfloat16, device="cuda")),
            ("empty autograd.Function forward", lambda: Empty.apply(x)),
            ("empty autograd.Function fwd + autograd.grad", lambda: torch.autograd.grad(Empty.apply(x), x, x))]
    for name, fn in rows:
        print(f"floor  {name:50s} {host_ms(fn, 50, 2000) * 1e3:8.2f} us")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="rmsnorm,gated_rmsnorm,conv1d,gqa,gdn,kda")
    ap.add_argument("--calls", type=int, default=200, help="full calls under cProfile")
    ap.add_argument("--top", type=int, default=25, help="functions printed per op")
    ap.add_argument("--floor", action="store_true", help="also time bare launches and an empty autograd.Function")
    ap.add_argument("--no-launch", action="store_true", help="CPU tensors, launches skipped (the Python path)")
    args = ap.parse_args(argv)
    import time

    import host
    import torch
    from _common import Timed, configured, host_ms

    from miles_ext_kernels.cake._runtime import launch

    device = "cpu" if args.no_launch else "cuda"
    if args.no_launch:
        def host_ms(fn, warmup=20, rep=200):  # noqa: F811 - no GPU to sync: plain wall clock
            for _ in range(warmup):
                fn()
            t0 = time.perf_counter()
            for _ in range(rep):
                fn()
            return (time.perf_counter() - t0) * 1e3 / rep
    if args.floor and not args.no_launch:
        _floor(host_ms)
    want = args.ops.split(",")
    for bench in host.declare():
        if bench.name not in want:
            continue
        label, params = next(iter(bench.shapes.items()))
        prov = next(p for p in bench.providers if p.name == "cake det")
        inputs = bench.inputs(params, device)
        if args.no_launch:
            launch._collecting.routes = _SkipLaunches()
        try:
            with configured(prov.config):
                timed = Timed(prov.make(inputs, params))
                fwd, full = timed.builder("fwd"), timed.builder("full")
                f_us, b_us = host_ms(fwd) * 1e3, host_ms(full) * 1e3
                print(f"\n== {bench.name} / {label} / cake det: fwd {f_us:.1f} us, full {b_us:.1f} us per call")
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(args.calls):
                    full()
                if device == "cuda":
                    torch.cuda.synchronize()
                prof.disable()
        finally:
            launch._collecting.routes = None
        stats = pstats.Stats(prof)
        n_launch = sum(v[1] for (file, _, fn), v in stats.stats.items()
                       if fn == "launch" and file.replace("\\", "/").endswith("cake/_runtime/launch.py"))
        print(f"-- launches per fwd + bwd call: {n_launch / args.calls:g} (our `launch()`)")
        for order, restrict in (("tottime", ()), ("cumtime", ("miles_ext_kernels",))):
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats(order).print_stats(*restrict, args.top)
            text = s.getvalue()
            print(f"-- by {order}{' (our functions)' if restrict else ''}, {args.calls} calls:")
            print(text[text.index("ncalls"):].rstrip() if "ncalls" in text else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
