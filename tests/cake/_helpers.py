"""Checks that several op test files make the same way."""
import os
import subprocess
import sys

import pytest

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


def assert_nonfinite_as_in_reference(run, reference, inp: dict, name: str, value: float, tokens) -> None:
    """For each token t of `tokens`: `inp` with input `name` set to `value` at [0, t, 0, ...] (batch 0, token t, the
    first entry of every further dim). `run(x)` and `reference(x)` give (o [B, T, HV, V], final state [N, HV, ...]);
    the reference is a per-token recurrence, so a token reaches only itself and what comes after it. Ours must be
    non-finite in exactly the (token, head) rows of o and the (sequence, head) states where the reference is, and
    every row and state that the reference leaves bit for bit as without the change must keep the bits of
    `run(inp)`."""
    import torch

    o0, ht0 = run(inp)
    ro0, rht0 = reference(inp)
    for t in tokens:
        x = dict(inp)
        x[name] = inp[name].clone()
        x[name][(0, t) + (0,) * (x[name].dim() - 2)] = value
        o, ht = run(x)
        ro, rht = reference(x)
        bad, ref_bad = ~torch.isfinite(o[0]).all(-1), ~torch.isfinite(ro[0]).all(-1).to(o.device)  # [T, HV]
        same = (ro[0] == ro0[0]).all(-1).to(o.device)  # rows the change does not reach
        assert (~same).any() and torch.equal(bad, ref_bad), (name, t, bad.nonzero().tolist()[:6])
        assert torch.equal(o[0][same], o0[0][same]), (name, t)
        flat, rflat = ht.flatten(2), rht.flatten(2)
        bad_s, ref_bad_s = ~torch.isfinite(flat).all(-1), ~torch.isfinite(rflat).all(-1).to(o.device)  # [N, HV]
        same_s = (rflat == rht0.flatten(2)).all(-1).to(o.device)
        assert torch.equal(bad_s, ref_bad_s) and torch.equal(flat[same_s], ht0.flatten(2)[same_s]), (name, t)


def assert_declared(op, name: str, selector: str, entry_points: tuple, prebuild_params: tuple) -> None:
    """What every op's declaration shares: registered under `name` (in `cake.OPS`), variants det and fast with det
    the default, built for sm_90a, selected by miles' `--<selector> cake`, with the given entry points and
    prebuild parameters."""
    from miles_ext_kernels import cake

    assert op.name == name and cake.op_spec(name) is op and op in cake.OPS
    assert op.variants == ("det", "fast") and op.default_variant == "det"
    assert op.selected_by == ((selector, "cake"),)
    assert op.entry_points == entry_points
    assert op.prebuild_params == prebuild_params and op.archs == ("sm_90a",)


def assert_raises_before_launch(call, operands: dict, change: dict, exc, word: str, positional: tuple) -> None:
    """`call` on `operands` with `change` applied raises `exc` matching `word`; the names in `positional` go by
    position (in that order), the rest by keyword. The caller has replaced the launchers by a failure."""
    kw = dict(operands)
    kw.update(change)
    args = [kw.pop(n) for n in positional]
    with pytest.raises(exc, match=word):
        call(*args, **kw)
