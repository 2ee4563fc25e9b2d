"""The benchmark harness (bench/_common.py) and the results reader (bench/plot.py), on CPU.

- Every `bench/<op>.py` declaration runs as a dry run (tiny shapes, one call per mode) through Triton's
  interpreter: it builds, runs the providers that exist on CPU, and writes rows that plot.py reads.
- A synthetic declaration (torch only) checks the harness itself: modes, timers, skips, failures, det bits,
  accuracy against a provider, the JSON layout.
- plot.py reads both layouts: the harness's and the one written before it (the committed results files).
"""
from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402 - bench/ is on sys.path only from here
import plot  # noqa: E402
from _common import Autograd, Bench, Calls, Provider, Skip  # noqa: E402

SCALAR = (str, int, float, bool, type(None))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"mek_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there (bench/step.py declares some)
    spec.loader.exec_module(mod)
    return mod


def _check_doc(doc):
    """The layout every results file of the harness has."""
    assert doc["format"] == _common.FORMAT and doc["complete"] is True
    assert doc["rows"], "no rows"
    for key in ("date", "torch", "timers", "timer_note", "accuracy", "skipped", "failures"):
        assert key in doc, key
    for row in doc["rows"]:
        assert all(isinstance(v, SCALAR) for v in row.values()), row  # flat
        assert row["mode"] in _common.MODES
        assert {"op", "shape", "provider"} <= set(row)
        for t in doc["timers"]:
            assert row[f"{t}_ms"] > 0 and math.isfinite(row[f"{t}_ms"]), row
            for m in ("tflops", "tbps"):
                if any(k.endswith(m) for k in row):
                    assert row[f"{t}_{m}"] > 0, row
    for row in doc["accuracy"]:
        errs = [v for k, v in row.items() if k.startswith("err_")]
        assert errs and all(isinstance(v, float) and math.isfinite(v) for v in errs), row


def _check_plot_reads(path, tmp_path):
    md = plot.markdown(path)
    doc = json.loads(path.read_text())
    rows = plot.rows_of(doc)
    assert md.count("\n| ") == len({(r["shape"], r["provider"]) for r in rows}) + 1  # header + one per pair
    if importlib.util.find_spec("matplotlib") is not None:
        assert plot.plot(path, tmp_path).stat().st_size > 0


# What each declaration runs on CPU: every op's providers that need no GPU (ours and the PyTorch peers).
ON_CPU = {
    "gqa": {"gqa": {"cake det", "cake fast"}},
    "gdn": {"gdn": {"cake det", "cake det, recompute-state"}},
    "kda": {"kda": {"cake det"}},
    "cp": {"cp": {"plain (one call)"} | {f"{kind} W={w} {layout}" for kind in ("cp", "per-rank")
                                        for layout, w in (("contiguous", 2), ("contiguous", 4), ("contiguous", 8),
                                                          ("zigzag", 4))}
                                       | {f"cp W=4 zigzag E={e}" for e in (1, 3, 4)}},
    "conv1d": {"conv1d": {"cake det", "cake fast", "torch F.conv1d/doc"}},
    "norms": {"rmsnorm": {"cake det", "cake fast", "eager"}, "gated_rmsnorm": {"cake det", "cake fast", "eager"}},
}


def test_every_benchmark_is_dry_run_here():
    # tools, and the HF model step (its own script, not a declaration: it times whole models)
    # host.py re-times the declarations below on tiny shapes (its own test: test_host_declares_every_op_tiny)
    # step.py times a layer stack per stack and run, not a declaration (its own test: test_step_dry_run)
    # host_profile.py profiles host.py's declarations (its own test: test_host_profile_without_launches)
    # kda_profile.py / cp_profile.py: per-kernel GPU profiles of bench/kda.py's and bench/cp.py's calls (GPU only)
    # gqa_tiles.py: gqa's tile candidates against FA2 through the launchers (a GPU tuning script)
    # cfg_sweep.py: config variants of gdn / kda in one process (a GPU tuning script)
    files = {p.stem for p in BENCH.glob("*.py")} - {"_common", "plot", "ab", "sass", "model", "kda_sass", "kda_profile",
                                                    "cp_profile", "host", "host_profile", "cp_nccl", "step",
                                                    "gqa_tiles", "cfg_sweep"}
    assert files == set(ON_CPU), "a bench/<op>.py is missing from ON_CPU (or ON_CPU names a file that is gone)"


