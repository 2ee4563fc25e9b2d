"""Draw the README plots from bench/results/*.json: one PNG per benchmark in bench/plots/.

Each results file has rows with `shape`, `impl`, `fwd_ms`, `bwd_ms` and either `fwd_tflops`/`bwd_tflops` or
`fwd_tbps`/`bwd_tbps`; the plot shows, per shape, one bar per implementation for forward and backward.
Usage: python bench/plot.py [--readme] [results.json ...]
  default: the latest file of each benchmark (bench/results/<name>.json; versioned files such as gqa_v4.json are
  history and are skipped). --readme also rewrites README.md's results section (tables + plots) from those files.
"""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent


def plot(path: Path) -> Path:
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    metric = "tflops" if any("fwd_tflops" in r for r in rows) else "tbps"
    unit = "TFLOP/s" if metric == "tflops" else "TB/s"
    shapes = list(dict.fromkeys(r["shape"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(7, 1.2 * len(shapes) + 2), 8))
    width = 0.8 / max(1, len(impls))
    for ax, phase in zip(axes, ("fwd", "bwd")):
        for j, impl in enumerate(impls):
            vals = []
            for s in shapes:
                r = next((r for r in rows if r["shape"] == s and r["impl"] == impl), None)
                r = r or {}
                # device time where the benchmark measured it (the host's launch work hidden), else one sync per call
                vals.append(r.get(f"{phase}_{metric}_device") or r.get(f"{phase}_{metric}") or 0.0)
            ax.bar([i + j * width for i in range(len(shapes))], vals, width, label=impl)
        ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(shapes))])
        ax.set_xticklabels(shapes, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(unit)
        dev = any(f"{phase}_{metric}_device" in r for r in rows)
        ax.set_title(f"{doc['bench']} {'forward' if phase == 'fwd' else 'backward'}"
                     + (" (device time where measured)" if dev else ""))
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{doc.get('gpu', '?')}, torch {doc.get('torch')}, triton {doc.get('triton')}, {doc.get('date')}",
                 fontsize=8)
    fig.tight_layout()
    out = HERE / "plots" / f"{path.stem}.png"
    out.parent.mkdir(exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def markdown(path: Path) -> str:
    """The README table of one results file: per shape and implementation, ms and the metric, fwd and bwd."""
    doc = json.loads(path.read_text())
    rows = doc["rows"]
    metric = "tflops" if any("fwd_tflops" in r for r in rows) else "tbps"
    unit = "TFLOP/s" if metric == "tflops" else "TB/s"
    fmt = lambda v, p: "—" if v is None else f"{v:.{p}f}"  # noqa: E731
    lines = [f"**{doc['bench']}** — {doc.get('gpu', '?')}, torch {doc.get('torch')}, triton {doc.get('triton')}, "
             f"{doc.get('date')} (`bench/results/{path.name}`)", "",
             f"| shape | impl | fwd ms | bwd ms | fwd {unit} | bwd {unit} |", "|---|---|---|---|---|---|"]
    dev = any(f"bwd_{metric}_device" in r for r in rows)  # forward and backward also in device time (gqa)
    if dev:
        lines[-2] += f" fwd {unit} device | bwd {unit} device |"
        lines[-1] += "---|---|"
    both = any("fwdbwd_ms" in r for r in rows)  # a forward + backward time of its own (gdn)
    both_dev = any("fwdbwd_device_ms" in r for r in rows)  # ... also in device time
    if both:
        lines[-2] += " fwd+bwd ms |" + (" fwd+bwd device ms |" if both_dev else "")
        lines[-1] += "---|" + ("---|" if both_dev else "")
    if doc.get("timer_note"):
        lines.insert(1, doc["timer_note"])
    elif any("fwd_ms_synced" in r for r in rows):
        lines.insert(1, "Times: calls queued back to back (`queued_ms`: a launch's host work hides behind the previous "
                        "kernel when it is shorter); the JSON also has `*_synced` (one sync per call).")
    elif any("fwd_ms_queued" in r for r in rows):
        lines.insert(1, "Times: one sync per call (`median_ms`, host launch time included); the JSON also has "
                        "`*_queued` (calls back to back).")
    elif dev:
        lines.insert(1, "Times: one sync per call (`median_ms`, host launch time included); the device columns "
                        "(`device_ms`: the host's launch work hidden behind a GPU spin, as in a training step whose "
                        "host runs ahead) are the kernels' speed; — where not measured.")
    elif both_dev:
        lines.insert(1, "Times: one sync per call (`median_ms`); the last column is forward + backward in device time "
                        "(`device_ms`: the host's launch work hidden behind a GPU spin).")
    else:
        lines.insert(1, "Times: one sync per call (`median_ms`).")
    for r in rows:
        lines.append(f"| {r['shape']} | {r['impl']} | {fmt(r.get('fwd_ms'), 3)} | {fmt(r.get('bwd_ms'), 3)} | "
                     f"{fmt(r.get(f'fwd_{metric}'), 2)} | {fmt(r.get(f'bwd_{metric}'), 2)} |"
                     + (f" {fmt(r.get(f'fwd_{metric}_device'), 2)} | {fmt(r.get(f'bwd_{metric}_device'), 2)} |"
                        if dev else "")
                     + (f" {fmt(r.get('fwdbwd_ms'), 3)} |" if both else "")
                     + (f" {fmt(r.get('fwdbwd_device_ms'), 3)} |" if both_dev else ""))
    lines += ["", f"![{doc['bench']}](bench/plots/{path.stem}.png)", ""]
    return "\n".join(lines)


START, END = "<!-- bench-results:start -->", "<!-- bench-results:end -->"


def write_readme(files) -> None:
    readme = HERE.parent / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        raise SystemExit(f"README.md lacks the markers {START} / {END}")
    body = "\n".join(markdown(f) for f in files)
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{body}\n{END}{tail}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--readme"]
    files = [Path(p) for p in args] or sorted(p for p in (HERE / "results").glob("*.json") if "_" not in p.stem)
    for f in files:
        print(plot(f))
    if "--readme" in sys.argv[1:]:
        write_readme(files)
