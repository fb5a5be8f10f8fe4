"""Strategies: one registered object per method, owning everything that differs between methods.

A strategy decides who runs how deep each round (``assign``), what the devices are told to do
locally (``device_train``: FedProx's proximal weight) and how much each device's update counts in
aggregation (``weight``). Adding a baseline is one new class with ``@register_strategy`` (in this
file or any module imported before the run is built); nothing else in the coordinator changes.
Flower's Strategy objects have the same shape. See docs/method.md for the method itself.

``assign`` returns device id -> split index k (1..K), 0 for "the whole model on the device"
(FedAvg, FedProx), or None for "the device chooses" (FedSGA's estimator).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from fedsga_edge.config import RunConfig, TrainConfig
from fedsga_edge.method import reference_index

__all__ = ["Strategy", "register_strategy", "create_strategy", "list_strategies", "resource_splits"]

_REGISTRY: dict[str, type["Strategy"]] = {}


def register_strategy(cls: type["Strategy"]) -> type["Strategy"]:
    if cls.name in _REGISTRY:
        raise ValueError(f"strategy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def list_strategies() -> list[str]:
    return sorted(_REGISTRY)


class Strategy:
    """Base: every device at one split, plain local SGD, updates weighted by |D_i|."""

    name: ClassVar[str] = ""
    help: ClassVar[str] = ""
    adaptive: ClassVar[bool] = False  # splits can differ between devices and rounds

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        self.cfg = cfg
        self.K = num_splits
        self.clients = list(clients)

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        raise NotImplementedError

    def device_train(self, train: TrainConfig) -> TrainConfig:
        """The local training settings sent in every round start."""
        return dataclasses.replace(train, mu=0.0)

    def weight(self, num_samples: int) -> float:
        """A device's weight in aggregation (and its data's weight in the server copy's)."""
        return float(num_samples)

    def info(self) -> dict[str, Any]:
        """What the strategy decided up front, for config.json."""
        return {}


@register_strategy
class Static(Strategy):
    name = "static"
    help = "SplitFed: every device at --split"

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: self.cfg.split for c in clients}


@register_strategy
class FedAvg(Strategy):
    name = "fedavg"
    help = "the whole model on every device, weights averaged"

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: 0 for c in clients}


@register_strategy
class FedProx(FedAvg):
    name = "fedprox"
    help = "FedAvg with a proximal term (--mu)"

    def device_train(self, train: TrainConfig) -> TrainConfig:
        return dataclasses.replace(train, mu=self.cfg.prox_mu)


@register_strategy
class RandomSplit(Strategy):
    name = "random"
    help = "a uniformly random split per device and round (seeded)"
    adaptive = True

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        super().__init__(cfg, num_splits, clients, train_flops)
        self.rng = np.random.default_rng([cfg.seed, 7])

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: int(self.rng.integers(1, self.K + 1)) for c in clients}


@register_strategy
class Resource(Strategy):
    name = "resource"
    help = "MultiSFL-style: the deepest split each device's speed allows (--speed-sigma or --profile)"
    adaptive = True

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        super().__init__(cfg, num_splits, clients, train_flops)
        self.splits, self.speed = resource_splits(clients, train_flops, seed=cfg.seed, sigma=cfg.speed_sigma,
                                                  profile=cfg.profile)

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: self.splits[c] for c in clients}

    def info(self) -> dict[str, Any]:
        return {"speed_factors": self.speed, "resource_splits": self.splits}


@register_strategy
class FedSGA(Strategy):
    name = "fedsga"
    help = "each device picks its split with the sufficiency estimator (docs/method.md)"
    adaptive = True

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        if not self.cfg.fedsga.estimator:  # ablation: everyone at p_ref
            return {c: reference_index(self.K) for c in clients}
        return {c: None for c in clients}


def create_strategy(cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> Strategy:
    if cfg.strategy not in _REGISTRY:
        raise ValueError(f"unknown strategy {cfg.strategy!r}; choose one of {', '.join(list_strategies())}")
    return _REGISTRY[cfg.strategy](cfg, num_splits, clients, train_flops)


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

