"""Anomaly scores per device over rounds, and quarantine: influence a device cannot build up round after round.

The bounds of coordinator/influence.py cut what one message can do; a device that stays just inside
them (activations at 2.9x the fleet's, an update sign-flipped at 4.9x its own change) still steers
the run if it does so every round. Each round every device gets two scores against the rest of the
fleet, as log2 ratios (0: like the others; 1: twice theirs; -10: a thousandth):

* ``act``: its median activation norm at its split (the norms ``ActivationBound`` keeps, as sent)
  over the upper median of the other devices' at that split;
* ``update``: per aggregation unit, its change from the round's global weights over the upper median
  change of the other devices that trained the unit; the median over its units.

Both need two other devices to compare with (in a fleet of two nothing says which one is odd). With
``--quarantine S`` a device whose score is beyond S (in either direction) for ``--quarantine-rounds``
rounds in a row is quarantined for the rest of the run: its updates leave aggregation and its
activations are refused, with the reason in the round's record (``quarantined``) and in the log.
An honest device has its own history to fall back on: one odd round resets nothing, but its streak
needs consecutive rounds.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fedsga_edge.wire import RemoteProtocolError

from .influence import ActivationBound, upper_median

__all__ = ["AnomalyScores"]


def _log_ratio(value: float, others: list[float]) -> float | None:
    """log2 of ``value`` over the upper median of ``others`` (None: fewer than two others, or nothing to scale by)."""
    if len(others) < 2:
        return None
    ref = upper_median(others)
    if ref <= 0 or value <= 0:
        return None if ref <= 0 and value <= 0 else (-60.0 if value <= 0 else 60.0)
    return math.log2(value / ref)


class AnomalyScores:
    """Per device: the latest scores, the streak of rounds beyond the threshold, quarantine and its reason."""

    def __init__(self, threshold: float, rounds: int) -> None:
        self.threshold, self.rounds = float(threshold), int(rounds)
        self.streak: dict[str, int] = {}
        self.quarantined: dict[str, str] = {}  # device -> why (for good)
        self.record: dict[str, Any] = {}  # the latest round's fields of metrics.jsonl

    def check(self, device: str) -> None:
        """Refuse a quarantined device's request (RemoteProtocolError naming why)."""
        if device in self.quarantined:
            raise RemoteProtocolError(f"quarantined: {self.quarantined[device]}")

    def score(self, t: int, bounds: ActivationBound, updates: dict[str, dict[str, Any]],
              global_units: dict[int, dict[str, Tensor]], states: dict[str, dict[int, dict[str, Tensor]]]
              ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[int, dict[str, Tensor]]]]:
        """Round t's scores from its accepted updates (each one's ``split``) and their states by unit;
        the updates and states of the devices not quarantined (one quarantined now is out already)."""
        # whole-model updates (no split, or 0) have no activations to score
        splits = {d: int(u["split"]) for d, u in updates.items() if (u.get("split") or 0) > 0}
        scores = self.observe(t, self.activation_scores(bounds, splits), self.update_scores(global_units, states))
        self.record = {k: v for k, v in (("anomaly", scores), ("quarantined", dict(self.quarantined))) if v}
        kept = [d for d in updates if d not in self.quarantined]
        return {d: updates[d] for d in kept}, {d: states[d] for d in kept}

    def activation_scores(self, bounds: ActivationBound, splits: dict[str, int]) -> dict[str, float]:
        """Each device's activation score at the split it trained (``splits``: device -> split)."""
        out: dict[str, float] = {}
        for d, k in splits.items():
            mine = bounds.median(k, d)
            others = [m for o in splits if o != d and splits[o] == k and (m := bounds.median(k, o)) is not None]
            if mine is not None and (score := _log_ratio(mine, others)) is not None:
                out[d] = score
        return out

    @staticmethod
    @torch.no_grad()
    def update_scores(global_units: dict[int, dict[str, Tensor]], states: dict[str, dict[int, dict[str, Tensor]]]
                      ) -> dict[str, float]:
        """Each device's update score: the median over its units of its change against the others'."""
        norms: dict[int, dict[str, float]] = {}
        for d, units in states.items():
            for u, st in units.items():
                ref = global_units.get(u)
                if ref is None or set(st) != set(ref):
                    continue
                sq = sum(float(((v.double() - ref[n].double()) ** 2).sum()) for n, v in st.items()
                         if v.is_floating_point())
                norms.setdefault(u, {})[d] = math.sqrt(sq)
        per_device: dict[str, list[float]] = {}
        for by_device in norms.values():
            for d, v in by_device.items():
                score = _log_ratio(v, [o for e, o in by_device.items() if e != d])
                if score is not None:
                    per_device.setdefault(d, []).append(score)
        return {d: sorted(v)[len(v) // 2] for d, v in per_device.items()}

    def observe(self, t: int, act: dict[str, float], update: dict[str, float]) -> dict[str, Any]:
        """One round's scores: the record's ``anomaly`` field, and quarantine for a streak over the threshold."""
        devices = sorted(set(act) | set(update))
        record: dict[str, Any] = {d: {k: round(v[d], 4) for k, v in (("act", act), ("update", update)) if d in v}
                                  for d in devices}
        if not self.threshold:
            return record
        for d in devices:
            worst = max(abs(v[d]) for v in (act, update) if d in v)
            self.streak[d] = self.streak.get(d, 0) + 1 if worst > self.threshold else 0
            if self.streak[d] >= self.rounds and d not in self.quarantined:
                what = ", ".join(f"{k} {v[d]:+.2f}" for k, v in (("activations", act), ("update", update)) if d in v)
                self.quarantined[d] = (f"round {t}: log2 ratio to the fleet ({what}) beyond {self.threshold:g} "
                                       f"for {self.streak[d]} rounds in a row")
        return record

    def state_dict(self) -> dict[str, Any]:
        return {"streak": dict(self.streak), "quarantined": dict(self.quarantined)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = dict(state.get("streak", {}))
        self.quarantined = dict(state.get("quarantined", {}))
