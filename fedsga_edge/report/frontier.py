"""The static frontier: what fixed cuts reach at a given client cost, and how far an adaptive method sits from it.

A fleet that wants a client cost between two fixed cuts can mix them (some devices or rounds at each), which
reaches any convex combination of their (client FLOPs, accuracy) points. So the frontier at cost ``c`` is the
best accuracy any fixed cut or fixed mix of cuts reaches with no more than ``c`` FLOPs: the upper envelope of
the cuts' points, never falling as the cost grows. A cut that another matches or beats in accuracy at no more
FLOPs never shapes it, and a line between two dominated cuts is not part of it. An adaptive split policy earns
its keep only by sitting above that envelope at its own client FLOPs. Torch-free.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SCORES", "Point", "distance", "envelope", "frontier_at", "frontier_groups", "paired_distance", "run_point", "summary_score"]


@dataclass(frozen=True)
class Point:
    """One run, or one cut's run on one seed: its client FLOPs per sample and its accuracy."""

    flops: float
    acc: float
    name: str = ""


def envelope(points: Sequence[Point]) -> list[Point]:
    """The frontier's vertices, cheapest first: the undominated cuts that lie on the upper concave hull.

    Between two consecutive vertices the frontier is the straight line (a mix of the two cuts); past the
    last vertex it stays at the last one's accuracy (more FLOPs buy nothing a cheaper cut does not give)."""
    if not points:
        raise ValueError("the frontier needs at least one fixed cut's point")
    bad = [p for p in points if not (np.isfinite(p.flops) and np.isfinite(p.acc)) or p.flops < 0]
    if bad:
        raise ValueError(f"a frontier point needs finite accuracy and FLOPs >= 0, got {bad[0]}")
    pareto: list[Point] = []  # strictly more accurate as the cost grows: every other cut is dominated
    for p in sorted(points, key=lambda q: (q.flops, -q.acc)):
        if not pareto or p.acc > pareto[-1].acc:
            pareto.append(p)
    hull: list[Point] = []  # upper hull: drop a vertex that lies on or under the line its neighbours make
    for p in pareto:
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) >= 0:
            hull.pop()
        hull.append(p)
    return hull


def _cross(a: Point, b: Point, c: Point) -> float:
    """> 0 when ``b`` lies under the line from ``a`` to ``c`` (a left turn going a, b, c)."""
    return (b.flops - a.flops) * (c.acc - a.acc) - (b.acc - a.acc) * (c.flops - a.flops)


def frontier_at(points: Sequence[Point], flops: float) -> float | None:
    """The best accuracy a fixed cut or mix of cuts reaches with at most ``flops`` client FLOPs; None below the
    cheapest cut (no fixed cut is that cheap, so there is nothing to compare with)."""
    hull = envelope(points)
    if flops < hull[0].flops:
        return None
    if flops >= hull[-1].flops:
        return hull[-1].acc
    xs = [p.flops for p in hull]
    return float(np.interp(flops, xs, [p.acc for p in hull]))


def distance(points: Sequence[Point], flops: float, acc: float) -> float | None:
    """``acc`` minus the frontier at ``flops``: above the frontier > 0; None below the cheapest cut's FLOPs."""
    ref = frontier_at(points, flops)
    return None if ref is None else acc - ref


def paired_distance(cuts: Mapping[int, Sequence[Point]], method: Mapping[int, Point]) -> dict[str, object] | None:
    """A method's distance to the frontier seed by seed (each seed's frontier from that seed's cuts), over the seeds
    both have: mean, standard error (std of the distances / sqrt(n); None for one seed), wins (seeds above the
    frontier) and n; ``below_cheapest``: the seeds left out because the method ran cheaper than every cut.
    None when no seed pairs."""
    seeds = sorted(s for s in method if cuts.get(s))
    d, cheaper = [], []
    for s in seeds:
        gap = distance(cuts[s], method[s].flops, method[s].acc)
        if gap is None:
            cheaper.append(s)
        else:
            d.append(gap)
    if not d:
        return None if not cheaper else {"mean": None, "se": None, "wins": 0, "n": 0, "below_cheapest": cheaper}
    arr = np.asarray(d, dtype=float)
    se = float(np.std(arr, ddof=1) / np.sqrt(len(arr))) if len(arr) > 1 else None
    return {"mean": float(arr.mean()), "se": se, "wins": int((arr > 0).sum()), "n": len(arr), "below_cheapest": cheaper}


