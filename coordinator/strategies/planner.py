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

Under ``--wire-format auto`` it picks each device's wire format with its split: the plan's makespan is the slowest
device's fastest (split, format), and every other device takes the most precise format (fp32 first) whose
fastest split still ends by then, so a compressed format goes only where the round waits on a link.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fedsga_edge.config import AUTO_WIRE, WIRE_FORMATS, RunConfig

from ..instructions import Instruction
from ..strategy import Method, Strategy, register_strategy

__all__ = ["Planner"]


@register_strategy
class Planner(Strategy):
    name = "planner"
    help = ("beyond the paper: each device's fastest split, re-planned every round from its measured compute speed "
            "and link rate (its fleet class or profile to start; docs/fleet.md)")
    label = "Planner (beyond the paper)"
    adaptive = True

    @classmethod
    def methods(cls) -> dict[str, Method]:
        return {"planner": Method(cls.label),
                "planner-auto": Method("Planner, wire format per device (beyond the paper)", group="extension",
                                       overrides={"wire_format": AUTO_WIRE}, default=False)}

    @classmethod
    def method_name(cls, cfg: RunConfig, num_splits: int) -> str:
        return "planner-auto" if cfg.wire_format == AUTO_WIRE else "planner"

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
        if self.cfg.wire_format != AUTO_WIRE:
            self._plan = {c: self._choose(t, c) for c in clients}
        else:
            self._plan = self._plan_formats(t, clients)
        return {c: p["split"] for c, p in self._plan.items()}

    def configure_round(self, t: int, devices: list[str]) -> dict[str, Instruction]:
        """The default instructions, each with its device's planned wire format under ``--wire-format auto``."""
        out = super().configure_round(t, devices)
        if self.cfg.wire_format != AUTO_WIRE:
            return out
        return {c: dataclasses.replace(i, wire_format=self._plan[c]["wire_format"]) for c, i in out.items()}

    def _plan_formats(self, t: int, clients: list[str]) -> dict[str, dict[str, Any]]:
        """Each device's (split, format): the makespan is the slowest device's fastest pair; every device then
        takes the most precise format whose fastest split ends by the makespan (fp32 for one known nothing of)."""
        options = {c: {f: self._choose(t, c, f) for f in WIRE_FORMATS} for c in clients}
        best = [min(p["best_s"] for p in o.values() if p["best_s"] is not None)
                for o in options.values() if any(p["best_s"] is not None for p in o.values())]
        makespan = max(best, default=0.0) * (1 + 1e-9)
        plan = {}
        for c, o in options.items():
            fmt = next((f for f in WIRE_FORMATS if o[f]["best_s"] is not None and o[f]["best_s"] <= makespan),
                       WIRE_FORMATS[0])
            plan[c] = {**o[fmt], "wire_format": fmt}
            plan[c].pop("best_s")
        return plan

    def predicted(self, t: int, cid: str, wire_format: str | None = None) -> dict[int, float] | None:
        """``cid``'s predicted round ``t`` seconds at each split it may train at, its activations and gradients
        in ``wire_format`` (default the run's); None: nothing known of it yet."""
        if self.co is None or cid not in self.co.clients:
            return None
        loads = self._load(t, cid, None, wire_format)
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

    def _choose(self, t: int, cid: str, wire_format: str | None = None) -> dict[str, Any]:
        seconds = self.predicted(t, cid, wire_format)
        if not seconds:  # unknown (or nothing fits: the smallest peak is the device's own problem to report)
            return {"split": self._fallback(cid), "predicted_s": None} | ({"best_s": None} if wire_format else {})
        k = min(seconds, key=lambda s: (seconds[s], -s))  # the fastest; on a tie the deeper (fewer bytes)
        plan = {"split": k, "predicted_s": {str(s): round(v, 6) for s, v in seconds.items()}}
        return plan | ({"best_s": seconds[k]} if wire_format else {})

    def _fallback(self, cid: str) -> int:
        fits = self.fits.get(cid)
        split = min(max(int(self.cfg.split), 1), self.K)
        if not fits or split in fits:
            return split
        return max((k for k in fits if k < split), default=min(fits))  # the nearest shallower that fits

    def _load(self, t: int, cid: str, split: int | None, wire_format: str | None = None) -> Any:
        """What ``cid``'s round ``t`` carries at ``split`` (its evaluation included) in ``wire_format`` (default:
        the run's; under auto fp32, which changes none of the FLOPs a measurement is read with); every split's
        for None."""
        from ..planning import split_loads

        if cid not in self.co.clients:
            return None
        held = self.co.fed_eval.expected.get(cid, 0) if self.co.fed_eval.evaluates(t) else 0
        fmt = wire_format or (WIRE_FORMATS[0] if self.cfg.wire_format == AUTO_WIRE else None)
        loads = split_loads(self.co.costs, int(self.co.clients[cid]), self.cfg, eval_samples=held, wire_format=fmt)
        return loads if split is None else loads.get(split)

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        """The round's record keeps the plan (``plan``: each device's split, predicted seconds per split and, under
        ``--wire-format auto``, its ``wire_format``);
        the record is kept until the next ``assign``, by when the driver has added the round's ``timing``."""
        record["plan"] = {c: dict(p) for c, p in self._plan.items()}
        self.rates.keep(record, self.co.round.t)
