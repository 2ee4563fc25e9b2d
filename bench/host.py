"""Host time per call of every op beside its peers' launchers, in one run (issue 20's host-path bars).

Each op's own declaration (bench/<op>.py: the same providers, ours and the peers, the same inputs) on one tiny
shape at the models' head dims, timed by the harness's `host` timer (`_common.host_ms`: N calls back to back,
wall clock / N, one sync at the end) and `device` beside it (how much of that the GPU needed). Modes: fwd (autograd
recording, as in training) and full (forward + backward, a fresh graph per call). Bars for ours: fwd <= 25 us and
full <= 60 us for rmsnorm, gated_rmsnorm and conv1d; <= 40 / 100 us for gqa and gdn (kda is reported beside them).
Prints the table and the bars; writes bench/results/host.json (host_ms, device_ms per row, and `bars`).

    python bench/host.py [--dry-run] [harness options: --help]
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import conv1d as bench_conv1d  # noqa: E402
import gdn as bench_gdn  # noqa: E402
import gqa as bench_gqa  # noqa: E402
import kda as bench_kda  # noqa: E402
import norms as bench_norms  # noqa: E402
from _common import RESULTS, parser, print_table, run  # noqa: E402

# op -> (its tiny shape's label and params, bar fwd us, bar full us)
TINY = {
    "rmsnorm": ("T64 H2048", {"T": 64, "H": 2048, "peers": True}, 25, 60),
    "gated_rmsnorm": ("T64 4x128", {"T": 64, "NH": 4, "D": 128, "peers": True}, 25, 60),
    "conv1d": ("2 docs x 32 D2048 W4", {"lens": [32, 32], "T": 64, "D": 2048, "W": 4, "wdt": "bfloat16"}, 25, 60),
    "gqa": ("2 docs x 64 Hq16/Hkv2", {"lens": [64, 64], "hq": 16, "hkv": 2}, 40, 100),
    "gdn": ("2 docs x 64 H16/HV32", dict(bench_gdn.DIMS, lens=[64, 64]), 40, 100),
    "kda": ("2 docs x 64 H32", dict(bench_kda.MODELS["Kimi-Linear H32"], lens=[64, 64]), None, None),
}


def declare() -> list:
    """Every op's declaration with its shapes swapped for its tiny one and the host / device timers."""
    benches = [bench_norms.rmsnorm_bench((64,)), bench_norms.gated_bench((64,)), bench_conv1d.declare(),
               bench_gqa.declare(flex=False), bench_gdn.declare(quick=True), bench_kda.declare(quick=True)]
    out = []
    for b in benches:
        label, params, _, _ = TINY[b.name]
        out.append(replace(b, shapes={label: params}, modes=("fwd", "full"), timers=("host", "device"), warmup=20,
                           rep=200, flops=None, io_bytes=None, reference=None, accuracy={}, dry_accuracy={}))
    return out


def bars(rows: list) -> list:
    """Per row of ours with a bar: host us, the bar, met."""
    out = []
    for r in rows:
        fwd_bar, full_bar = TINY[r["op"]][2:]
        bar = fwd_bar if r["mode"] == "fwd" else full_bar
        if bar is None or not r["provider"].startswith("cake") or "host_ms" not in r:
            continue
        us = r["host_ms"] * 1e3
        out.append({"op": r["op"], "provider": r["provider"], "mode": r["mode"], "host_us": us, "bar_us": bar,
                    "met": us <= bar})
    return out


def main(argv=None) -> int:
    args = parser(__doc__).parse_args(argv)
    args.name = args.name or "host"
    rc = run(declare(), args)
    if args.dry_run:
        return rc
    path = Path(args.out or RESULTS) / f"{args.name}.json"
    doc = json.loads(path.read_text())
    doc["bars"] = bars(doc["rows"])
    path.write_text(json.dumps(doc, indent=1))
    print()
    print_table(doc["bars"], ["op", "provider", "mode", "host_us", "bar_us", "met"])
    return rc


if __name__ == "__main__":
    sys.exit(main())
