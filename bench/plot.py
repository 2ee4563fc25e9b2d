"""Draw the README plots from bench/results/*.json: one PNG per benchmark in bench/plots/.

Each results file has rows with `shape`, `impl`, `fwd_ms`, `bwd_ms` and either `fwd_tflops`/`bwd_tflops` or
`fwd_tbps`/`bwd_tbps`; the plot shows, per shape, one bar per implementation for forward and backward.
Usage: python bench/plot.py [results.json ...]   (default: every file in bench/results)
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
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 1.6 * len(shapes) * 2), 4.5), sharey=False)
    width = 0.8 / max(1, len(impls))
    for ax, phase in zip(axes, ("fwd", "bwd")):
        for j, impl in enumerate(impls):
            vals = []
            for s in shapes:
                r = next((r for r in rows if r["shape"] == s and r["impl"] == impl), None)
                vals.append((r or {}).get(f"{phase}_{metric}") or 0.0)
            ax.bar([i + j * width for i in range(len(shapes))], vals, width, label=impl)
        ax.set_xticks([i + width * (len(impls) - 1) / 2 for i in range(len(shapes))])
        ax.set_xticklabels(shapes, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(unit)
        ax.set_title(f"{doc['bench']} {'forward' if phase == 'fwd' else 'backward'}")
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


if __name__ == "__main__":
    files = [Path(p) for p in sys.argv[1:]] or sorted((HERE / "results").glob("*.json"))
    for f in files:
        print(plot(f))
