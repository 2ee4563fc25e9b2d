"""python -m miles_ext_kernels {doctor, prebuild, bench, demo} — see `--help` of each."""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _interpret_if_no_gpu() -> bool:
    """On a machine without a CUDA GPU, run kernels through Triton's interpreter (must precede kernel imports)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _table(rows: list[dict], cols: list[str]) -> str:
    cells = [[str(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) if cells else len(c) for i, c in enumerate(cols)]
    line = lambda xs: "  ".join(x.ljust(w) for x, w in zip(xs, widths))  # noqa: E731
    return "\n".join([line(cols), line(["-" * w for w in widths])] + [line(x) for x in cells])


def cmd_doctor(ns) -> int:
    interpret = _interpret_if_no_gpu()
    import torch

    import miles_ext_kernels as mek
    from miles_ext_kernels import cake
    from miles_ext_kernels.cake._runtime import config

    print(f"miles_ext_kernels {mek.__version__}  python {platform.python_version()}  torch {torch.__version__}")
    try:
        import triton

        from miles_ext_kernels.cake._runtime import build

        print(f"triton {triton.__version__}  cache dir {build._cache_dir()}")
    except ImportError as e:
        print(f"triton: not importable ({e})")
    arch = None
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            try:
                a = cake.device_arch(i)
            except NotImplementedError:
                a = "not served"
            arch = arch or a
            print(f"GPU {i}: {torch.cuda.get_device_name(i)}  capability {torch.cuda.get_device_capability(i)}  "
                  f"arch {a}")
    else:
        print("GPU: none visible" + ("; kernels run through Triton's interpreter (TRITON_INTERPRET=1)"
                                     if interpret else ""))
    variants = config.configured()
    rows = [{"op": s.name, "serves": ",".join(s.archs),
             "here": ("yes" if arch in s.archs else "no") if arch else ("interpreter" if interpret else "no"),
             "variants": "/".join(s.variants), "runs now": variants[s.name],
             "selected by": " | ".join(f"--{d.replace('_', '-')} {v}" for d, v in s.selected_by)}
            for s in cake.OPS]
    print(_table(rows, ["op", "serves", "here", "variants", "runs now", "selected by"]) if rows else "no ops")
    print(f"workspace pool bound: {config.pool_bytes()} bytes; deterministic mode: {config.deterministic_mode()}")
    return 0


def _ops_epilog(what: str) -> str:
    """The ops (from their torch-free declarations) and, for prebuild, the --param each needs; for bench, the
    script each runs."""
    from miles_ext_kernels import cake

    lines = []
    width = max((len(s.name) for s in cake.OPS), default=0)
    for s in cake.OPS:
        if what == "prebuild":
            params = " ".join(f"--param {p}=VALUE" for p in s.prebuild_params) or "(no --param)"
            lines.append(f"  {s.name:<{width}}  {params}")
        else:
            lines.append(f"  {s.name:<{width}}  bench/{s.bench or s.name}.py")
    head = "ops and the --param each needs:" if what == "prebuild" else "ops and the script each runs:"
    tail = ("\nexample: python -m miles_ext_kernels prebuild rmsnorm --param hidden_size=2048"
            if what == "prebuild" else
            f"\na script name works too: {', '.join(_bench_targets()[len(cake.OPS):]) or '-'}")
    return "\n".join([head, *lines]) + "\n" + tail


def _bench_targets() -> list[str]:
    """What `bench` takes: every op name, then each benchmark script stem that is no op's name (e.g. norms)."""
    from miles_ext_kernels import cake

    names = [s.name for s in cake.OPS]
    return names + sorted({s.bench or s.name for s in cake.OPS} - set(names))


def _unknown(what: str, given, known) -> str:
    kind = "op or benchmark script" if what == "bench" else "op"
    return f"{what}: unknown {kind} {given!r}; choose from: {', '.join(known)}"


def _param(text: str):
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--param takes key=value, got {text!r}")
    k, v = text.split("=", 1)
    for conv in (int, float):
        try:
            return k, conv(v)
        except ValueError:
            pass
    return k, v


def cmd_prebuild(ns) -> int:
    from miles_ext_kernels import cake

    names = [s.name for s in cake.OPS]
    if ns.op not in names:
        print(_unknown("prebuild", ns.op, names), file=sys.stderr)
        return 2

    device = int(ns.device) if ns.device is not None and ns.device.isdigit() else ns.device  # "0" -> cuda:0
    try:
        res = cake.prebuild(ns.op, device=device, max_workers=ns.max_workers, **dict(ns.param or []))
    except (KeyError, TypeError, ValueError, RuntimeError, NotImplementedError) as e:
        print(f"prebuild {ns.op}: {e}", file=sys.stderr)
        return 2
    print(res)
    for label in res.routes:
        print(f"  {label}")
    return 0


