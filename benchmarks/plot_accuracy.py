"""Accuracy against client FLOPs/sample, one panel per partition, from ``accuracy.py``'s results.json.

    python benchmarks/plot_accuracy.py benchmarks/records/cifar-v1/results.json --out benchmarks/records/cifar-v1/accuracy_vs_flops.png

Each point is one method (mean over seeds), with the seeds' standard deviation as error bars.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="PNG path (default: accuracy_vs_flops.png beside results.json).")
    args = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = json.loads(args.results.read_text())
    groups: dict[str, dict[str, list[dict]]] = {}
    for r in data["runs"]:
        groups.setdefault(r["partition"], {}).setdefault(r["method"], []).append(r["summary"])
    parts = list(groups)
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4.5), squeeze=False)
    for ax, part in zip(axes[0], parts):
        for method, ss in sorted(groups[part].items()):
            acc = np.array([s["final_acc"] for s in ss]) * 100
            flops = np.mean([s["client_flops_per_sample"] for s in ss]) / 1e6
            ax.errorbar(flops, acc.mean(), yerr=acc.std(ddof=1) if len(acc) > 1 else 0, fmt="o", capsize=3,
                        color="C3" if method == "fedsga" else None)
            ax.annotate(method, (flops, acc.mean()), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax.set_title(part)
        ax.set_xlabel("client MFLOPs / training sample (fwd+bwd)")
        ax.set_ylabel("final test accuracy (%)")
        ax.grid(alpha=0.3)
    fig.suptitle(f"CIFAR-10, preset {data['preset']}")
    fig.tight_layout()
    out = args.out or args.results.with_name("accuracy_vs_flops.png")
    fig.savefig(out, dpi=120)
    print(out)
    return out


if __name__ == "__main__":
    main()
