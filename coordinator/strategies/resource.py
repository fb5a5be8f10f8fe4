"""MultiSFL-style resource-driven split: the deepest split each device's speed allows.

This borrows only MultiSFL's split assignment (not its branches or replay); the speeds are drawn
(--speed-sigma), or with --fleet each device's class speed over the fleet's median device (docs/fleet.md);
latency per split is FLOPs over speed, or a measured latency profile (--profile) over speed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from fedsga_edge.config import RunConfig
from fedsga_edge.method.policy import reference_index

from ..strategy import Strategy, register_strategy

__all__ = ["Resource", "resource_splits"]


@register_strategy
class Resource(Strategy):
    name = "resource"
    help = "MultiSFL-style: the deepest split each device's speed allows (--speed-sigma or --fleet; --profile)"
    label = "Resource-driven (MultiSFL-style)"
    adaptive = True

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        super().__init__(cfg, num_splits, clients, train_flops)
        speed = None
        if cfg.fleet:  # the devices' real classes, not a draw (torch-free: fedsga_edge/fleet.py)
            from fedsga_edge.fleet import load_fleet

            speed = load_fleet(cfg.fleet).speed_factors(list(clients))
        self.splits, self.speed = resource_splits(clients, train_flops, seed=cfg.seed, sigma=cfg.speed_sigma,
                                                  profile=cfg.profile, speed=speed)

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: self.splits[c] for c in clients}

    def info(self) -> dict[str, Any]:
        return {"speed_factors": self.speed, "resource_splits": self.splits}



def resource_splits(
    clients: list[str], train_flops: dict[int, int], *, seed: int = 0, sigma: float = 0.5,
    profile: str | Path | None = None, speed: dict[str, float] | None = None,
) -> tuple[dict[str, int], dict[str, float]]:
    """MultiSFL-style baseline: each client gets the deepest split whose per-sample latency fits.

    Client speeds are log-normal factors (seeded, median 1, spread ``sigma``); the budget is the
    per-sample latency of the reference split on a median device, so a median device sits at
    p_ref, faster ones go deeper and slower ones shallower. With a measured ``profile`` (the JSON
    of ``fedsga-edge profile``), latency per split comes from it instead of FLOPs (device speed
    factors still apply). ``speed`` (a fleet's factors, median 1) replaces the draw. Approximation:
    latency is taken as proportional to FLOPs / speed.
    """
    K = len([k for k in train_flops if k > 0])
    cost = {k: float(train_flops[k]) for k in range(1, K + 1)}
    if profile is not None:
        cost = _profile_latency(profile, K)
    if speed is None:
        rng = np.random.default_rng([seed, 11])
        speed = {c: float(math.exp(sigma * rng.standard_normal())) for c in clients}
    else:
        speed = {c: float(speed[c]) for c in clients}
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

