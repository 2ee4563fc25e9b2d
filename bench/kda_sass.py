"""ptxas counts of the kda chunk kernels for sm_90a, compiled offline (no GPU): registers, spills, MMA / FFMA / MUFU.

    /path/to/triton-3.6/python bench/kda_sass.py [KERNEL,KERNEL,...] [--cfg JSON]

Every route of `ops.routes()` (K = V = 128) of the named kernels (default: fwd_prep_kernel, bwd_wy_kernel,
bwd_dqkw_kernel) is compiled at `configs.CFG` (entries updated from --cfg, e.g. '{"dqkw": {"BK": 64, "BK_dk": 64}}')
the way bench/sass.py compiles the gqa kernels, and ptxas -v is re-run on its PTX. Counts are static (both sides of a
runtime branch, once)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernels", nargs="?", default="fwd_prep_kernel,bwd_wy_kernel,bwd_dqkw_kernel")
    ap.add_argument("--cfg", default="{}", help="JSON: config entries to update before the routes are enumerated")
    args = ap.parse_args()
    import sass as S
    from triton.backends.compiler import GPUTarget

    from miles_ext_kernels.cake._impl.kda import configs, ops
    from miles_ext_kernels.cake._runtime import build as B

    B.device_arch = ops.device_arch = lambda device=None: "sm_90a"  # routes() asks the GPU's arch; there is none
    for name, entry in json.loads(args.cfg).items():
        configs.CFG[name].update(entry)
    want, seen = set(args.kernels.split(",")), set()
    for r in ops.routes():
        name = r.kernel.fn.__name__
        if name not in want or r.label in seen:
            continue
        seen.add(r.label)
        ck = S._compile(r, GPUTarget("cuda", 90, 32))
        ops_ = [i.split()[1] if i.startswith("@") else i.split()[0] for i in S.instructions(S._sass(ck.asm["cubin"]))]
        rep = S._ptxas_report(ck.asm["ptx"])
        tag = " ".join(f"{k}={r.args[k]}" for k in ("GATE", "PHASE", "BK", "num_warps") if k in r.args)
        cnt = {p: sum(o.startswith(p) for o in ops_) for p in ("HGMMA", "HMMA", "FFMA", "MUFU")}
        print(f"{name:16s} {tag:30s} regs {rep['registers']} stack {rep['stack']} spill st/ld "
              f"{rep['spill_stores']}/{rep['spill_loads']} smem {ck.metadata.shared} "
              + " ".join(f"{k} {v}" for k, v in cnt.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
