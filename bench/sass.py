"""SASS of the gqa Gluon kernels for sm_90a, compiled offline (no GPU): registers, spills, shared memory, and a diff.

    python bench/sass.py [--out DIR]              # the working tree's kernels: counts table, DIR/<route>.sass
    python bench/sass.py --against REF [--out DIR]  # also the kernels at git REF, compared instruction by instruction

Run it with the interpreter of a triton 3.6 install (the GPU machine's version; torch may be a CPU build), e.g.
`/tmp/t36/bin/python bench/sass.py --against main`. Each route of `ops.routes()` whose kernel is a Gluon one
(`fwd_kernel`, `dq_kernel`, `dkdv_kernel` at `CONFIGS["sm_90a"]`) is specialized as a launch would specialize it
(the kernel's own binder on the route's arguments: meta-tensor TMA descriptors, dtypes standing in for tensors),
compiled with `triton.compile` for `GPUTarget("cuda", 90, 32)`, and disassembled with the wheel's `cuobjdump`.
Registers, spill bytes and ptxas warnings (C7515: serialized wgmma) come from re-running the wheel's ptxas with `-v`
on the kernel's PTX, with the flags triton passes. `--against` exports `miles_ext_kernels` at REF (git archive) and
compiles it in a subprocess; two kernels are "identical" when their SASS is the same instruction for instruction
once addresses and branch targets are masked ("bit-identical": the raw dumps, encodings included, are equal).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tool(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return str(path) if path.exists() else name


def _compile(route, target):
    """`route.warmup()` without a driver: the kernel's binder, `_pack_args` and `triton.compile` for `target`."""
    import triton
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import MockTensor, create_function_from_signature

    kernel = route.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(route.constexprs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    if isinstance(route.args, dict):  # routes recorded from keyword launches (`_runtime.launch`)
        kwargs.update({k: MockTensor.wrap_dtype(v) for k, v in route.args.items()})
        bound_args, specialization, options = binder(**kwargs)
    else:
        bound_args, specialization, options = binder(*map(MockTensor.wrap_dtype, route.args), **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    src = (GluonASTSource if kernel.is_gluon() else ASTSource)(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=target, options=options.__dict__)


def _ptxas_report(ptx: str) -> dict:
    """Registers, spill stores / loads (bytes) and warnings of ptxas -v on `ptx` (the flags of triton's make_cubin)."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        res = subprocess.run([_tool("ptxas"), "-lineinfo", "-v", "--gpu-name=sm_90a", str(src), "-o",
                              str(Path(tmp) / "k.o")], capture_output=True, text=True, check=True)
    log = res.stdout + res.stderr
    regs = re.findall(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return {"registers": int(regs[-1]) if regs else None,
            "stack": int(stack.group(1)) if stack else None,
            "spill_stores": int(spill.group(1)) if spill else None,
            "spill_loads": int(spill.group(2)) if spill else None,
            # C7515 (serialized wgmma) comes as an "info" line from the wheel's ptxas
            "warnings": [ln.strip() for ln in log.splitlines() if "warning" in ln or "C7515" in ln]}


def _sass(cubin: bytes) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        return subprocess.run([_tool("cuobjdump"), "-sass", str(path)], capture_output=True, text=True,
                              check=True).stdout


def instructions(sass: str) -> list[str]:
    """The instructions of a cuobjdump -sass dump, addresses and encodings dropped, branch targets masked."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            out.append(re.sub(r"\b0x[0-9a-f]+\b", lambda h: "ADDR" if _is_target(m.group(1)) else h.group(0),
                              m.group(1)))
    return out


def _is_target(ins: str) -> bool:  # instructions whose immediate is a code address
    return bool(re.match(r"(@!?U?P\w+\s+)?(BRA|BSSY|CALL|JMP|BRX|RET|BREAK)\b", ins))