def cmd_bench(ns, extra) -> int:
    from miles_ext_kernels import cake

    targets = _bench_targets()
    if ns.op not in targets:
        print(_unknown("bench", ns.op, targets), file=sys.stderr)
        return 2
    spec = next((s for s in cake.OPS if s.name == ns.op), None)
    script = REPO / "bench" / f"{(spec.bench or spec.name) if spec else ns.op}.py"
    if not script.exists():
        print(f"no benchmark for {ns.op}: {script} does not exist", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print(f"bench {ns.op}: the benchmarks time kernels on a CUDA GPU and none is visible here", file=sys.stderr)
        return 2
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.call([sys.executable, str(script), *extra], env=env, cwd=str(REPO))


def cmd_demo(ns) -> int:
    from miles_ext_kernels import cake

    names = [s.name for s in cake.OPS]
    unknown = [o for o in ns.op if o not in names]
    if unknown:  # an unknown op must not pass as "nothing failed"
        print(f"demo: unknown op(s) {', '.join(repr(o) for o in unknown)}; choose from: {', '.join(names)}",
              file=sys.stderr)
        return 2
    interpret = _interpret_if_no_gpu()

    device = "cpu" if interpret else "cuda"
    print(f"demo on {device}" + (" (Triton interpreter, tiny sizes)" if interpret else " (real sizes)"))
    rows, failed = [], False
    for spec in cake.OPS:
        if ns.op and spec.name not in ns.op:
            continue
        try:
            got = spec.impl().demo(device)
        except Exception as e:  # one op failing must not hide the others
            got = [{"op": spec.name, "case": "-", "tensor": "-", "err": f"{type(e).__name__}: {e}"[:80],
                    "budget": "", "ok": False}]
        for r in got:
            r = dict(r)
            if isinstance(r.get("err"), float):
                r["err"] = f"{r['err']:.2e}"
            if isinstance(r.get("budget"), float):
                r["budget"] = f"{r['budget']:.2e}"
            failed |= not r.get("ok", False)
            r["ok"] = "ok" if r.get("ok") else "FAIL"
            rows.append(r)
    print(_table(rows, ["op", "case", "tensor", "err", "budget", "ok"]) if rows else "no ops registered")
    return 1 if failed else 0


def _ops():
    from miles_ext_kernels import cake

    return cake.OPS


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m miles_ext_kernels",
                                     description="miles_ext_kernels: Triton training kernels for miles on Hopper")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("doctor", help="versions, GPU and arch, which ops serve it, cache dir, configured variants")
    raw = argparse.RawDescriptionHelpFormatter
    p = sub.add_parser("prebuild", help="compile every kernel route of an op for this GPU (fills the Triton cache)",
                       epilog=_ops_epilog("prebuild"), formatter_class=raw)
    p.add_argument("op", help="op name (listed below)")
    p.add_argument("--param", action="append", type=_param, metavar="KEY=VALUE",
                   help="model parameter the op's prebuild needs (repeatable), e.g. --param hidden_size=2048")
    p.add_argument("--device", default=None, help="CUDA device, e.g. 0 or cuda:1 (default: the current one)")
    p.add_argument("--max-workers", type=int, default=None, help="parallel compile threads")
    p = sub.add_parser("bench", help="run an op's benchmark script bench/<script>.py (extra arguments are passed on)",
                       epilog=_ops_epilog("bench"), formatter_class=raw)
    p.add_argument("op", help="op name or benchmark script name (listed below)")
    p = sub.add_parser("demo", help="run each op against its reference and print a table (CPU: interpreter, tiny)",
                       epilog="ops: " + ", ".join(s.name for s in _ops()) + "\nexit status: 0 = every row passed, "
                       "1 = a row failed, 2 = an unknown op", formatter_class=raw)
    p.add_argument("op", nargs="*", help="only these ops (default: all)")
    ns, extra = parser.parse_known_args(argv)
    if ns.cmd == "bench":
        return cmd_bench(ns, extra)
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    return {"doctor": cmd_doctor, "prebuild": cmd_prebuild, "demo": cmd_demo}[ns.cmd](ns)


if __name__ == "__main__":
    sys.exit(main())
