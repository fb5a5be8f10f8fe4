"""Who runs how deep this round: one assigner per strategy (FedSGA lets the devices decide).

``assign`` returns client id -> split index k (1..K), 0 for "the whole model on the device"
(FedAvg, FedProx), or None for "the device chooses" (FedSGA's estimator).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from fedsga_edge.method import reference_index

__all__ = ["SplitAssigner", "make_assigner", "resource_splits"]


class SplitAssigner:
    def __init__(self, strategy: str, num_splits: int, *, split: int = 1, seed: int = 0,
                 resource: dict[str, int] | None = None, estimator: bool = True) -> None:
        self.strategy = strategy
        self.K = num_splits
        self.split = split
        self.rng = np.random.default_rng([seed, 7])
        self.resource = resource or {}
        self.estimator = estimator

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        s = self.strategy
        if s in ("fedavg", "fedprox"):
            return {c: 0 for c in clients}
        if s == "static":
            return {c: self.split for c in clients}
        if s == "random":
            return {c: int(self.rng.integers(1, self.K + 1)) for c in clients}
        if s == "resource":
            return {c: self.resource[c] for c in clients}
        if s == "fedsga":
            return {c: (None if self.estimator else reference_index(self.K)) for c in clients}
        raise ValueError(f"unknown strategy {s!r}")


def resource_splits(
    clients: list[str], train_flops: dict[int, int], *, seed: int = 0, sigma: float = 0.5,
    profile: str | Path | None = None,
) -> tuple[dict[str, int], dict[str, float]]:
    """MultiSFL-style baseline: each client gets the deepest split whose per-sample latency fits.

    Client speeds are log-normal factors (seeded, median 1, spread ``sigma``); the budget is the
    per-sample latency of the reference split on a median device, so a median device sits at
    p_ref, faster ones go deeper and slower ones shallower. With a measured ``profile`` (the JSON
    of ``fedsga-edge profile``), latency per split comes from it instead of FLOPs (device speed
    factors still apply). Approximation: latency is taken as proportional to FLOPs / speed.
    """
    K = len([k for k in train_flops if k > 0])
    cost = {k: float(train_flops[k]) for k in range(1, K + 1)}
    if profile is not None:
        cost = _profile_latency(profile, K)
    rng = np.random.default_rng([seed, 11])
    speed = {c: float(math.exp(sigma * rng.standard_normal())) for c in clients}
    budget = cost[reference_index(K)]
    out: dict[str, int] = {}
    for c in clients:
        fits = [k for k in range(1, K + 1) if cost[k] / speed[c] <= budget * (1 + 1e-9)]
        out[c] = max(fits) if fits else 1
    return out, speed


def _profile_latency(path: str | Path, K: int) -> dict[int, float]:
    """Per-sample p50 latency per split from `fedsga-edge profile --json`: the train step where it
    was measured (what a training device pays), else the forward; the largest batch profiled."""
    data = json.loads(Path(path).read_text())
    rows = data.get("results", []) if isinstance(data, dict) else data
    best: dict[int, tuple[int, float]] = {}
    for row in rows:
        if row.get("variant", "fp32") != "fp32":
            continue
        stats = row.get("train_step_ms") or row.get("latency_ms")
        if not stats:
            continue
        k, batch = int(row["split"]), int(row.get("batch", 1))
        if k not in best or batch > best[k][0]:
            best[k] = (batch, float(stats["p50"]) / batch)
    missing = [k for k in range(1, K + 1) if k not in best]
    if missing:
        raise ValueError(f"profile {path} has no fp32 latency for split(s) {missing}")
    return {k: v for k, (_, v) in best.items()}


def make_assigner(strategy: str, num_splits: int, clients: list[str], train_flops: dict[int, int], *,
                  split: int, seed: int, sigma: float, profile: str | None, estimator: bool) -> tuple[SplitAssigner, dict]:
    """The assigner for ``strategy`` and what it decided up front (resource speeds) for the record."""
    extra: dict = {}
    resource = None
    if strategy == "resource":
        resource, speed = resource_splits(clients, train_flops, seed=seed, sigma=sigma, profile=profile)
        extra = {"speed_factors": speed, "resource_splits": resource}
    return SplitAssigner(strategy, num_splits, split=split, seed=seed, resource=resource, estimator=estimator), extra
