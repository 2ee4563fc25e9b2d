"""Config variants of one delta-rule op, in one process on the GPU: fwd + bwd device time per variant and whether
its bits equal the first variant's.

    python bench/cfg_sweep.py --op gdn --cfg '{}' --cfg '{"dqkw": {"maxnreg": 168}}' [--case 16x2048] [--rounds 2]
                              [--out FILE]

Each --cfg updates entries of the op's launch-config table (`_impl/<op>/configs.CFG`, as bench/kda_profile.py's
--cfg), starting from the shipped table; '{}' is the shipped table itself. The op is called through its public entry
point on bench/ab.py's inputs for the case (default: the first of bench/ab.py's layouts for the op), det; the time is
`_common.device_ms` (min over --rounds). For variants that change the schedule, not the arithmetic (warps, stages,
register caps), the bits must stay: a variant that changes them is reported, not hidden. Per-kernel times of kda's
variants: bench/kda_profile.py."""
from __future__ import annotations

import argparse
import copy
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

SWEPT_OPS = ("gdn", "kda")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--op", choices=SWEPT_OPS, required=True)
    ap.add_argument("--cfg", action="append", required=True)
    ap.add_argument("--case", help="a layout label of bench/ab.py's cases for the op")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out")
    a = ap.parse_args(argv)
    import ab
    import torch
    from _common import device_ms, env_info, print_table

    import miles_ext_kernels as mek

    mek.configure()
    configs = importlib.import_module(f"miles_ext_kernels.cake._impl.{a.op}.configs")
    shipped = copy.deepcopy(configs.CFG)
    cases, inputs, call = ab.OPS[a.op]
    layouts = cases()
    label = a.case or next(iter(layouts))
    if label not in layouts:
        ap.error(f"unknown case {label!r}; known: {sorted(layouts)}")
    x = inputs(layouts[label])
    rows, first = [], None
    for text in a.cfg:
        variant = json.loads(text)
        configs.CFG.clear()  # in place: the per-arch tables hold this dict
        configs.CFG.update(copy.deepcopy(shipped))
        for name, entry in variant.items():
            configs.CFG[name].update(entry)
        res = [t.detach().clone() for t in call("miles_ext_kernels", x)]
        same = None if first is None else all(torch.equal(p, r) for p, r in zip(first, res))
        first = first or res
        ms = min(device_ms(lambda: call("miles_ext_kernels", x), warmup=3, rep=10, lead_ms=5.0)
                 for _ in range(a.rounds))
        rows.append(dict(op=a.op, case=label, cfg=json.dumps(variant), device_ms=ms, bits_equal_first=same))
        print_table([rows[-1]], list(rows[-1]))
    configs.CFG.clear()
    configs.CFG.update(shipped)
    if a.out:
        Path(a.out).write_text(json.dumps({**env_info(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