@pytest.mark.interpreter
@pytest.mark.parametrize("name", sorted(ON_CPU))
def test_declaration_dry_run(name, tmp_path):
    mod = _load(name)
    assert mod.main(["--dry-run", "--out", str(tmp_path)]) == 0
    path = tmp_path / f"{name}.json"
    doc = json.loads(path.read_text())
    _check_doc(doc)
    assert doc["dry_run"] is True and not doc["failures"]
    for op, providers in ON_CPU[name].items():
        rows = [r for r in doc["rows"] if r["op"] == op]
        assert {r["provider"] for r in rows} == providers
        modes = {r["mode"] for r in rows}
        assert modes and {(r["provider"], r["mode"]) for r in rows} == {(p, m) for p in providers for m in modes}
        assert all(r["bits_repeat"] for r in rows if r["provider"] == "cake det")
    skipped = {s["provider"] for s in doc["skipped"]}
    assert skipped.isdisjoint(set().union(*ON_CPU[name].values()))
    if name == "cp":  # the transitions a rank keeps for its backward: at most two K x K per document at zigzag W = 4
        saved = {(r["shape"], r["provider"]): r["saved_m_bytes"] for r in doc["overhead"]}
        assert saved[("gdn 2 docs", "cp W=4 zigzag")] == 4 * 2 * 16 * 16 * 4  # 2 docs, HV 2, K 16, fp32
    if name in ("conv1d", "norms"):  # an FP64 reference that runs on CPU
        ours = [r for r in doc["accuracy"] if r["provider"].startswith("cake")]
        assert ours and all(v < 2e-2 for r in ours for k, v in r.items() if k.startswith("err_"))
    _check_plot_reads(path, tmp_path)


