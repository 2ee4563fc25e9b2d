"""A/B of the library against an earlier commit, in one process on the GPU: det bits and device time per op.

    python bench/ab.py prepare REF [--name mek_old]   # here (needs git): the package at REF, renamed, into .ab/NAME
    python bench/ab.py run [--ops gdn,gqa] [--rounds 3] [--out FILE] [--old mek_old]   # on the GPU (carry .ab)

`prepare` exports `miles_ext_kernels` at REF as the package NAME (default `mek_old`; every `miles_ext_kernels`
renamed, custom ops included), so both versions import side by side; several prepared names let one GPU call A/B
the working tree against several commits (`run --old NAME`). `run` calls each op's public entry point (det,
default options) forward + backward on the benchmark layouts with both packages on the same inputs, checks every
output and gradient with `torch.equal`, and times both in device time (`_common.device_ms`), interleaved over `--rounds`
rounds (min per side). Prints a table; `--out` writes the rows as JSON.
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AB = ROOT / ".ab"


def prepare(ref: str, name: str = "mek_old") -> None:
    if not re.fullmatch(r"mek_[a-z0-9_]+", name):
        raise SystemExit(f"--name must look like mek_<letters, digits, _>, got {name!r}")
    dst = AB / name
    shutil.rmtree(dst, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        tar = Path(tmp) / "src.tar"
        subprocess.run(["git", "archive", "-o", str(tar), ref, "miles_ext_kernels"], cwd=ROOT, check=True)
        with tarfile.open(tar) as tf:
            tf.extractall(tmp)
        shutil.move(str(Path(tmp) / "miles_ext_kernels"), dst)
    for p in dst.rglob("*.py"):
        p.write_text(re.sub(r"\bmiles_ext_kernels\b", name, p.read_text()))
    rev = subprocess.run(["git", "rev-parse", "--short", ref], cwd=ROOT, capture_output=True, text=True).stdout
    (dst / "REF").write_text(rev)
    print(f"{dst}: miles_ext_kernels at {rev.strip()}")


# ---------------------------------------------------------------------------------------------------- per op
def _gen(seed=0):
    import torch

    return torch.Generator().manual_seed(seed)


def _cu(lens, device="cuda"):
    import torch

    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)


def gqa_cases():
    sys.path.insert(0, str(ROOT / "bench"))
    from gqa import irregular_lengths

    return {"16x2048 Hq16/Hkv2": ([2048] * 16, 16, 2), "irregular Hq24/Hkv4": (irregular_lengths(), 24, 4),
            "256x128 Hq16/Hkv2": ([128] * 256, 16, 2), "1024x32 Hq16/Hkv2": ([32] * 1024, 16, 2),
            "1x32768 Hq16/Hkv2": ([32768], 16, 2)}


def gqa_inputs(case):
    import torch

    lens, hq, hkv = case
    g, T = _gen(), sum(lens)
    x = {n: torch.randn(T, h, 256, generator=g).to("cuda", torch.bfloat16)
         for n, h in (("q", hq), ("k", hkv), ("v", hkv), ("do", hq))}
    x["cu"], x["max"] = _cu(lens), max(lens)
    return x


def gqa_call(pkg, x):
    import torch

    mod = importlib.import_module(pkg + ".cake.gqa")
    q, k, v = (x[n].clone().requires_grad_() for n in ("q", "k", "v"))
    out, lse = mod.varlen_gqa_attention(q, k, v, x["cu"], x["cu"], max_seqlen_k=x["max"], return_lse=True)
    return [out, lse, *torch.autograd.grad(out, (q, k, v), x["do"])]


def gdn_cases():
    sys.path.insert(0, str(ROOT / "bench"))
    import gdn as bench_gdn

    return dict(bench_gdn.layouts(quick=False))


def gdn_inputs(lens):
    sys.path.insert(0, str(ROOT / "bench"))
    import gdn as bench_gdn

    return bench_gdn.make(lens)


def gdn_call(pkg, x):
    import torch

    mod = importlib.import_module(pkg + ".cake.gdn")
    leaves = [x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta", "h0")]
    o, ht = mod.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                       use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu"])
    return [o, ht, *torch.autograd.grad((o, ht), leaves, (x["do"], x["dht"]))]


def kda_cases():
    sys.path.insert(0, str(ROOT / "bench"))
    import kda as bench_kda

    return bench_kda.shapes(quick=True)  # both models at 16 x 2048


def kda_inputs(p):
    sys.path.insert(0, str(ROOT / "bench"))
    import kda as bench_kda

    return dict(bench_kda.make(p), _p=p)


def kda_call(pkg, x):
    import torch

    sys.path.insert(0, str(ROOT / "bench"))
    import kda as bench_kda

    mod = importlib.import_module(pkg + ".cake.kda")
    p = x["_p"]
    leaves = [x[n].clone().requires_grad_() for n in bench_kda.ARGS]
    o, ht = mod.chunk_kda(*leaves[:5], initial_state=leaves[7], output_final_state=True, use_qk_l2norm_in_kernel=True,
                          A_log=leaves[5], dt_bias=leaves[6], transpose_state_layout=p["trans"], cu_seqlens=x["cu"],
                          **bench_kda._gate_kwargs(p))
    return [o, ht, *torch.autograd.grad((o, ht), leaves, (x["do"], x["dht"]))]


def conv1d_cases():
    return {"D12288 W4 16x2048": [2048] * 16, "D12288 W4 1x32768": [32768]}


def conv1d_inputs(lens):
    import torch

    g, T = _gen(), sum(lens)
    return dict(x=torch.randn(T, 12288, generator=g).to("cuda", torch.bfloat16),
                w=(0.5 * torch.randn(12288, 4, generator=g)).to("cuda"),
                dy=torch.randn(T, 12288, generator=g).to("cuda", torch.bfloat16), cu=_cu(lens))


def conv1d_call(pkg, x):
    import torch

    mod = importlib.import_module(pkg + ".cake.conv1d")
    xx, w = x["x"].clone().requires_grad_(), x["w"].clone().requires_grad_()
    y = mod.causal_conv1d(xx, w, cu_seqlens=x["cu"], activation="silu")
    return [y, *torch.autograd.grad(y, (xx, w), x["dy"])]


def rmsnorm_cases():
    return {"32768x2048": 2048, "32768x5120": 5120}


def rmsnorm_inputs(h):
    import torch

    g = _gen()
    return dict(x=torch.randn(32768, h, generator=g).to("cuda", torch.bfloat16),
                w=(0.1 * torch.randn(h, generator=g)).to("cuda"),
                dy=torch.randn(32768, h, generator=g).to("cuda", torch.bfloat16))


def rmsnorm_call(pkg, x):
    import torch

    mod = importlib.import_module(pkg + ".cake.rmsnorm")
    xx, w = x["x"].clone().requires_grad_(), x["w"].clone().requires_grad_()
    y = mod.zero_centered_rmsnorm(xx, w)
    return [y, *torch.autograd.grad(y, (xx, w), x["dy"])]


def gated_rmsnorm_cases():
    return {"32768x32x128": (32, 128)}


def gated_rmsnorm_inputs(case):
    import torch

    hv, d = case
    g = _gen()
    shape = (32768, hv, d)
    return dict(x=torch.randn(shape, generator=g).to("cuda", torch.bfloat16),
                z=torch.randn(shape, generator=g).to("cuda", torch.bfloat16),
                w=(1 + 0.1 * torch.randn(d, generator=g)).to("cuda"),
                dy=torch.randn(shape, generator=g).to("cuda", torch.bfloat16))


def gated_rmsnorm_call(pkg, x):
    import torch

    mod = importlib.import_module(pkg + ".cake.gated_rmsnorm")
    xx, z, w = (x[n].clone().requires_grad_() for n in ("x", "z", "w"))
    y = mod.rmsnorm_silu_gate(xx, z, w)
    return [y, *torch.autograd.grad(y, (xx, z, w), x["dy"])]


OPS = {name: (globals()[name + "_cases"], globals()[name + "_inputs"], globals()[name + "_call"])
       for name in ("gqa", "gdn", "kda", "conv1d", "rmsnorm", "gated_rmsnorm")}


def run(ops, rounds: int, out: str | None, old: str = "mek_old") -> int:
    import torch

    sys.path.insert(0, str(AB))
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT))
    from _common import device_ms, env_info, print_table

    old_ref = (AB / old / "REF").read_text().strip()
    pkgs = (old, "miles_ext_kernels")
    for p in pkgs:
        importlib.import_module(p).configure()
    rows, bad = [], 0
    for op in ops:
        cases, inputs, call = OPS[op]
        for label, case in cases().items():
            x = inputs(case)
            res = {p: [t.detach() for t in call(p, x)] for p in pkgs}
            same = all(torch.equal(a, b) for a, b in zip(*res.values()))
            differ = [i for i, (a, b) in enumerate(zip(*res.values())) if not torch.equal(a, b)]
            best = {p: float("inf") for p in pkgs}
            for _ in range(rounds):
                for p in pkgs:
                    best[p] = min(best[p], device_ms(lambda p=p, x=x: call(p, x), warmup=3, rep=10, lead_ms=5.0))
            row = dict(op=op, case=label, bits_equal=same, differ=",".join(map(str, differ)),
                       old_ms=best[old], new_ms=best["miles_ext_kernels"])
            row["new/old"] = row["new_ms"] / row["old_ms"]
            rows.append(row)
            bad += not same
            print_table([row], list(row))
            del x, res
            torch.cuda.empty_cache()
    print()
    print(f"A/B: old = {old_ref}, new = working tree; device time of forward + backward, min of {rounds} rounds")
    print_table(rows, list(rows[0]))
    if out:
        Path(out).write_text(json.dumps({**env_info(), "old": old_ref, "rows": rows}, indent=1))
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("ref")
    p.add_argument("--name", default="mek_old")
    r = sub.add_parser("run")
    r.add_argument("--ops", default=",".join(OPS))
    r.add_argument("--rounds", type=int, default=3)
    r.add_argument("--out")
    r.add_argument("--old", default="mek_old", help="the prepared package to compare against (.ab/OLD)")
    a = ap.parse_args()
    if a.cmd == "prepare":
        prepare(a.ref, a.name)
        return 0
    ops = [o for o in a.ops.split(",") if o]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        ap.error(f"unknown ops {unknown}; known: {sorted(OPS)}")
    return run(ops, a.rounds, a.out, a.old)


if __name__ == "__main__":
    sys.exit(main())
