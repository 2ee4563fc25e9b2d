"""Context parallelism over a real process group: gdn and kda per layer call on W GPUs (one process per rank, NCCL),
against the plain call on each rank's own tokens, in one run (issue 22's `bench/cp.py --gpus W`).

Same shapes as bench/cp.py (4 x 32768 tokens, and with --long 1 x 131072; gdn at Qwen3-Next's heads, kda at
Kimi-Linear's), contiguous W and zigzag W. Per rank and provider, forward + backward through the public entry
points: "cp" = `cp_context=cake.build_cp_context(...)` (the exchange included), "per-rank" = the plain call on the
rank's tokens with its local documents (no exchange). Each repetition starts after a barrier and a sync, is timed
with CUDA events, and a step's time is the slowest rank's (the ranks wait for each other in the all_gathers). The
all_gather bytes a rank sends per call are printed beside it. Rank 0 prints the table and writes
bench/results/cp_nccl.json.

    python bench/cp_nccl.py [--gpus 2] [--long] [--rep 10]     # spawns the W rank processes itself
    python bench/cp_nccl.py --dry-run                           # 2 gloo ranks on CPU (interpreter), tiny shapes
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

BAR = 1.15  # issue 19's bar, read here against the per-rank plain calls on W real GPUs


def shapes(long: bool, dry: bool) -> dict:
    if dry:
        return {"gdn 2 docs": dict(op="gdn", H=1, HV=2, K=16, V=16, lens=[32, 32]),
                "kda 2 docs": dict(op="kda", H=1, HV=2, K=16, V=16, lens=[32, 32])}
    import cp as bench_cp

    out = {f"{op} 4x32768": dict(dims, op=op, lens=[32768] * 4) for op, dims in bench_cp.OPS.items()}
    if long:
        out |= {f"{op} 1x131072": dict(dims, op=op, lens=[131072]) for op, dims in bench_cp.OPS.items()}
    return out


def _timer(device: str):
    """ms of one call: CUDA events on a GPU, the wall clock on CPU (a dry run)."""
    import torch

    def cuda_ms(fn):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    def cpu_ms(fn):
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3

    return cuda_ms if device.startswith("cuda") else cpu_ms


def _calls(x, p, ctx):
    """(cp call, per-rank plain call): forward + backward of this rank's shard."""
    import cp as bench_cp
    import torch

    from miles_ext_kernels.cake import gdn, kda
    from miles_ext_kernels.cake._runtime import cp as rcp

    names = bench_cp.NAMES + (("A_log", "dt_bias") if p["op"] == "kda" else ())
    shard = {n: (rcp.shard(x[n], ctx) if n in bench_cp.NAMES else x[n]).contiguous() for n in names}
    do = rcp.shard(x["do"], ctx).contiguous()

    def call(**kw):
        leaves = [shard[n].detach().requires_grad_(True) for n in names]
        if p["op"] == "gdn":
            o = gdn.chunk_gated_delta_rule(*leaves, use_qk_l2norm_in_kernel=True, **kw)[0]
        else:
            o = kda.chunk_kda(*leaves[:5], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=leaves[5],
                              dt_bias=leaves[6], safe_gate=True, lower_bound=bench_cp.SAFE_LB, **kw)[0]
        return torch.autograd.grad(o, leaves, do)

    return (lambda: call(cp_context=ctx)), (lambda: call(cu_seqlens=ctx.cu_seqlens))


def rank_main(args) -> None:
    import cp as bench_cp
    import torch
    import torch.distributed as dist
    from _common import env_info, print_table, write_results

    from miles_ext_kernels import cake

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = "cpu"
    if args.backend == "nccl":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    group = dist.group.WORLD
    ms = _timer(device)
    rows = []
    for label, p in shapes(args.long, args.dry_run).items():
        x = bench_cp.make(p, device)
        for layout in ("contiguous", "zigzag"):
            if layout == "zigzag" and any(n % (2 * world) for n in p["lens"]):
                continue
            ctx = cake.build_cp_context(x["cu"], group, layout=layout)
            cp_call, plain_call = _calls(x, p, ctx)
            for name, fn in ((f"cp W={world} {layout}", cp_call), (f"per-rank W={world} {layout}", plain_call)):
                times = []
                for i in range(args.warmup + args.rep):
                    dist.barrier(group)
                    if device != "cpu":
                        torch.cuda.synchronize()
                    t = ms(fn)
                    if i >= args.warmup:
                        times.append(t)
                times.sort()
                mine = times[len(times) // 2]
                every = [None] * world
                dist.all_gather_object(every, mine, group=group)
                row = {"op": p["op"], "shape": label, "provider": name, "mode": "full", "step_ms": max(every),
                       "rank_ms": every} | bench_cp.comm_bytes(ctx, p)
                rows.append(row)
                if rank == 0:
                    print(f"{label} / {name}: {max(every):.3f} ms (ranks {['%.3f' % t for t in every]})", flush=True)
    if rank == 0:
        ratios = []
        for r in rows:
            if r["provider"].startswith("cp "):
                base = next(b for b in rows if b["shape"] == r["shape"] and b["provider"] == "per-rank"
                            + r["provider"][2:])
                ratios.append({"shape": r["shape"], "plan": r["provider"][3:], "cp_ms": r["step_ms"],
                               "per_rank_ms": base["step_ms"], "cp / per-rank": r["step_ms"] / base["step_ms"],
                               "fwd_bytes": r["fwd_bytes"], "bwd_bytes": r["bwd_bytes"]})
        print()
        print_table(ratios, ["shape", "plan", "cp_ms", "per_rank_ms", "cp / per-rank", "fwd_bytes", "bwd_bytes"])
        extra = {"world": world, "backend": args.backend, "bar": BAR, "ratios": ratios, "dry_run": args.dry_run,
                 "rank0": env_info()}
        path = write_results("cp_nccl", rows, extra, out_dir=args.out)
        print(f"wrote {path}")
    dist.destroy_process_group()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2, help="ranks, one GPU each (default 2)")
    ap.add_argument("--long", action="store_true", help="also 1 x 131072 tokens")
    ap.add_argument("--rep", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--dry-run", action="store_true", help="2 gloo ranks on CPU, tiny shapes, one repetition")
    ap.add_argument("--out", default=None, help="folder for cp_nccl.json (default bench/results)")
    ap.add_argument("--backend", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--_rank", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
        import tempfile

        args.gpus, args.rep, args.warmup, args.backend = 2, 1, 0, "gloo"
        args.out = args.out or tempfile.mkdtemp(prefix="cp_nccl_dry_")
    args.backend = args.backend or "nccl"
    if args._rank:
        rank_main(args)
        return 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, __file__, "--_rank", "--backend", args.backend, "--rep", str(args.rep), "--warmup",
           str(args.warmup)] + (["--long"] if args.long else []) + (["--dry-run"] if args.dry_run else []) + (
           ["--out", args.out] if args.out else [])
    env = dict(os.environ, WORLD_SIZE=str(args.gpus), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               NCCL_NVLS_ENABLE="0")
    if args.dry_run:
        env["TRITON_INTERPRET"] = "1"
    procs = [subprocess.Popen(cmd, env=dict(env, RANK=str(r))) for r in range(args.gpus)]
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
