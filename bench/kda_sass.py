"""ptxas counts of the kda / gdn chunk kernels for sm_90a, compiled offline (no GPU); a SASS diff against a git ref.

    /path/to/triton-3.6/python bench/kda_sass.py [KERNEL,KERNEL,...] [--cfg JSON] [--op gdn]
    /path/to/triton-3.6/python bench/kda_sass.py all --against REF [--op gdn|conv1d|rmsnorm|gqa] [--out DIR] [--jobs N]

Every route of `ops.routes()` (K = V = 128; conv1d, rmsnorm: over ROUTE_KWARGS) of the named kernels (default:
fwd_grams_kernel, bwd_dense_kernel, bwd_intra_kernel; `all`: every kernel) is compiled at `configs.CFG` (entries updated
from --cfg, e.g. '{"intra": {"BK": 32}}') the way bench/sass.py compiles the gqa kernels, and ptxas -v is re-run on its
PTX. Counts are static (both sides of a runtime branch, once). `--against REF` instead writes each route's SASS to
DIR/tree, compiles the same routes of `miles_ext_kernels` at git REF (exported, in a subprocess) to DIR/ref, and reports
per route whether the two are the same instruction for instruction with addresses and branch targets masked
(bench/sass.py's `instructions`): a refactor of the kernels' source that should not change the compiled code is checked
with it. `--op gqa`: gqa's routes, its Triton kernels (kernels.py) as well as the Gluon ones bench/sass.py covers."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
if "--_build" not in sys.argv:  # a --_build subprocess imports the exported package from its PYTHONPATH
    sys.path.insert(0, str(ROOT))

DEFAULT = "fwd_grams_kernel,bwd_dense_kernel,bwd_intra_kernel"
OPS = ("kda", "gdn", "conv1d", "rmsnorm", "gqa")
# the routes() arguments an op's routes are enumerated over (gdn / kda: none, K = V = 128)
ROUTE_KWARGS = {"conv1d": [{"weight_dtype": "float32"}, {"weight_dtype": "bfloat16"}],
                "rmsnorm": [{"hidden_size": 2048}, {"hidden_size": 4096}]}


def _routes(op: str, kernels: str, cfg: str) -> list:
    """The routes of `op` (one per label) whose kernel is named in `kernels` (`all`: every kernel)."""
    import importlib

    from miles_ext_kernels.cake._runtime import build as B

    configs = importlib.import_module(f"miles_ext_kernels.cake._impl.{op}.configs")
    ops = importlib.import_module(f"miles_ext_kernels.cake._impl.{op}.ops")
    B.device_arch = ops.device_arch = lambda device=None: "sm_90a"  # routes() asks the GPU's arch; there is none
    for name, entry in json.loads(cfg).items():
        configs.CFG[name].update(entry)
    want, seen, out = set(kernels.split(",")), set(), []
    for r in (r for kw in ROUTE_KWARGS.get(op, [{}]) for r in ops.routes(**kw)):
        if (kernels != "all" and r.kernel.fn.__name__ not in want) or r.label in seen:
            continue
        seen.add(r.label)
        out.append(r)
    return out


def _counts(args) -> int:
    import sass as S
    from triton.backends.compiler import GPUTarget

    for r in _routes(args.op, args.kernels, args.cfg):
        name = r.kernel.fn.__name__
        ck = S._compile(r, GPUTarget("cuda", 90, 32))
        ops_ = [i.split()[1] if i.startswith("@") else i.split()[0] for i in S.instructions(S._sass(ck.asm["cubin"]))]
        rep = S._ptxas_report(ck.asm["ptx"])
        tag = " ".join(f"{k}={r.args[k]}" for k in ("GATE", "PHASE", "BK", "num_warps") if k in r.args)
        kinds = ("HGMMA", "HMMA", "FFMA", "MUFU", "STS", "LDS", "BAR", "SHFL")
        cnt = {p: sum(o.startswith(p) for o in ops_) for p in kinds}
        print(f"{name:16s} {tag:30s} regs {rep['registers']} stack {rep['stack']} spill st/ld "
              f"{rep['spill_stores']}/{rep['spill_loads']} smem {ck.metadata.shared} "
              + " ".join(f"{k} {v}" for k, v in cnt.items()), flush=True)
    return 0


_ROUTES: list = []


def _dump_one(i: int) -> tuple[str, str]:
    import sass as S
    from triton.backends.compiler import GPUTarget

    r = _ROUTES[i]
    return r.label, S._sass(S._compile(r, GPUTarget("cuda", 90, 32)).asm["cubin"])


def _build(args, out: Path) -> None:
    """Each route's SASS into out/<n>.sass and out/index.json (label -> file): routes compile in `jobs` processes."""
    import multiprocessing as mp

    _ROUTES[:] = _routes(args.op, args.kernels, args.cfg)
    out.mkdir(parents=True, exist_ok=True)
    with mp.get_context("fork").Pool(args.jobs) as pool:  # forked workers inherit the enumerated routes
        dumps = pool.map(_dump_one, range(len(_ROUTES)), chunksize=1)
    index = {}
    for n, (label, sass) in enumerate(dumps):
        (out / f"{n}.sass").write_text(sass)
        index[label] = f"{n}.sass"
    (out / "index.json").write_text(json.dumps(index, indent=1))


def _compare(ref: Path, tree: Path) -> bool:
    import sass as S

    idx_a, idx_b = (json.loads((d / "index.json").read_text()) for d in (ref, tree))
    same = True
    for label in sorted(set(idx_a) | set(idx_b)):
        if label not in idx_a or label not in idx_b:
            print(f"  {label}: only in {'the ref' if label in idx_a else 'the tree'}")
            same = False
            continue
        same = S.report(label, (ref / idx_a[label]).read_text(), (tree / idx_b[label]).read_text()) and same
    return same


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernels", nargs="?", default=DEFAULT)
    ap.add_argument("--cfg", default="{}", help="JSON: config entries to update before the routes are enumerated")
    ap.add_argument("--op", default="kda", choices=OPS)
    ap.add_argument("--against", metavar="REF", help="compare each route's SASS with the kernels at this git ref")
    ap.add_argument("--out", type=Path, default=None, help="where the SASS dumps go (default: a temp dir)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--_build", action="store_true", help=argparse.SUPPRESS)  # subprocess: build only
    args = ap.parse_args()
    if args._build:
        _build(args, args.out)
        return 0
    if not args.against:
        return _counts(args)
    out = args.out or Path(tempfile.gettempdir()) / f"{args.op}_sass"
    _build(args, out / "tree")
    import sass as S

    with tempfile.TemporaryDirectory() as tmp:
        S._export(args.against, Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}  # the exported package shadows the working tree's
        subprocess.run([sys.executable, "-P", __file__, args.kernels, "--_build", "--op", args.op, "--cfg", args.cfg,
                        "--jobs", str(args.jobs), "--out", str(out / "ref")], env=env, check=True)
    print(f"SASS of {args.against} vs the working tree ({args.op}, {out}):")
    return 0 if _compare(out / "ref", out / "tree") else 1


if __name__ == "__main__":
    sys.exit(main())