def build(out: Path) -> list[dict]:
    """Compile the Gluon routes of the importable `miles_ext_kernels`, write <kernel>.sass into `out`, return rows."""
    from triton.backends.compiler import GPUTarget

    from miles_ext_kernels.cake._impl.gqa import ops
    from miles_ext_kernels.cake._runtime import build as B

    # routes() asks the current GPU's arch; there is none here
    B.device_arch = ops.device_arch = lambda device=None: "sm_90a"
    target = GPUTarget("cuda", 90, 32)
    rows = []
    out.mkdir(parents=True, exist_ok=True)
    seen = set()
    for route in ops.routes():
        name = route.kernel.fn.__name__
        args = route.args if isinstance(route.args, dict) else {}
        if name in ("fwd_kernel", "dq_kernel") and args.get("BM", 128) != 128:
            name += f"_bm{args['BM']}"  # the short-document routes' tiles at 64 rows
        if not getattr(route.kernel, "is_gluon", lambda: False)() or name in seen:
            continue  # one route per Gluon kernel and tile (their boundaries are always the int32 clamped copies)
        seen.add(name)
        ck = _compile(route, target)
        sass = _sass(ck.asm["cubin"])
        (out / f"{name}.sass").write_text(sass)
        ins = instructions(sass)
        row = {"route": name, "kernel": route.kernel.fn.__name__, "shared": ck.metadata.shared,
               **_ptxas_report(ck.asm["ptx"]), "instructions": len(ins),
               "HGMMA": sum(i.split()[0].startswith("HGMMA") or " HGMMA" in i for i in ins),
               "DEPBAR": sum("WARPGROUP.DEPBAR" in i for i in ins),
               "LDL/STL": sum(bool(re.search(r"\b(LDL|STL)\b", i)) for i in ins)}
        rows.append(row)
    (out / "counts.json").write_text(json.dumps(rows, indent=1))
    return rows


def _export(ref: str, dst: Path) -> None:
    tar = dst / "src.tar"
    subprocess.run(["git", "archive", "-o", str(tar), ref, "miles_ext_kernels"], cwd=ROOT, check=True)
    with tarfile.open(tar) as tf:
        tf.extractall(dst)


def _table(rows: list[dict], title: str) -> None:
    print(title)
    print(f"  {'route':16s} {'regs':>4s} {'stack':>5s} {'spill st/ld':>11s} {'shared':>7s} {'instr':>6s} "
          f"{'HGMMA':>5s} {'DEPBAR':>6s} {'LDL/STL':>7s}  warnings")
    for r in rows:
        print(f"  {r['route']:16s} {r['registers']:>4} {r['stack']:>5} {r['spill_stores']:>5}/{r['spill_loads']:<5} "
              f"{r['shared']:>7} {r['instructions']:>6} {r['HGMMA']:>5} {r['DEPBAR']:>6} {r['LDL/STL']:>7}  "
              f"{'; '.join(r['warnings']) or '-'}")


def compare(dir_a: Path, dir_b: Path) -> bool:
    """Print, per route, whether the SASS of `dir_b` is identical to `dir_a`'s; True when all are."""
    same = True
    for label in ("fwd_kernel", "dq_kernel", "dkdv_kernel"):  # the Gluon kernels, one route each
        a, b = (d / f"{label}.sass" for d in (dir_a, dir_b))
        if not (a.exists() and b.exists()):
            print(f"  {label}: missing in {'a' if not a.exists() else 'b'}")
            same = False
            continue
        same = report(label, a.read_text(), b.read_text()) and same
    return same


def report(label: str, sass_a: str, sass_b: str) -> bool:
    """Print whether the dump `sass_b` is identical to `sass_a` (`instructions`), else where they differ first."""
    ia, ib = instructions(sass_a), instructions(sass_b)
    if ia == ib:
        print(f"  {label}: identical, {len(ia)} instructions{' (bit-identical)' if sass_a == sass_b else ''}")
        return True
    diff = [k for k in range(max(len(ia), len(ib))) if k >= min(len(ia), len(ib)) or ia[k] != ib[k]]
    print(f"  {label}: DIFFERENT, {len(ia)} vs {len(ib)} instructions, {len(diff)} positions differ; first:")
    for k in diff[:5]:
        print(f"    {k:6d}: {ia[k] if k < len(ia) else '-'}  |  {ib[k] if k < len(ib) else '-'}")
    return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "gqa_sass")
    p.add_argument("--against", metavar="REF", help="also compile the kernels at this git ref and compare")
    p.add_argument("--_build", action="store_true", help=argparse.SUPPRESS)  # subprocess: build only, no table
    args = p.parse_args()
    if args._build:
        build(args.out)
        return 0
    sys.path.insert(0, str(ROOT))
    rows = build(args.out / "tree")
    _table(rows, f"working tree -> {args.out / 'tree'}")
    if not args.against:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        _export(args.against, Path(tmp))
        env = {**os.environ, "PYTHONPATH": tmp}  # the exported package shadows the working tree's
        subprocess.run([sys.executable, "-P", __file__, "--_build", "--out", str(args.out / "ref")], env=env,
                       check=True)
    _table(json.loads((args.out / "ref" / "counts.json").read_text()), f"{args.against} -> {args.out / 'ref'}")
    print(f"SASS of {args.against} vs the working tree:")
    return 0 if compare(args.out / "ref", args.out / "tree") else 1


if __name__ == "__main__":
    sys.exit(main())
