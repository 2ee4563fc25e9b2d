"""The hooks and every op declaration import neither torch nor triton (checked in a fresh interpreter)."""
import json
import os
import subprocess
import sys
import textwrap

from tests._paths import ROOT


def run(code: str) -> dict:
    env = dict(os.environ, PYTHONPATH=ROOT)
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_hooks_and_declarations_are_torch_free():
    got = run("""
        import argparse, importlib, json, sys
        import miles_ext_kernels as mek
        from miles_ext_kernels import cake
        for spec in cake.OPS:
            mod = importlib.import_module("miles_ext_kernels.cake." + spec.name)
            assert mod.OP is spec
        parser = argparse.ArgumentParser()
        mek.add_arguments(parser)
        args = parser.parse_args([])
        mek.validate_args(args)
        mek.configure(args)
        mek.configure()
        freed = mek.release()
        print(json.dumps({"heavy": sorted(m for m in ("torch", "triton") if m in sys.modules),
                          "ops": [s.name for s in cake.OPS], "freed": freed}))
    """)
    assert got["heavy"] == [], f"importing the hooks / declarations pulled in {got['heavy']}"
    assert got["freed"] == 0


def test_entry_points_resolve_lazily():
    got = run("""
        import json, sys
        from miles_ext_kernels import cake
        names = [e for s in cake.OPS for e in s.entry_points]
        fns = [getattr(cake, e) for e in names]
        print(json.dumps({"heavy": sorted(m for m in ("torch", "triton") if m in sys.modules), "n": len(fns),
                          "documented": all(bool(f.__doc__) for f in fns)}))
    """)
    assert got["heavy"] == [] and got["documented"]
