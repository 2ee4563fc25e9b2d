"""Where context parallelism's overhead goes: per-kernel device time of W simulated CP ranks against the plain call on
each rank's tokens (bench/cp.py's "cp" and "per-rank" providers), side by side (torch.profiler, fwd + bwd, N steps
after warm-up; run from the repository root on a GPU).

    python bench/cp_profile.py [--op gdn|kda] [--lens 131072x1] [--layout contiguous|zigzag] [--W 8]
        [--exchanges E] [--steps 5]

Prints one row per kernel name: ms per step under CP, per-rank, the difference and its launch counts; the rows
sorted by the difference (the kernels CP adds or slows first)."""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cp as C  # bench/cp.py

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--op", choices=tuple(C.OPS), default="gdn")
ap.add_argument("--lens", default="131072x1")
ap.add_argument("--layout", choices=("contiguous", "zigzag"), default="contiguous")
ap.add_argument("--W", type=int, default=8)
ap.add_argument("--exchanges", type=int, default=None, help="state_exchanges (default: the layout's)")
ap.add_argument("--steps", type=int, default=5)
args = ap.parse_args()
length, count = (int(v) for v in args.lens.split("x"))
p = dict(C.OPS[args.op], op=args.op, lens=[length] * count)
x = C.make(p)


def per_kernel(make_calls):
    calls = make_calls(x, p)
    for _ in range(2):
        calls.full()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            calls.full()
        torch.cuda.synchronize()
    out = defaultdict(lambda: [0.0, 0])
    for e in prof.key_averages():
        if e.device_time_total > 0:
            out[e.key][0] += e.device_time_total / args.steps / 1e3
            out[e.key][1] += e.count // args.steps
    return out


cp = per_kernel(C.simulated(args.layout, args.W, args.exchanges))
ref = per_kernel(C.per_rank(args.layout, args.W))
names = sorted(set(cp) | set(ref), key=lambda n: -(cp[n][0] - ref[n][0]))
tot_cp, tot_ref = sum(v[0] for v in cp.values()), sum(v[0] for v in ref.values())
print(f"{args.op} {args.lens} {args.layout} W={args.W} E={args.exchanges}: CP {tot_cp:.3f} ms/step, "
      f"per-rank {tot_ref:.3f} ({tot_cp / tot_ref:.3f}x), {torch.cuda.get_device_name()}")
print(f"{'CP ms':>9} {'rank ms':>9} {'diff':>8} {'calls':>11}  kernel")
for n in names:
    c, r = cp[n], ref[n]
    print(f"{c[0]:9.3f} {r[0]:9.3f} {c[0] - r[0]:+8.3f} {c[1]:5d}/{r[1]:<5d}  {n[:80]}")
