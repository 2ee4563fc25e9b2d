"""Draw the README plots from bench/results/*.json: one PNG per benchmark in bench/plots/.

A results file (bench/_common.py, "format": 2) has one row per (op, shape, provider, mode) with `<timer>_ms` and
`<timer>_tflops` or `<timer>_tbps` for each timer it ran (device, synced, queued); files written before the
harness (one row per shape and impl, `fwd_ms`, `bwd_ms`, suffixes `_device` / `_queued` / `_synced`) are read
through `rows_of`, which maps them onto that layout. Per mode the plot shows one bar per provider and shape, in
the first timer of device, queued, synced that the mode has.
Usage: python bench/plot.py [--readme] [--plots DIR] [results.json ...]
  default: the latest file of each benchmark (bench/results/<name>.json; files with "_" in the stem, such as
  gqa_tune.json, are not benchmark tables and are skipped). --readme also rewrites README.md's results section
  (tables + plots) from those files.
"""
import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("fwd", "bwd", "full")
PRIMARY = ("host", "device", "queued", "synced")  # the timer a mode is plotted in: the first it has
TITLES = {"fwd": "forward", "bwd": "backward", "full": "forward + backward"}


def _legacy_rows(doc: dict) -> list[dict]:
    """Rows of a file written before the harness, in the harness's layout. Its unsuffixed `fwd_ms` / `bwd_ms`
    were in one timer per benchmark: device where `_queued` and `_synced` columns exist too (norms), queued where
    only `_synced` does (conv1d), synced otherwise (gqa, gdn). gdn's `fwdbwd_ms` (synced) and `fwdbwd_device_ms`
    are its full mode."""
    old = doc["rows"]
    keys = {k for r in old for k in r}
    queued, synced = (any(k.endswith(sfx) for k in keys) for sfx in ("_queued", "_synced"))
    base = "device" if queued and synced else "queued" if synced else "synced"
    suffixes = {"": base, "_device": "device", "_queued": "queued", "_synced": "synced"}
    rows = []
    for r in old:
        for mode in ("fwd", "bwd"):
            row = {"op": doc.get("bench"), "shape": r["shape"], "provider": r["impl"], "mode": mode}
            for sfx, timer in suffixes.items():
                if r.get(f"{mode}_ms{sfx}") is not None:
                    row[f"{timer}_ms"] = r[f"{mode}_ms{sfx}"]
                for metric in ("tflops", "tbps"):
                    if r.get(f"{mode}_{metric}{sfx}") is not None:
                        row[f"{timer}_{metric}"] = r[f"{mode}_{metric}{sfx}"]
            if any(k.endswith("_ms") for k in row):
                rows.append(row)
        full = {"synced_ms": r.get("fwdbwd_ms"), "device_ms": r.get("fwdbwd_device_ms")}
        if any(v is not None for v in full.values()):
            rows.append({"op": doc.get("bench"), "shape": r["shape"], "provider": r["impl"], "mode": "full",
                         **{k: v for k, v in full.items() if v is not None}})
        if "bits_repeat" in r:
            for row in rows:
                if row["shape"] == r["shape"] and row["provider"] == r["impl"]:
                    row["bits_repeat"] = r["bits_repeat"]
    return rows


def _model_rows(doc: dict) -> list[dict]:
    """bench/model.py's rows (one per stack: a whole forward + backward step) in the harness's layout."""
    cfg = doc.get("config", {})
    shape = f"{cfg.get('layers')} layers, {cfg.get('tokens')} tokens"
    return [{"op": "model", "shape": shape, "provider": r["stack"], "mode": "full", "synced_ms": r.get("step ms"),
             "device_ms": r.get("device ms")} for r in doc["rows"]]


def rows_of(doc: dict) -> list[dict]:
    """The rows of a results document in the harness's layout, whichever layout it was written in."""
    if doc.get("bench") == "model":
        return _model_rows(doc)
    return doc["rows"] if doc.get("format", 1) >= 2 else _legacy_rows(doc)


def _metric(rows):
    if any(k.endswith("_tflops") for r in rows for k in r):
        return "tflops", "TFLOP/s"
    if any(k.endswith("_tbps") for r in rows for k in r):
        return "tbps", "TB/s"
    return None, None


def _modes(rows):
    return [m for m in MODES if any(r["mode"] == m for r in rows)]


def _timers(rows, mode):
    """The timers `mode` has, the primary (plotted, metric column) first, then device and synced where they are not
    that one."""
    have = [t for t in PRIMARY if any(f"{t}_ms" in r for r in rows if r["mode"] == mode)]
    if not have:
        return []
    return [have[0]] + [t for t in ("device", "synced") if t in have[1:]]


def _key(r):
    return r["shape"], r["provider"]


