"""Compare groups of runs that live in different benchmark folders, paired by seed.

``benchmarks/accuracy.py --tables-only`` tables the runs of one plan (one ``--out``, one set of run options).
A diagnostic often sets one option apart (``--server-copies per-client`` in its own folder) and must be read
against runs of the main plan: this pairs any groups by seed with the benchmark's own statistics (headline
accuracy, paired difference to the first group with its standard error and wins, client FLOPs ratio, and the
bytes a run put on the wire, both ways, weights included).

    python benchmarks/diagnostics/compare.py benchmarks/records/cifar/static/dir0.1 \\
        benchmarks/records/cifar-v1/static/dir0.1 benchmarks/records/cifar-v1/fedavg/dir0.1

Each argument is a folder of ``seed<s>/summary.json`` (NAME=FOLDER labels a row; FOLDER,FOLDER joins the seeds of
several, e.g. reported and fresh seeds kept apart); the first is the reference.
Only seeds every group finished are compared, so the rows stand on the same seeds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from accuracy import _ms, _paired_cell, _ratio, acc_of, paired  # noqa: E402  (the benchmark's own statistics and cells)


def load_group(folders: tuple[Path, ...]) -> dict[int, dict[str, Any]]:
    """seed -> summary for every finished run (one with summary.json) in ``folder/seed<s>`` of each folder (one
    group's seeds may live in several: the reported ones and fresh ones in their own folder)."""
    runs: dict[int, dict[str, Any]] = {}
    for folder in folders:
        for path in sorted(folder.glob("seed*/summary.json")):
            try:
                seed = int(path.parent.name.removeprefix("seed"))
            except ValueError:
                continue
            if seed in runs:
                raise SystemExit(f"seed {seed} is in more than one of {', '.join(map(str, folders))}")
            runs[seed] = json.loads(path.read_text()) | {"_seed": seed}
    return runs


def compare(groups: list[tuple[str, tuple[Path, ...]]]) -> tuple[list[int], list[dict[str, Any]]]:
    """(the common seeds, one row per group: label, its runs on those seeds, per-seed headlines, the paired
    difference to the first group)."""
    loaded = [(label, load_group(folders)) for label, folders in groups]
    empty = [",".join(map(str, folders)) for (label, folders), (_, runs) in zip(groups, loaded) if not runs]
    if empty:
        raise SystemExit(f"no finished runs (seed<s>/summary.json) under: {', '.join(empty)}")
    seeds = sorted(set.intersection(*(set(runs) for _, runs in loaded)))
    if not seeds:
        raise SystemExit("the groups have no seed in common")
    ref = [loaded[0][1][s] for s in seeds]
    rows = []
    for label, runs in loaded:
        mine = [runs[s] for s in seeds]
        rows.append({"label": label, "runs": mine, "per_seed": [acc_of(r) for r in mine], "paired": paired(mine, ref)})
    return seeds, rows


def markdown(seeds: list[int], rows: list[dict[str, Any]]) -> str:
    ref = rows[0]["runs"]
    lines = [f"Seeds {', '.join(map(str, seeds))}; headline % (mean ± std); Δ to {rows[0]['label']}, paired "
             "(mean ± SE, wins)", "",
             "| runs | headline % | Δ, paired (wins) | per seed | client FLOPs / reference's | wire MB / run |",
             "|---|---:|---:|---|---:|---:|"]
    for r in rows:
        delta = "0 (reference)" if r is rows[0] else _paired_cell(r["paired"])
        flops = _ratio(r["runs"], ref, lambda s: s.get("client_flops_per_sample"))
        sent = [s["bytes_total"] for s in r["runs"] if s.get("bytes_total") is not None]
        wire = f"{sum(sent) / len(sent) / 1e6:.1f}" if len(sent) == len(r["runs"]) else "-"
        lines.append(f"| {r['label']} | {_ms(r['per_seed'])} | {delta} | "
                     f"{', '.join(f'{a * 100:.2f}' for a in r['per_seed'])} | {flops} | {wire} |")
    return "\n".join(lines)


def depth_heads(seeds: list[int], rows: list[dict[str, Any]]) -> str:
    """The last round's accuracy under each depth head (FedSGA's harmonizer: one depth embedding per split), the
    headline's head in bold, and the mean spread between heads; with ``headline_acc_depth_mean`` in the summaries
    (runs that record it), the headline window scored by the heads' averaged softmax beside the headline."""
    lines = ["", "Last round, % under each depth head (the headline's in bold); spread = max - min, mean over seeds", "",
             "| runs | " + " | ".join(f"seed {s}" for s in seeds) + " | mean spread | headline % | depth-mean % |",
             "|---|" + "---|" * len(seeds) + "---:|---:|---:|"]
    for r in rows:
        cells, spreads = [], []
        for run in r["runs"]:
            by = run.get("final_acc_by_split") or {}
            vals = dict(sorted(by.items(), key=lambda kv: int(kv[0])))
            if len(set(vals.values())) <= 1:
                cells.append("one head" if vals else "-")
                spreads.append(0.0)
                continue
            shown = str(run.get("eval_split"))
            cells.append(" / ".join(f"**{v * 100:.1f}**" if k == shown else f"{v * 100:.1f}" for k, v in vals.items()))
            spreads.append((max(vals.values()) - min(vals.values())) * 100)
        means = [run.get("headline_acc_depth_mean") for run in r["runs"]]
        dm = _ms(means) if None not in means else "-"
        lines.append(f"| {r['label']} | " + " | ".join(cells) + f" | {sum(spreads) / len(spreads):.1f} | "
                     f"{_ms(r['per_seed'])} | {dm} |")
    return "\n".join(lines)


def parse_group(arg: str) -> tuple[str, tuple[Path, ...]]:
    label, sep, folders = arg.partition("=")
    paths = tuple(Path(f) for f in (folders if sep else arg).split(","))
    for path in paths:
        if not path.is_dir():
            raise SystemExit(f"{path}: not a folder of seed<s>/ runs")
    return (label if sep else arg), paths


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("groups", nargs="+",
                    help="[NAME=]FOLDER[,FOLDER...] of seed<s>/ runs; the first is the reference")
    ap.add_argument("--depth-heads", action="store_true",
                    help="also table each run's last-round accuracy under every depth head (FedSGA's harmonizer)")
    args = ap.parse_args(argv)
    if len(args.groups) < 2:
        ap.error("give a reference group and at least one to compare with it")
    seeds, rows = compare([parse_group(g) for g in args.groups])
    text = markdown(seeds, rows) + (depth_heads(seeds, rows) + "\n" if args.depth_heads else "")
    print(text)
    return text


if __name__ == "__main__":
    main()
