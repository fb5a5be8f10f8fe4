"""FedSGA's deadline-aware variant (--deadline-aware, docs/fleet.md "Deadline-aware splits"): each device's
predicted round seconds per split, sent in its round start so that it never picks a split predicted to miss
the round's deadline (fedsga_edge/method/policy.py ``deadline_split``). The prediction is the planner's
(coordinator/planning.py): at the device's fleet class until a round measured it, then at what its latest
round measured, warm-up and held-out evaluations included."""

from __future__ import annotations

from typing import Any

from fedsga_edge.config import RunConfig

from ..planning import FleetRates, SplitLoad, predicted_split_s, split_loads

__all__ = ["Deadlines", "predict_device", "weight_bytes"]


class Deadlines:
    """Each device's rates (its fleet class, then what it measured), and the predictions it is sent: its own
    round seconds per split, a device's first round with its class's warm-up too (a resumed coordinator starts
    the warm-up afresh)."""

    def __init__(self, cfg: RunConfig, clients: list[str]) -> None:
        if not cfg.fleet or cfg.round_timeout <= 0:
            raise ValueError("--deadline-aware needs --fleet FILE (each device's speed and link) and "
                             "--round-timeout SECONDS (the deadline it keeps to)")
        from fedsga_edge.fleet import load_fleet  # torch-free

        self.cfg = cfg
        self.classes: dict[str, Any] = load_fleet(cfg.fleet).assign(list(clients))
        self.rates = FleetRates(self.classes)
        self.predicted: dict[str, list[float]] = {}  # this round's predicted seconds per split, per device
        self._told: set[str] = set()  # devices sent a prediction before, so past their first round's warm-up
        self._weight_bytes: dict[int, float] | None = None  # the weights up to each split, bytes

    def keep(self, record: dict[str, Any], t: int) -> None:
        """Round ``t``'s record (its ``timing`` is read at the next round start)."""
        self.rates.keep(record, t)

    def fields(self, strategy: Any, cid: str, calibrate: bool) -> dict[str, Any]:
        """Device ``cid``'s round-start ``deadline``: the round's seconds and its predicted seconds per split
        (none for a device outside the fleet file)."""
        cls = self.classes.get(cid)
        if cls is None:
            return {}
        rate = self.rates.latest(cid, lambda t, c, k: self.load(strategy, t, c, k))
        split_s = self.predict(strategy, rate, cid, calibrate)
        if cid not in self._told:  # its first round: a fresh process's one-time work (the class's warmup_s) too
            split_s = [s + float(cls.warmup_s) for s in split_s]
            self._told.add(cid)
        self.predicted[cid] = split_s
        return {"deadline": {"s": float(self.cfg.round_timeout), "split_s": split_s}}

    def predict(self, strategy: Any, cls: Any, cid: str, calibrate: bool) -> list[float]:
        return predict_device(strategy, cls, cid, calibrate, self._weights(strategy))

    def load(self, strategy: Any, t: int, cid: str, split: int) -> SplitLoad | None:
        """What ``cid``'s round ``t`` carried at ``split`` (its probe, its evaluation): to read its timing."""
        co = strategy.co
        if cid not in co.clients:
            return None
        held = co.fed_eval.expected.get(cid, 0) if co.fed_eval.evaluates(t) else 0
        holdout = self.cfg.fedsga.probe_holdout if self.cfg.fedsga.estimator else None
        return split_loads(co.costs, co.clients[cid], self.cfg, calibrate=strategy.calibrates(t), probe_holdout=holdout,
                           h1_dim=strategy._h1_dim, weight_bytes=self._weights(strategy), eval_samples=held).get(split)

    def _weights(self, strategy: Any) -> dict[int, float]:
        if self._weight_bytes is None:
            self._weight_bytes = weight_bytes(strategy.co.model, strategy.K)
        return self._weight_bytes


def weight_bytes(model: Any, num_splits: int) -> dict[int, float]:
    """The bytes of the weights (buffers included) a device at each split k = 1..K holds."""
    state = model.state_dict()
    return {k: float(sum(v.numel() * v.element_size() for n, v in state.items()
                         if model.unit_of(n) < model.depth_of(k))) for k in range(1, num_splits + 1)}


def predict_device(strategy: Any, cls: Any, cid: str, calibrate: bool,
                   weights: dict[int, float] | None = None) -> list[float]:
    """``predicted_split_s`` for FedSGA's device ``cid`` at the rates ``cls`` (its fleet class or its measured
    rates) with this model's real weight bytes (``weight_bytes``), the round start's method state (estimator,
    phi_s, prototypes) and, in an evaluation round, its held-out forward."""
    co = strategy.co
    extra = sum(v.numel() * v.element_size() for module in (strategy.phi_s, strategy.prototypes)
                for v in module.state_dict().values())
    extra += sum(v.numel() * v.element_size() for v in strategy.estimator.state_dict().values() if hasattr(v, "numel"))
    held = co.fed_eval.expected.get(cid, 0) if co.fed_eval.active else 0
    return predicted_split_s(cls, co.costs, co.clients[cid], strategy.cfg, calibrate, h1_dim=strategy._h1_dim,
                             weight_bytes=weights or weight_bytes(co.model, strategy.K), extra_down=float(extra),
                             eval_samples=held)
