"""MultiSFL-style resource-driven split: the deepest split each device's speed allows.

This borrows only MultiSFL's split assignment (not its branches or replay). Where each device's speed
comes from, first that applies (docs/method.md, "Strategies"): the latency profile the device reported in
its hello (a field run: ``device --latency-profile``), its fleet class over the fleet's median device
(--fleet, docs/fleet.md), a seeded log-normal draw (--speed-sigma). Latency per split is FLOPs over speed,
or a measured latency profile (--profile, the median device's) over speed; a device that reported its own
profile is compared by its own seconds.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from fedsga_edge.config import RunConfig
from fedsga_edge.latency import profile_latency, reported_latency
from fedsga_edge.method.policy import reference_index

from ..strategy import Strategy, register_strategy

__all__ = ["Resource", "deepest_fit", "resource_splits"]


@register_strategy
class Resource(Strategy):
    name = "resource"
    help = ("MultiSFL-style: the deepest split each device's speed allows (its hello's profile, else --fleet, "
            "else --speed-sigma; --profile)")
    label = "Resource-driven (MultiSFL-style)"
    adaptive = True
    owns_options = ("speed_sigma", "profile")

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        super().__init__(cfg, num_splits, clients, train_flops)
        speed = None
        if cfg.fleet:  # the devices' real classes, not a draw (torch-free: fedsga_edge/fleet.py)
            from fedsga_edge.fleet import load_fleet

            speed = load_fleet(cfg.fleet).speed_factors(list(clients))
        self.splits, self.speed = resource_splits(clients, train_flops, seed=cfg.seed, sigma=cfg.speed_sigma,
                                                  profile=cfg.profile, speed=speed)
        self.source = {c: "fleet" if cfg.fleet else "draw" for c in clients}
        self._base = (dict(self.splits), dict(self.speed), dict(self.source))  # a device that stops reporting
        self.ref = reference_index(self.K)
        # a reported profile's budget: the median device's seconds at p_ref, measured (--profile), else
        # the median of what the devices reported (so it moves as reporting devices register)
        self.budget_s = profile_latency(cfg.profile, self.K)[self.ref] if cfg.profile else None
        self.reported: dict[str, dict[int, float]] = {}  # device -> seconds per sample by split (its hello's)

    def device_registered(self, cid: str, hello: dict[str, Any]) -> None:
        """Keep the latency a device's (checked) hello reported; one without a profile goes back to the
        fleet's or the drawn speed. Applied at the next round start (``assign``)."""
        if cid not in self.splits:
            return
        if hello.get("profile") is not None:
            self.reported[cid] = reported_latency(hello["profile"])
        else:
            self._forget(cid)

    def device_left(self, cid: str) -> None:
        """A device that said ``bye`` no longer sets the reporters' median (the budget without --profile)."""
        self._forget(cid)

    def _forget(self, cid: str) -> None:
        """Back to the fleet's or the drawn speed for ``cid``; out of the reporters' median."""
        if self.reported.pop(cid, None) is not None:
            for mine, base in zip((self.splits, self.speed, self.source), self._base):
                mine[cid] = base[cid]

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        if self.reported:
            budget = self.budget_s if self.budget_s is not None else \
                statistics.median(lat[self.ref] for lat in self.reported.values())
            for c, lat in self.reported.items():  # the same rule as resource_splits, on the device's own seconds
                self.splits[c] = deepest_fit(lat, budget)
                self.speed[c], self.source[c] = budget / lat[self.ref], "reported"
        return {c: self.splits[c] for c in clients}

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        """Once a device reported its profile, where each device's speed came from (reported, fleet, draw)
        and the speed, in metrics.jsonl; before, config.json's ``speed_source`` says it for the whole run."""
        if self.reported:
            record["speed_source"] = {c: self.source[c] for c in updates}
            record["speed_factors"] = {c: self.speed[c] for c in updates}

    def info(self) -> dict[str, Any]:
        return {"speed_factors": self.speed, "resource_splits": self.splits, "speed_source": self.source}


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
        cost = profile_latency(profile, K)
    if speed is None:
        rng = np.random.default_rng([seed, 11])
        speed = {c: float(math.exp(sigma * rng.standard_normal())) for c in clients}
    else:
        speed = {c: float(speed[c]) for c in clients}
    budget = cost[reference_index(K)]
    out = {c: deepest_fit({k: v / speed[c] for k, v in cost.items()}, budget) for c in clients}
    return out, speed


def deepest_fit(latency: dict[int, float], budget: float) -> int:
    """The deepest split whose latency fits the budget; 1 when none does (the shallowest is the least a device does)."""
    fits = [k for k, v in latency.items() if v <= budget * (1 + 1e-9)]
    return max(fits) if fits else 1