@pytest.mark.interpreter
def test_host_profile_without_launches(capsys):
    """bench/host_profile.py --no-launch on CPU: two ops' Python path timed and profiled, every launch dropped (and
    `launch` back to launching afterwards)."""
    from miles_ext_kernels.cake._runtime import launch

    mod = _load("host_profile")
    assert mod.main(["--no-launch", "--ops", "rmsnorm,gdn", "--calls", "2", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "== rmsnorm / " in out and "== gdn / " in out and out.count("-- by cumtime (our functions)") == 2
    assert "-- launches per fwd + bwd call: 2 " in out  # rmsnorm: its forward and its backward kernel
    assert launch._collecting.routes is None


@pytest.mark.interpreter
def test_step_dry_run(tmp_path):
    """bench/step.py on CPU: ours runs eagerly (det bits repeat), graph and peers are skipped, the file is in the
    harness's layout and plot.py reads it."""
    mod = _load("step")
    assert mod.main(["--dry-run", "--out", str(tmp_path)]) == 0
    path = tmp_path / "step.json"
    doc = json.loads(path.read_text())
    _check_doc(doc)
    assert doc["dry_run"] is True and not doc["failures"] and doc["config"]["tokens"] == sum(doc["config"]["docs"])
    assert [(r["stack"], r["run"], r["mode"]) for r in doc["rows"]] == [("cake det", "eager", "full")]
    assert all(r["bits_repeat"] is True and r["tokens_per_s"] > 0 for r in doc["rows"])
    skipped = {(s["provider"], s["run"]): s["reason"] for s in doc["skipped"]}
    assert "CUDA" in skipped[("cake det", "graph")] and "CUDA" in skipped[(mod.PEERS, "*")]
    _check_plot_reads(path, tmp_path)


@pytest.mark.interpreter
@pytest.mark.parametrize("docs", ["regular", "irregular"])
def test_step_sdpa_peer_matches_ours(docs):
    """The peers' SDPA attention (dense for equal documents, each document padded otherwise) in our stack gives our
    step's output and gradients: its layouts and its padding are right (fla and Liger need a GPU). The peer's
    attention runs on fp32 copies here: torch's bf16 CPU attention differs with the CPU (on an AMD EPYC without
    AVX-512 it put the gradients 3.5-4.5 % from ours, against 2-3 % in fp32). Measured in fp32: out <= 0.9 %, the
    gradients <= 3.4 %; one row per document taken from its neighbour (a layout slip) gives out 7-9 % and some
    gradient 18-75 %."""
    mod = _load("step")
    dims, device = mod.DRY, "cpu"
    lens = mod.DRY_LENS[docs]
    d = mod.Docs.make(lens, device)
    w = mod.make_weights(dims, device)
    x, dy = mod.make_inputs(dims, sum(lens), device)
    ours = mod.ours_ops(dims, device)
    attention = mod.sdpa_attention(dims)

    def attention32(q, k, v, docs):
        return attention(q.float(), k.float(), v.float(), docs).to(q.dtype)

    sdpa = mod.Ops("sdpa", ours.norm, attention32, ours.conv, ours.gdn, ours.gated_norm)
    want = mod.make_step(ours, w, x, dy, d, dims)()
    got = mod.make_step(sdpa, w, x, dy, d, dims)()
    for name, a, b in zip(mod.result_names(w), got, want, strict=True):
        assert _common.rel_rms(a, b) < (2e-2 if name == "out" else 5e-2), name


# ---------------------------------------------------------------------------------------------------- synthetic
def _inputs(p, device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(p["n"], 3, generator=g, dtype=torch.float64)
    w = torch.randn(3, generator=g, dtype=torch.float64)
    return {"x": x, "w": w, "dy": torch.ones(p["n"], 3, dtype=torch.float64)}


def _autograd(x, p):
    return Autograd(lambda a, b: a * b, (x["x"], x["w"]), wrt=(0, 1), grad_outputs=x["dy"])


def _calls(x, p):
    a, b, dy = x["x"], x["w"], x["dy"]

    def result():
        return a * b, dy * b, (dy * a).sum(0)
    return Calls(fwd=lambda: a * b, bwd=lambda: (dy * b, (dy * a).sum(0)), result=result)


def _picky(x, p):
    if p["n"] > 2:
        raise Skip("only tiny ones")
    return _autograd(x, p)


def _broken(x, p):
    raise RuntimeError("boom")


def _bench(*extra):
    return Bench(
        name="toy", shapes={}, dry_shapes={"n2": {"n": 2}, "n5": {"n": 5}}, inputs=_inputs,
        providers=[Provider("autograd", _autograd, det=True, ours=True), Provider("calls", _calls),
                   Provider("absent", _autograd, requires=("no_such_module_for_the_harness_test",)),
                   Provider("gpu only", _autograd, on_cpu=False), Provider("picky", _picky),
                   Provider("n5 only", _autograd, when=lambda label, p: p["n"] == 5), *extra],
        modes=("fwd", "bwd", "full"), io_bytes=lambda p, mode: {"fwd": 8.0, "bwd": 16.0}.get(mode),
        timers=("synced", "device", "queued"), reference="autograd", result_names=("y", "dx", "dw"),
        dry_accuracy={"n5": {"n": 5}})


def test_harness_rows_skips_accuracy(tmp_path):
    rc = _common.run(_bench(), ["--dry-run", "--device", "cpu", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "toy.json").read_text())
    _check_doc(doc)
    got = {(r["shape"], r["provider"], r["mode"]) for r in doc["rows"]}
    want = {(s, p, m) for s in ("n2", "n5") for p in ("autograd", "calls") for m in ("fwd", "bwd", "full")}
    want |= {("n2", "picky", m) for m in ("fwd", "bwd", "full")}
    want |= {("n5", "n5 only", m) for m in ("fwd", "bwd", "full")}
    assert got == want
    full = next(r for r in doc["rows"] if r["provider"] == "calls" and r["mode"] == "full")
    assert full["synced_tbps"] == pytest.approx(24.0 / full["synced_ms"] / 1e9)  # full = fwd + bwd bytes
    assert all(r["bits_repeat"] is True for r in doc["rows"] if r["provider"] == "autograd")
    assert not any("bits_repeat" in r for r in doc["rows"] if r["provider"] != "autograd")
    reasons = {(s["shape"], s["provider"]): s["reason"] for s in doc["skipped"]}
    assert "does not import" in reasons[("*", "absent")] and "CUDA" in reasons[("*", "gpu only")]
    assert reasons[("n5", "picky")] == "only tiny ones"
    acc = {r["provider"]: r for r in doc["accuracy"]}
    assert set(acc) == {"calls", "n5 only"}  # picky skips n5; the reference is not compared with itself
    assert all(acc["calls"][f"err_{n}"] == 0.0 for n in ("y", "dx", "dw"))


def test_harness_failures_and_filters(tmp_path):
    bench = _bench(Provider("broken peer", _broken), Provider("broken ours", _broken, ours=True))
    rc = _common.run(bench, ["--dry-run", "--device", "cpu", "--out", str(tmp_path), "--modes", "bwd",
                             "--only", "n2", "--skip", "calls", "--name", "toy2"])
    assert rc == 1  # one of ours failed
    doc = json.loads((tmp_path / "toy2.json").read_text())
    assert {(r["shape"], r["mode"]) for r in doc["rows"]} == {("n2", "bwd")}
    assert "calls" not in {r["provider"] for r in doc["rows"]}
    assert {(f["provider"], f["ours"]) for f in doc["failures"]} == {("broken peer", False), ("broken ours", True)}
    assert not doc["accuracy"]  # --only n2 leaves the accuracy shape n5 out


def test_timing_needs_a_gpu_without_dry_run(tmp_path):
    with pytest.raises(SystemExit):
        _common.run(_bench(), ["--device", "cpu", "--out", str(tmp_path)])


# ---------------------------------------------------------------------------------------------------- plot.py
LEGACY = {  # one row of each benchmark's layout before the harness
    "gqa": {"shape": "s", "impl": "cake det", "fwd_ms": 1.0, "bwd_ms": 4.0, "fwd_tflops": 500.0, "bwd_tflops": 340.0,
            "fwd_ms_device": 0.9, "fwd_tflops_device": 590.0, "bwd_ms_device": 3.6, "bwd_tflops_device": 383.0},
    "conv1d": {"shape": "s", "impl": "cake det", "fwd_ms": 0.42, "bwd_ms": 0.77, "fwd_tbps": 3.8, "bwd_tbps": 3.2,
               "fwd_ms_synced": 0.59, "bwd_ms_synced": 1.04, "fwd_tbps_synced": 2.7, "bwd_tbps_synced": 2.3},
    "norms": {"op": "rmsnorm", "shape": "s", "impl": "cake det", "fwd_ms": 0.068, "bwd_ms": 0.116,
              "fwd_tbps": 3.9, "bwd_tbps": 3.5, "fwd_ms_queued": 0.07, "bwd_ms_queued": 0.2, "fwd_ms_synced": 0.12,
              "bwd_ms_synced": 0.26},
    "gdn": {"shape": "s", "impl": "cake det", "fwd_ms": 2.2, "bwd_ms": 4.8, "fwdbwd_ms": 6.7, "fwdbwd_device_ms": 6.5,
            "fwd_tflops": 85.0, "bwd_tflops": 97.0, "bits_repeat": True},
}


def test_plot_reads_the_layout_before_the_harness():
    rows = {n: {r["mode"]: r for r in plot.rows_of({"bench": n, "rows": [row]})} for n, row in LEGACY.items()}
    assert rows["gqa"]["bwd"]["synced_ms"] == 4.0 and rows["gqa"]["bwd"]["device_tflops"] == 383.0
    assert rows["conv1d"]["fwd"]["queued_ms"] == 0.42 and rows["conv1d"]["fwd"]["synced_tbps"] == 2.7
    assert rows["norms"]["bwd"]["device_ms"] == 0.116 and rows["norms"]["bwd"]["queued_ms"] == 0.2
    assert rows["norms"]["bwd"]["synced_ms"] == 0.26
    assert rows["gdn"]["full"] == {"op": "gdn", "shape": "s", "provider": "cake det", "mode": "full",
                                   "synced_ms": 6.7, "device_ms": 6.5, "bits_repeat": True}
    assert rows["gdn"]["fwd"]["bits_repeat"] is True


@pytest.mark.parametrize("path", sorted(p.name for p in (BENCH / "results").glob("*.json") if "_" not in p.stem))
def test_plot_reads_the_committed_results(path, tmp_path):
    _check_plot_reads(BENCH / "results" / path, tmp_path)


def test_host_declares_every_op_tiny():
    """bench/host.py: every op's own declaration (same providers) on its one tiny shape, host + device timers; the
    bars are read from our rows only."""
    mod = _load("host")
    benches = mod.declare()
    assert [b.name for b in benches] == list(mod.TINY)
    for b in benches:
        assert list(b.shapes) == [mod.TINY[b.name][0]] and b.timers == ("host", "device") and b.modes == ("fwd", "full")
        assert any(p.ours for p in b.providers) and len(b.providers) >= 2  # ours and at least one peer
    rows = [{"op": "gqa", "provider": "cake det", "mode": "fwd", "host_ms": 0.041},
            {"op": "gqa", "provider": "FA2 varlen", "mode": "fwd", "host_ms": 0.01},
            {"op": "rmsnorm", "provider": "cake det", "mode": "full", "host_ms": 0.05},
            {"op": "kda", "provider": "cake det", "mode": "fwd", "host_ms": 0.2}]
    got = mod.bars(rows)
    assert [(b["op"], b["mode"], b["bar_us"], b["met"]) for b in got] == [("gqa", "fwd", 40, False),
                                                                          ("rmsnorm", "full", 60, True)]


def test_host_timer_is_wall_clock_per_call(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    ms = _common.host_ms(lambda: calls.append(1), warmup=3, rep=7)
    assert len(calls) == 10 and 0 <= ms < 1.0 and "host" in _common.TIMERS and "host" in _common.TIMER_DOC


@pytest.mark.interpreter
def test_cp_nccl_dry_run_two_gloo_ranks(tmp_path):
    """bench/cp_nccl.py's rank processes over gloo (its --dry-run): every plan of both ops timed on both ranks, the
    ratio table and the comm bytes written."""
    mod = _load("cp_nccl")
    assert mod.main(["--dry-run", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "cp_nccl.json").read_text())
    assert doc["dry_run"] is True and doc["world"] == 2 and doc["backend"] == "gloo"
    assert {(r["shape"], r["plan"]) for r in doc["ratios"]} == {(s, f"W=2 {lay}") for s in ("gdn 2 docs", "kda 2 docs")
                                                                for lay in ("contiguous", "zigzag")}
    assert all(len(r["rank_ms"]) == 2 and r["fwd_bytes"] > 0 for r in doc["rows"])
