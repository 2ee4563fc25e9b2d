"""Checks that several op test files make the same way."""
import os
import subprocess
import sys

from tests._paths import ROOT


def assert_import_is_torch_free(module: str, call: str = "") -> None:
    """A fresh interpreter at the repository root imports `module` as `m` and runs `call` (e.g.
    "m.check_supported(16, 2)"): neither torch nor triton may end up imported."""
    code = (f"import sys; import {module} as m; {call}; "
            "assert 'torch' not in sys.modules and 'triton' not in sys.modules, sorted(sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=ROOT))
    assert out.returncode == 0, out.stderr[-2000:]


def assert_demo_passes(spec, device: str) -> list:
    """The op's demo (`spec.impl().demo`) on `device`: at least one row, every row ok. The rows are printed (the
    GPU logs keep them) and returned."""
    rows = spec.impl().demo(device)
    for r in rows:
        print(r)
    assert rows and all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    return rows


def record_cu_seqlens_checks(monkeypatch) -> list:
    """Spy on the shared host check `checks.check_cu_seqlens` (it still runs): the returned list gets one
    `(name, T, keywords)` per call."""
    from miles_ext_kernels.cake._runtime import checks

    seen = []
    real = checks.check_cu_seqlens

    def spy(name, cu, T, **kw):
        seen.append((name, T, kw))
        return real(name, cu, T, **kw)
    monkeypatch.setattr(checks, "check_cu_seqlens", spy)
    return seen
