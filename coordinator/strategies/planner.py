"""The planner (beyond the paper): each device's split chosen, before every round, for the round's makespan.

With a server copy per device the split is meant to be a cost choice (with one split for every device the run is
SplitFed's at it, loss for loss: tests/test_planner.py): its compute at its speed, its activations over its link,
its memory. Before each round the planner
predicts every device's round at every split (coordinator/planning.py: the cost table's FLOPs and bytes over the
device's rates) and gives each device its fastest split that fits its memory budget: the round ends when its
slowest device does, and no device is held back by another's choice, so each device at its own fastest split
minimises the makespan. Rates: the device's fleet class to start with (``--fleet``), its hello's latency profile
for its compute where it reported one (``device --latency-profile``), then what its latest round measured (the
round's ``timing``); a device with none of these trains at ``--split`` until measured. docs/fleet.md, "Planning
splits".
"""

from __future__ import annotations

from typing import Any

from fedsga_edge.config import RunConfig

from ..strategy import Strategy, register_strategy

__all__ = ["Planner"]


@register_strategy
class Planner(Strategy):
    name = "planner"
    help = ("beyond the paper: each device's fastest split, re-planned every round from its measured compute speed "
            "and link rate (its fleet class or profile to start; docs/fleet.md)")
    label = "Planner (beyond the paper)"
    adaptive = True

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        from ..planning import FleetRates

        super().__init__(cfg, num_splits, clients, train_flops)
        classes = {}
        if cfg.fleet:  # torch-free: fedsga_edge/fleet.py
            from fedsga_edge.fleet import load_fleet

            classes = load_fleet(cfg.fleet).assign(list(clients))
        self.rates = FleetRates(classes)
        self.sample_s: dict[str, dict[int, float]] = {}  # device -> its hello profile's seconds per sample by split
        self.fits: dict[str, set[int]] = {}  # device -> the splits its memory budget fits (all when absent)
        self.co: Any = None
        self._plan: dict[str, dict[str, Any]] = {}

    def attach(self, coordinator: Any) -> None:
        self.co = coordinator  # its cost table and the devices' sample counts

    def device_registered(self, cid: str, hello: dict[str, Any]) -> None:
        """A device's (checked) hello: its profile's seconds per sample start its compute prediction, its memory
        budget rules out the splits whose measured peak does not fit (fedsga_edge/latency.py ``fitting_splits``)."""
        from fedsga_edge.latency import fitting_splits, reported_latency

        profile = hello.get("profile")
        if profile is None:
            self.sample_s.pop(cid, None)
            self.fits.pop(cid, None)
            return
        self.sample_s[cid] = reported_latency(profile)
        fits = fitting_splits(profile)
        if fits is not None:
            self.fits[cid] = fits

    # -- the plan -------------------------------------------------------------------------------------
    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        self._plan = {c: self._choose(t, c) for c in clients}
        return {c: p["split"] for c, p in self._plan.items()}

    def predicted(self, t: int, cid: str) -> dict[int, float] | None:
        """``cid``'s predicted round ``t`` seconds at each split it may train at; None: nothing known of it yet."""
        if self.co is None or cid not in self.co.clients:
            return None
        loads = self._load(t, cid, None)
        rate = self.rates.latest(cid, self._load)  # what the last round measured, once its record has its timing
        own = self.sample_s.get(cid) if cid not in self.rates.measured else None
        if rate is None and own is None:
            return None
        from ..server import samples_per_epoch

        tc = self.cfg.train  # the samples it trains, for its profile's seconds per sample
        seen = tc.local_epochs * samples_per_epoch(self.co.clients[cid], tc.batch_size, tc.max_batches, tc.batching)
        out = {}
        for k, x in loads.items():
            if k not in self.fits.get(cid, loads.keys()):
                continue
            compute_only = (x.flops, 0.0, 0.0, 0.0)
            link = rate.round_s(0.0, x.up, x.down, x.trips) if rate is not None else 0.0
            compute = own[k] * seen if own is not None else rate.round_s(*compute_only)
            out[k] = compute + link
        return out

    def _choose(self, t: int, cid: str) -> dict[str, Any]:
        seconds = self.predicted(t, cid)
        if not seconds:  # unknown (or nothing fits: the smallest peak is the device's own problem to report)
            return {"split": self._fallback(cid), "predicted_s": None}
        k = min(seconds, key=lambda s: (seconds[s], -s))  # the fastest; on a tie the deeper (fewer bytes)
        return {"split": k, "predicted_s": {str(s): round(v, 6) for s, v in seconds.items()}}

    def _fallback(self, cid: str) -> int:
        fits = self.fits.get(cid)
        split = min(max(int(self.cfg.split), 1), self.K)
        if not fits or split in fits:
            return split
        return max((k for k in fits if k < split), default=min(fits))  # the nearest shallower that fits

    def _load(self, t: int, cid: str, split: int | None) -> Any:
        """What ``cid``'s round ``t`` carries at ``split`` (its evaluation included); every split's for None."""
        from ..planning import split_loads

        if cid not in self.co.clients:
            return None
        held = self.co.fed_eval.expected.get(cid, 0) if self.co.fed_eval.evaluates(t) else 0
        loads = split_loads(self.co.costs, int(self.co.clients[cid]), self.cfg, eval_samples=held)
        return loads if split is None else loads.get(split)

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        """The round's record keeps the plan (``plan``: each device's split and predicted seconds per split);
        the record is kept until the next ``assign``, by when the driver has added the round's ``timing``."""
        record["plan"] = {c: dict(p) for c, p in self._plan.items()}
        self.rates.keep(record, self.co.round.t)
