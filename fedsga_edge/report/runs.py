"""Finding and loading run folders, benchmark folders and device profiles (plain data, no plotting).

A run folder is what ``fedsga-edge simulate --out`` or ``benchmarks/accuracy.py`` writes:
``metrics.jsonl`` + ``config.json`` (+ ``summary.json``). A folder that is not itself a run counts
as every run below it; a folder holding ``results.json`` or ``tables.md`` is a benchmark folder and
its tables go into the report too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "ADAPTIVE",
    "Benchmark",
    "Run",
    "discover",
    "load_metrics",
    "load_profile",
    "load_run",
    "method_name",
    "partition_name",
]

ADAPTIVE = ("fedsga", "random", "resource")  # runs whose config.json predates its "method" entry
# Which fields of config.json make two runs different experiments (shown in a group's label when
# the runs given differ in them); method, partition and seed are the grouping itself.
SETTING_KEYS = ("dataset", "model", "width", "clients", "rounds")
_FEDSGA_ABLATIONS = ("adapt", "estimator", "harmonizer")  # FedSGAConfig flags, True by default


class RunError(FileNotFoundError):
    """A path named on the command line holds no run."""


@dataclass
class Run:
    path: Path
    name: str  # display name: the path relative to the folder given, or the folder's own name
    rows: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] | None = None
    method: str = ""
    partition: str = ""
    seed: int | None = None

    @property
    def strategy(self) -> str:
        return str(self.config.get("strategy", self.summary.get("strategy", "") if self.summary else ""))

    @property
    def adaptive(self) -> bool:
        method = self.config.get("method")
        if isinstance(method, dict) and isinstance(method.get("adaptive"), bool):
            return method["adaptive"]  # the strategy said so (config.json since the strategy registry)
        return self.strategy in ADAPTIVE

    def setting(self) -> dict[str, Any]:
        return {k: self.config.get(k) for k in SETTING_KEYS}


@dataclass
class Benchmark:
    """A folder written by ``benchmarks/accuracy.py``: its markdown tables and settings."""

    path: Path
    tables_markdown: str | None
    preset: str | None = None
    command: str | None = None


def load_metrics(run: Path) -> list[dict[str, Any]]:
    """The rows of ``run/metrics.jsonl``; a truncated last line (a run still writing) is dropped."""
    path = run / "metrics.jsonl"
    if not path.is_file():
        raise RunError(f"{run} holds no metrics.jsonl (is it a `fedsga-edge simulate --out` folder?)")
    rows = []
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            raise
    return rows


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def method_name(config: dict[str, Any]) -> str:
    """``benchmarks/accuracy.py``'s method name, as the strategy recorded it in config.json; runs made
    before config.json carried it: the strategy, and for FedSGA each ablation switched off."""
    method = config.get("method")
    if isinstance(method, dict) and isinstance(method.get("name"), str) and method["name"]:
        return method["name"]
    strategy = str(config.get("strategy", ""))
    if strategy == "static":  # at p_ref "static"; the benchmark's "static-p1" / "static-pK" otherwise
        K, split = len(config.get("candidate_depths") or []), config.get("split")
        ref = (K + 1) // 2
        if not K or not isinstance(split, int) or split == ref:
            return "static"
        return "static-p1" if split == 1 else "static-pK" if split == K else f"static-k{split}"
    if strategy != "fedsga":
        return strategy
    fed = config.get("fedsga") or {}
    off = [flag for flag in _FEDSGA_ABLATIONS if fed.get(flag, True) is False]
    K, split = len(config.get("candidate_depths") or []), config.get("split")
    pinned = []  # without the estimator every device sits at --split (FedSGA.method_name)
    if "estimator" in off and K and isinstance(split, int) and split != (K + 1) // 2:
        pinned = ["p1" if split == 1 else "pK" if split == K else f"k{split}"]
    return "-".join(["fedsga"] + [f"no-{flag}" for flag in off] + pinned
                    + (["deadline"] if fed.get("deadline_aware") else []) + (["memory"] if fed.get("label_memory") else []))


def partition_name(config: dict[str, Any]) -> str:
    """``iid``, ``dir0.1`` (Dirichlet with its alpha), ``domain0.1`` or ``mixed0.05``, as benchmark folders name them."""
    kind = str(config.get("partition", ""))
    if kind == "dirichlet":
        return f"dir{float(config.get('alpha', 0.1)):g}"
    if kind in ("domain", "mixed"):
        return f"{kind}{float(config.get('alpha', 0.1)):g}"
    return kind


_SEED = re.compile(r"^seed(\d+)$")


def load_run(path: Path, name: str | None = None) -> Run:
    """One run folder; labels come from config.json, else from a benchmark's OUT/<method>/<partition>/seed<s>/."""
    rows = load_metrics(path)
    config = _read_json(path / "config.json") or {}
    summary = _read_json(path / "summary.json")
    run = Run(path=path, name=name or path.name, rows=rows, config=config, summary=summary)
    m = _SEED.match(path.name)
    if config:
        run.method, run.partition = method_name(config), partition_name(config)
        run.seed = int(config["seed"]) if isinstance(config.get("seed"), int) else (int(m.group(1)) if m else None)
    elif m and len(path.parts) >= 3:  # benchmark layout without config.json
        run.method, run.partition, run.seed = path.parent.parent.name, path.parent.name, int(m.group(1))
    else:
        run.method, run.partition = path.name, ""
    if not run.method:
        run.method = (summary or {}).get("strategy") or path.name
    return run


