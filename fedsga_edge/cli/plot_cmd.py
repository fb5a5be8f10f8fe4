"""``fedsga-edge plot``: test accuracy per round and the split depths chosen, for one or more runs."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import typer


def register(app: typer.Typer) -> None:
    app.command("plot")(plot)


def load_run(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{run} holds no metrics.jsonl (is it a `fedsga-edge simulate --out` folder?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def split_shares(rows: list[dict[str, Any]]) -> tuple[list[int], dict[int, list[float]]]:
    """Per round, the share of clients at each split index (0 = whole model on the device)."""
    ks = sorted({int(k) for r in rows for k in r["splits"].values()})
    rounds = [int(r["round"]) for r in rows]
    shares: dict[int, list[float]] = {k: [] for k in ks}
    for r in rows:
        counts = Counter(int(k) for k in r["splits"].values())
        total = max(sum(counts.values()), 1)
        for k in ks:
            shares[k].append(counts.get(k, 0) / total)
    return rounds, shares


def plot(
    runs: list[Path] = typer.Argument(..., help="Run folders written by `fedsga-edge simulate --out`."),
    out: Path = typer.Option(Path("runs/plot.png"), help="PNG to write."),
) -> None:
    """Accuracy curves of every run, and the split depths each run's clients used per round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    try:
        data = {run: load_run(run) for run in runs}
    except FileNotFoundError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    fig, axes = plt.subplots(1 + len(runs), 1, figsize=(8, 3 + 2.2 * len(runs)), squeeze=False)
    ax = axes[0][0]
    for run, rows in data.items():
        pts = [(r["round"], r["test_acc"]) for r in rows if "test_acc" in r]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=run.name)
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    for i, (run, rows) in enumerate(data.items(), start=1):
        ax = axes[i][0]
        rounds, shares = split_shares(rows)
        bottom = [0.0] * len(rounds)
        for k, vals in shares.items():
            ax.bar(rounds, vals, bottom=bottom, label="whole model" if k == 0 else f"split k={k}")
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel("share of clients")
        ax.set_title(f"{run.name}: split depths per round", fontsize=9)
        ax.legend(fontsize=7, loc="upper right")
    from matplotlib.ticker import MaxNLocator

    for row in axes:
        row[0].xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[-1][0].set_xlabel("round")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    typer.echo(f"wrote {out}")