def plot(path: Path, out_dir: Path | None = None) -> Path:
    """Draw `<out_dir>/<stem>.png` (default bench/plots) from one results file and return its path."""
    import matplotlib  # here, not at the top: the tables (and the CPU tests of them) need no matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.loads(path.read_text())
    rows = rows_of(doc)
    metric, unit = _metric(rows)
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    modes = _modes(rows) or ["fwd"]
    fig, axes = plt.subplots(len(modes), 1, figsize=(max(7, 1.2 * len(shapes) + 2), 4 * len(modes)), squeeze=False)
    width = 0.8 / max(1, len(providers))
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        timers = _timers(rows, mode)
        timer = timers[0] if timers else "synced"
        by_key = {_key(r): r for r in rows if r["mode"] == mode}
        # the metric where this mode has it (legacy gdn's full mode has times only), else the times
        has_metric = metric and any(f"{timer}_{metric}" in r for r in by_key.values())
        field = f"{timer}_{metric}" if has_metric else f"{timer}_ms"
        for j, prov in enumerate(providers):
            mine = [by_key.get((s, prov), {}) for s in shapes]
            f, label = field, prov
            if not any(r.get(f) for r in mine):  # a provider measured in another timer only (legacy FlexAttention)
                other = next((t for t in PRIMARY if any(r.get(f"{t}{field[len(timer):]}") for r in mine)), None)
                if other:
                    f, label = f"{other}{field[len(timer):]}", f"{prov} ({other})"
            ax.bar([i + j * width for i in range(len(shapes))], [r.get(f) or 0.0 for r in mine], width, label=label)
        ax.set_xticks([i + width * (len(providers) - 1) / 2 for i in range(len(shapes))])
        ax.set_xticklabels(shapes, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(unit if has_metric else "ms")
        ax.set_title(f"{doc['bench']} {TITLES[mode]} ({timer} time)")
        ax.grid(axis="y", alpha=0.3)
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"{doc.get('gpu', '?')}, torch {doc.get('torch')}, triton {doc.get('triton')}, {doc.get('date')}"
                 + (" — DRY RUN, not measurements" if doc.get("dry_run") else ""), fontsize=8)
    fig.tight_layout()
    out = Path(out_dir or HERE / "plots") / f"{path.stem}.png"
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _legacy_note(doc: dict, rows: list[dict]) -> str:
    if doc.get("timer_note"):
        return doc["timer_note"]
    used = {k[:-3] for r in rows for k in r if k.endswith("_ms")}
    parts = {"device": "device = `device_ms` (the host's launch work hidden behind a GPU spin)",
             "queued": "queued = `queued_ms` (calls back to back)",
             "synced": "synced = `median_ms` (one sync per call, host launch time included)"}
    return "Times: " + "; ".join(v for k, v in parts.items() if k in used) + "."


def markdown(path: Path) -> str:
    """The README table of one results file: per shape and provider, each mode's ms in its primary timer (and
    synced), and the metric in the primary timer; — where not measured."""
    doc = json.loads(path.read_text())
    rows = rows_of(doc)
    metric, unit = _metric(rows)

    def fmt(v, p):
        return "—" if v is None else f"{v:.{p}f}"
    cols = []  # (header, mode, field, precision)
    for mode in _modes(rows):
        timers = _timers(rows, mode)
        cols += [(f"{mode} ms {t}", mode, f"{t}_ms", 3) for t in timers]
        if metric and timers and any(f"{timers[0]}_{metric}" in r for r in rows if r["mode"] == mode):
            cols.append((f"{mode} {unit} {timers[0]}", mode, f"{timers[0]}_{metric}", 2))
    table = {}
    for r in rows:
        table.setdefault(_key(r), {})[r["mode"]] = r
    dry = " — DRY RUN: one call's wall time, not measurements" if doc.get("dry_run") else ""
    lines = [(f"**{doc['bench']}** — {doc.get('gpu', '?')}, torch {doc.get('torch')}, triton {doc.get('triton')}, "
              f"{doc.get('date')} (`bench/results/{path.name}`){dry}"),
             _legacy_note(doc, rows) + (" " + doc["modes_note"] if doc.get("modes_note") else ""), "",
             "| shape | provider | " + " | ".join(c[0] for c in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    for (shape, prov), by_mode in table.items():
        cells = [fmt(by_mode.get(mode, {}).get(f), p) for _, mode, f, p in cols]
        lines.append(f"| {shape} | {prov} | " + " | ".join(cells) + " |")
    lines += ["", f"![{doc['bench']}](bench/plots/{path.stem}.png)", ""]
    return "\n".join(lines)


START, END = "<!-- bench-results:start -->", "<!-- bench-results:end -->"


def write_readme(files, readme: Path | None = None) -> None:
    readme = readme or HERE.parent / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"{readme.name} lacks the markers {START} / {END}")
    body = "\n".join(markdown(f) for f in files)
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{body}\n{END}{tail}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path)
    ap.add_argument("--readme", action="store_true", help="also rewrite README.md's results section")
    ap.add_argument("--plots", type=Path, default=None, help="folder for the PNGs (default bench/plots)")
    args = ap.parse_args(argv)
    files = args.files or sorted(p for p in (HERE / "results").glob("*.json") if "_" not in p.stem)
    for f in files:
        print(plot(f, args.plots))
    if args.readme:
        write_readme(files)


if __name__ == "__main__":
    main()