def discover(inputs: list[Path]) -> tuple[list[Run], list[Benchmark], list[str]]:
    """Every run named or found below the inputs, the benchmark folders among them, and notes.

    A folder holding metrics.jsonl is a run (config.json optional when named directly); any other
    folder is searched recursively for folders holding metrics.jsonl and config.json.
    Raises RunError for a path that does not exist or holds no run at all.
    """
    runs: list[Run] = []
    benches: list[Benchmark] = []
    notes: list[str] = []
    seen: set[Path] = set()
    for given in inputs:
        if not given.is_dir():
            raise RunError(f"{given} holds no metrics.jsonl (is it a `fedsga-edge simulate --out` folder?)")
        if (given / "metrics.jsonl").is_file():
            found = [given]
        else:
            found = []
            for metrics in sorted(given.rglob("metrics.jsonl")):
                if (metrics.parent / "config.json").is_file():
                    found.append(metrics.parent)
                else:
                    notes.append(f"skipped {metrics.parent}: metrics.jsonl without config.json")
            if not found:
                raise RunError(f"{given} holds no metrics.jsonl, nor any run folder "
                               "(metrics.jsonl + config.json) below it")
        for path in found:
            key = path.resolve()
            if key in seen:
                continue
            seen.add(key)
            name = path.name if path == given else f"{given.name}/{path.relative_to(given).as_posix()}"
            run = load_run(path, name)
            if not run.rows:
                notes.append(f"skipped {path}: metrics.jsonl is empty")
                continue
            runs.append(run)
        for folder in [given, *sorted(p.parent for p in given.rglob("results.json"))]:
            bench = _benchmark(folder)
            if bench is not None and all(b.path.resolve() != folder.resolve() for b in benches):
                benches.append(bench)
    _disambiguate(runs)
    return runs, benches, notes


def _disambiguate(runs: list[Run]) -> None:
    """Runs that share a display name (two folders named seed0) get as many path parts as tell them apart."""
    counts: dict[str, int] = {}
    for r in runs:
        counts[r.name] = counts.get(r.name, 0) + 1
    clashing = [r for r in runs if counts[r.name] > 1]
    for depth in range(2, 1 + max((len(r.path.resolve().parts) for r in clashing), default=0)):
        names = ["/".join(r.path.resolve().parts[-depth:]) for r in clashing]
        if len(set(names)) == len(names) or depth == len(clashing[0].path.resolve().parts):
            for r, n in zip(clashing, names):
                r.name = n
            return


def _benchmark(folder: Path) -> Benchmark | None:
    results = _read_json(folder / "results.json")
    tables = folder / "tables.md"
    if results is None and not tables.is_file():
        return None
    md = tables.read_text() if tables.is_file() else None
    if md is None and results is not None:
        md = results.get("tables_markdown")
    results = results or {}
    return Benchmark(path=folder, tables_markdown=md, preset=results.get("preset"), command=results.get("command"))


def load_profile(path: Path) -> dict[str, Any]:
    """A ``fedsga-edge profile --json`` report: {device, model, settings, results: [...]}."""
    data = _read_json(path)
    if data is None or not isinstance(data.get("results"), list):
        raise RunError(f"{path} is not a `fedsga-edge profile --json` report (needs a 'results' list)")
    return data