# -- the report's frontier section: from loaded runs (fedsga_edge/report/runs.py) ------------------------------
# The accuracies a frontier is drawn on: the benchmark's headline on the test set, and each device's accuracy on
# its own held-out data (``--eval-holdout``; the final model, each device scoring the model it runs, its own front
# under ``--fronts private``). The two can disagree on which cut is best, so each gets a frontier of its own.
SCORES = ("test", "own data")


def summary_score(summary: Mapping[str, Any], score: str = "test") -> Any:
    """One ``SCORES`` figure of a summary.json (the benchmark's tables read the same): ``test``, the headline where
    recorded (runs from before the headline window have only their final round's); ``own data``, the final model's
    ``final_own_acc`` (None without ``--eval-holdout``: never an earlier model's)."""
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    if score == "own data":
        return summary.get("final_own_acc")
    value = summary.get("headline_acc")
    return summary.get("final_acc") if value is None else value


# What the test figure of runs with private fronts scored before it followed each device's split: every device's
# whole front, its untrained copies of the blocks past its split included (coordinator/fronts.py has the model
# scored now). Such a figure stands for no model a device runs, so it makes no frontier point.
STALE_TEST_MODELS = ("each device's own front with the shared server side, averaged by data",)


def stale_test_model(rows: Iterable[Mapping[str, Any]], config: Mapping[str, Any]) -> str | None:
    """The retired test model (``STALE_TEST_MODELS``) a record's rows name where it was not the model the devices
    run; None otherwise. A row whose devices all sat at the deepest candidate split scored the right model anyway:
    their whole front is the model they run (config.json's ``candidate_depths``; without it every such row is
    stale)."""
    depths = config.get("candidate_depths") or []
    deepest = max(depths) if depths else None
    for row in rows:
        old = row.get("test_model")
        if old in STALE_TEST_MODELS:
            at = list((row.get("depths") or {}).values())
            if deepest is None or not at or any(d != deepest for d in at):
                return str(old)
    return None


def run_point(run: Any, score: str = "test") -> Point | None:
    """A run's (client FLOPs per sample, accuracy) from its summary.json; None without both. ``test``: the
    benchmark's headline accuracy where it has one (the mean of its last full-test evaluations), else the final
    round's, and none where its rows say it scored a retired model no device runs (``stale_test_model``);
    ``own data``: the final model's accuracy on the devices' held-out data (``final_own_acc``)."""
    s = run.summary or {}
    if score == "test" and stale_test_model(run.rows or (), run.config or {}):
        return None
    acc = summary_score(s, score)
    flops = s.get("client_flops_per_sample")
    if not isinstance(acc, (int, float)) or not isinstance(flops, (int, float)):
        return None
    return Point(float(flops), float(acc), run.method)


# What makes two runs of one partition different regimes (one shared server copy or a copy per device, shared or
# private fronts, a held-out slice or not ...): each regime gets a frontier of its own, never a frontier of one
# regime's cuts for another regime's methods.
REGIME_KEYS = ("dataset", "model", "width", "clients", "rounds", "server_copies", "fronts", "server_lr",
               "eval_holdout")


