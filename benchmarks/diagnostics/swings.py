"""How much a run's test accuracy swings between evaluations, against how steadily its loss falls.

For each run under OUT (``<method>/<partition>/seed<s>/metrics.jsonl``, as benchmarks/accuracy.py
writes them): the mean absolute change of the test accuracy between consecutive evaluations (the full test
set where a round has it, else the benchmark's fixed subset), the largest drop, the training
loss's rounds that went up, and the largest class's share of the last evaluation's predictions.

    python benchmarks/diagnostics/swings.py benchmarks/records/office-v1
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def evaluations(rows: list[dict]) -> tuple[str, list[tuple[int, float, list[float] | None]]]:
    """(which sets, [(round, accuracy, prediction shares)]) for every evaluation in round order: the full
    test set where a round has it, else the benchmark's fixed subset (the same images every time)."""
    out, sets = [], set()
    for r in rows:
        for acc, share, name in (("test_acc", "test_pred_share", "full"), ("test_acc_full", "test_pred_share_full", "full"),
                                 ("test_acc_subset", "test_pred_share_subset", "subset")):
            if acc in r:
                out.append((r["round"], r[acc], r.get(share)))
                sets.add(name)
                break
    return "+".join(sorted(sets)), out


def swings(run: Path) -> dict:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    which, ev = evaluations(rows)
    accs = np.array([a for _, a, _ in ev], dtype=float)
    d = np.diff(accs)
    loss = np.array([r["train_loss"] for r in rows], dtype=float)
    share = ev[-1][2] if ev else None
    return {"set": which, "evals": len(ev), "mean_abs_change": float(np.abs(d).mean()) if len(d) else None,
            "largest_drop": float(-d.min()) if len(d) else None, "loss_rises": int((np.diff(loss) > 0).sum()),
            "rounds": len(rows), "last_top_share": max(share) if share else None}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    print("| run | set (evals) | mean abs. change between evaluations (points) | largest drop (negative: it only rose) | rounds the training loss rose | largest class's share at the last evaluation |")
    print("|---|---|---:|---:|---:|---:|")
    for run in sorted(p.parent for p in args.out.glob("*/*/seed*/metrics.jsonl")):
        s = swings(run)
        if s["mean_abs_change"] is None:
            continue
        top = "" if s["last_top_share"] is None else f"{100 * s['last_top_share']:.0f} %"
        print(f"| {run.relative_to(args.out)} | {s['set']} ({s['evals']}) | {100 * s['mean_abs_change']:.2f} | {100 * s['largest_drop']:.2f} "
              f"| {s['loss_rises']} of {s['rounds'] - 1} | {top} |")


if __name__ == "__main__":
    main()
