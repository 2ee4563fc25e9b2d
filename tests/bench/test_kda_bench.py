"""bench/kda.py's own parts, on CPU: the FLOP count and the fla / ours ratio table it adds to its results file
(the dry run itself is tests/bench/test_harness.py's)."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402 - bench/ is on sys.path only from here
import plot  # noqa: E402


def _kda():
    spec = importlib.util.spec_from_file_location("mek_bench_kda", BENCH / "kda.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_flops_count_the_chunked_products():
    kda = _kda()
    p = kda.shapes(quick=True)["Kimi-Linear H32 16x2048"]
    chunk_heads = 16 * 2048 // 64 * 32
    c, k, v = 64, 128, 128
    # per chunk and head: w, u, the state recurrence, o (bf16); Aqk and L by 16-row sub-blocks (tf32)
    assert kda.products(p, "fwd") == (chunk_heads * (2 * c * c * k + 4 * c * c * v + 6 * c * k * v),
                                      chunk_heads * 4 * c * c * k)
    bf16, tf32 = kda.products(p, "bwd")
    assert bf16 == chunk_heads * (8 * c * c * v + 4 * c * c * k + 4 * c ** 3 + 12 * c * k * v)
    assert tf32 == chunk_heads * 3 * c * c * k  # 6 pairs of [16, 16] blocks, 2 matrices, 2 sides
    assert kda.flops(p, "fwd") == pytest.approx(189.0e9, rel=1e-3)  # 155 bf16 + 34 tf32 GFLOP
    assert kda.flops(p, "full") is None  # the harness adds fwd + bwd
    # a document's partial last chunk counts as a whole chunk; value heads, not key heads, multiply
    q = dict(p, lens=[65], H=1, HV=2)
    assert kda.products(q, "fwd")[1] == 2 * 2 * 4 * c * c * k


def test_every_model_in_every_layout():
    kda = _kda()
    full, quick = kda.shapes(quick=False), kda.shapes(quick=True)
    assert len(full) == 3 * len(kda.MODELS) and len(quick) == len(kda.MODELS)
    for p in full.values():
        assert sum(p["lens"]) == 32768
    gates = {(m["H"], m["gate"], m["trans"]) for m in kda.MODELS.values()}
    assert gates == {(32, "softplus", False), (12, "safe", True)}


def _row(shape, provider, mode, device, synced):
    return {"op": "kda", "shape": shape, "provider": provider, "mode": mode, "synced_ms": synced, "device_ms": device}


def test_ratio_table_is_written_into_the_results(tmp_path, capsys):
    kda = _kda()
    rows = [_row("s", "cake det", "fwd", 2.0, 2.2), _row("s", "fla 0.6.0", "fwd", 2.8, 3.3),
            _row("s", "cake det", "bwd", 4.0, 4.4), _row("s", "fla 0.6.0", "bwd", 4.4, 4.4),
            _row("only ours", "cake det", "fwd", 1.0, 1.0)]
    path = _common.write_results("kda", rows, {"format": _common.FORMAT, "timers": ["synced", "device"],
                                               "commit": "abc1234"}, out_dir=tmp_path)
    vs = kda.write_ratios(path)
    doc = json.loads(path.read_text())
    assert doc["vs_fla"] == vs and doc["rows"] == rows and doc["commit"] == "abc1234"
    by = {r["mode"]: r for r in vs}
    assert set(by) == {"fwd", "bwd"} and all(r["shape"] == "s" for r in vs)
    assert by["fwd"]["device fla/ours"] == pytest.approx(1.4) and by["fwd"]["synced fla/ours"] == pytest.approx(1.5)
    assert by["fwd"]["bar >= 1.3"] is True and by["bwd"]["bar >= 1.3"] is False  # the bar reads device time
    assert "fla 0.6.0 time / ours" in capsys.readouterr().out
    assert plot.markdown(path).count("\n| ") == 4  # header + (s, ours), (s, fla), (only ours, ours)


def test_no_ratio_table_without_fla(tmp_path):
    kda = _kda()
    path = _common.write_results("kda", [_row("s", "cake det", "fwd", 1.0, 1.0)],
                                 {"format": _common.FORMAT, "timers": ["synced", "device"]}, out_dir=tmp_path)
    before = path.read_text()
    assert kda.write_ratios(path) == [] and path.read_text() == before