def _regime(config: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A run's ``REGIME_KEYS``. A key its record lacks was added after the run, which then had the option's
    default (or ``config.RECORD_BEFORE``'s value where the default changed): runs made before ``--fronts`` existed
    trained with shared fronts, and share a frontier with the runs that say so."""
    before = _record_defaults()
    return tuple((k, config[k] if k in config else before.get(k)) for k in REGIME_KEYS)


@functools.cache
def _record_defaults() -> dict[str, Any]:
    from fedsga_edge.config import RECORD_BEFORE, RunConfig

    return RunConfig().to_dict() | RECORD_BEFORE


def _plan_root(run: Any) -> str:
    """The benchmark folder a run belongs to (``OUT`` of ``OUT/<method>/<partition>/seed<s>[/<format>]``), or the
    run's own folder outside that layout."""
    path = Path(run.path)
    for at in (path, *path.parents):
        if run.seed is not None and at.name == f"seed{run.seed}":
            return str(at.parents[2]) if len(at.parents) > 2 else str(at.parent)
    return str(path)


def frontier_groups(runs: Sequence[Any]) -> list[dict[str, Any]]:
    """Per partition, regime and score (``SCORES``) with two or more fixed cuts (``--strategy static`` at different
    splits) and an adaptive method: the cuts' mean points and the envelope through them, and each adaptive method's
    mean point with its distance to its own seeds' frontiers (``paired_distance``). Only seeds every cut ran on
    count; the own-data score only where the runs have it."""
    out = []
    for score in SCORES:
        regimes: dict[tuple[str, tuple], list[tuple[Any, Point]]] = {}
        for r in runs:
            if r.seed is not None and (q := run_point(r, score)) is not None:
                regimes.setdefault((r.partition, _regime(r.config)), []).append((r, q))
        differ = [k for i, k in enumerate(REGIME_KEYS) if len({key[1][i][1] for key in regimes}) > 1]
        for (part, regime), mine in sorted(regimes.items(), key=lambda kv: (kv[0][0] != "iid", repr(kv[0]))):
            for plan, runs_of_plan in _by_plan(mine):
                group = _frontier_group(runs_of_plan)
                if group:
                    label = " · ".join([part] + [f"{k}={v}" for k, v in regime if k in differ]
                                       + ([plan] if plan else []) + ([score] if score != "test" else []))
                    out.append({"partition": label, "score": score} | group)
    return out


def _by_plan(mine: list[tuple[Any, Point]]) -> list[tuple[str, list[tuple[Any, Point]]]]:
    """One regime's runs as one frontier, unless two runs of one method and seed come from different benchmark
    folders (FedSGA's runs at its defaults beside an earlier setting's kept under ``options/``): then each folder
    is a frontier of its own, named by its path, since a method's point per seed must be one run."""
    roots = {id(r): _plan_root(r) for r, _ in mine}
    seen: dict[tuple[str, int], str] = {}
    for r, _ in mine:
        if seen.setdefault((r.method, r.seed), roots[id(r)]) != roots[id(r)]:
            break
    else:
        return [("", mine)]
    plans = sorted(set(roots.values()))
    common = os.path.commonpath(plans) if len(plans) > 1 else ""
    return [(os.path.relpath(root, os.path.dirname(common)) if common else root,
             [(r, q) for r, q in mine if roots[id(r)] == root]) for root in plans]


def _frontier_group(mine: list[tuple[Any, Point]]) -> dict[str, Any] | None:
    """One partition and regime's frontier (``frontier_groups``); None without two cuts and an adaptive method."""
    cut_runs = [(r, q) for r, q in mine if r.strategy == "static"]
    names = sorted({r.method for r, _ in cut_runs}, key=lambda m: min(q.flops for r, q in cut_runs if r.method == m))
    adaptive = [(r, q) for r, q in mine if r.strategy != "static" and r.adaptive]
    if len(names) < 2 or not adaptive:
        return None
    seeds = set.intersection(*({r.seed for r, _ in cut_runs if r.method == m} for m in names))
    cuts = {s: [q for r, q in cut_runs if r.seed == s] for s in seeds}
    cut_means = [_mean_point([q for r, q in cut_runs if r.method == m and r.seed in seeds], m) for m in names]
    methods = []
    for m in dict.fromkeys(r.method for r, _ in adaptive):
        pts = {r.seed: q for r, q in adaptive if r.method == m and r.seed in seeds}
        if pts:
            methods.append(_mean_point(list(pts.values()), m) | {"delta": paired_distance(cuts, pts)})
    if not methods:
        return None
    hull = envelope([Point(c["flops"], c["acc"]) for c in cut_means])
    return {"seeds": sorted(seeds), "cuts": cut_means, "methods": methods, "envelope": [(p.flops, p.acc) for p in hull]}


def _mean_point(points: list[Point], method: str) -> dict[str, Any]:
    return {"method": method, "flops": float(np.mean([p.flops for p in points])),
            "acc": float(np.mean([p.acc for p in points])), "n": len(points)}
