"""Anomaly scores per device over rounds, and quarantine: influence a device cannot build up round after round.

The bounds of coordinator/influence.py cut what one message can do; a device that stays just inside
them (activations at 2.9x the fleet's, an update sign-flipped at 4.9x its own change) still steers
the run if it does so every round. Each round every device gets two scores against the rest of the
fleet, as log2 ratios (0: like the others; 1: twice theirs; -10: a thousandth):

* ``act``: its median activation norm at its split (the norms ``ActivationBound`` keeps, as sent)
  over the upper median of the other devices' at that split;
* ``update``: per aggregation unit, its change from the round's global weights over the upper median
  change of the other devices that trained the unit; the median over its units.

* ``loss``: the server's loss on its first activation batch of the round (the round's model, before
  any of its steps; ``LOSS_FLOOR`` nats added) over the upper median of the other devices'. Labels
  flipped at normal scale look honest by every norm, but the server's model keeps disagreeing with
  them while the honest devices' losses fall; only a higher loss counts (a device the model fits
  better than the rest harms no one).

All three need two other devices to compare with (in a fleet of two nothing says which one is odd),
and act only with three (``ACT_WITH``: of two others one may be the attacker, and the upper median
is then its value). With ``--quarantine S`` the scores act, within the round and over rounds:

* an activation batch whose median norm is beyond S against the other devices' medians is refused
  before it steps the server (``check_batch``), so a shared server copy never takes it;
* a device whose round scores beyond S (``act``, ``update`` either way, ``loss`` upwards) is left out
  of that very round's aggregation, its per-client server copy too (``held_out`` in the record);
* a device beyond S for ``--quarantine-rounds`` rounds in a row (a refused batch counts) is quarantined
  for the rest of the run: its updates leave aggregation and its activations are refused, with the
  reason in the round's record (``quarantined``) and in the log.

An honest device that has one odd round loses that round's contribution only.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from fedsga_edge.wire import RemoteProtocolError

from .influence import ActivationBound, upper_median

__all__ = ["AnomalyScores", "LOSS_FLOOR"]

ACT_WITH = 3  # other devices a score must be measured against before it may leave a device out
LOSS_FLOOR = 0.1  # nats added to every loss before the ratio: near-zero losses differ a lot, but mean nothing


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
        self.losses: dict[str, float] = {}  # device -> the server's loss on its first batch this round
        self.refused: dict[str, str] = {}  # device -> why a batch of its was refused this round

    def begin_round(self) -> None:
        self.losses, self.refused = {}, {}

    def check(self, device: str) -> None:
        """Refuse a quarantined device's request (RemoteProtocolError naming why)."""
        if device in self.quarantined:
            raise RemoteProtocolError(f"quarantined: {self.quarantined[device]}")

    def check_batch(self, bounds: ActivationBound, k: int, device: str, norms: Tensor | None) -> None:
        """With a threshold: refuse (RemoteProtocolError) a batch whose median norm (as sent) is beyond it
        against the other devices' medians at split k, before it steps the server. Its norms are still
        remembered, so the device's round score says the same."""
        if not self.threshold or norms is None or not len(norms):
            return
        others = [m for d in bounds.devices(k) if d != device and (m := bounds.median(k, d)) is not None]
        score = _log_ratio(float(norms.median()), others) if len(others) >= ACT_WITH else None
        if score is not None and abs(score) > self.threshold:
            bounds.accept(device, k, norms)
            self.refused[device] = f"activations {score:+.2f} in a refused batch"
            raise RemoteProtocolError(f"activation norms at log2 {score:+.2f} of the other devices' (beyond "
                                      f"{self.threshold:g}): refused as anomalous")

    def step_loss(self, device: str, loss: float) -> None:
        """The server's loss on one of ``device``'s batches; the round's first is its ``loss`` score's."""
        self.losses.setdefault(device, float(loss))

    def score(self, t: int, bounds: ActivationBound, updates: dict[str, dict[str, Any]],
              global_units: dict[int, dict[str, Tensor]], states: dict[str, dict[int, dict[str, Tensor]]]
              ) -> tuple[dict[str, dict[str, Any]], dict[str, dict[int, dict[str, Tensor]]]]:
        """Round t's scores from its accepted updates (each one's ``split``) and their states by unit;
        the updates and states that enter this round's aggregation (none of a device quarantined, or
        scored beyond the threshold this round)."""
        # whole-model updates (no split, or 0) have no activations to score
        splits = {d: int(u["split"]) for d, u in updates.items() if (u.get("split") or 0) > 0}
        loss = self.loss_scores([d for d in updates if d in self.losses])
        scores, held = self.observe(t, self.activation_scores(bounds, splits),
                                    self.update_scores(global_units, states), loss)
        self.record = {k: v for k, v in (("anomaly", scores), ("held_out", held),
                                         ("quarantined", dict(self.quarantined))) if v}
        kept = [d for d in updates if d not in self.quarantined and d not in held]
        return {d: updates[d] for d in kept}, {d: states[d] for d in kept}

    def loss_scores(self, devices: list[str]) -> dict[str, float]:
        """Each device's first-batch loss against the other devices' (log2 ratio, ``LOSS_FLOOR`` added)."""
        out: dict[str, float] = {}
        for d in devices:
            others = [self.losses[o] + LOSS_FLOOR for o in devices if o != d]
            if (score := _log_ratio(self.losses[d] + LOSS_FLOOR, others)) is not None:
                out[d] = score
        return out

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

    def observe(self, t: int, act: dict[str, float], update: dict[str, float], loss: dict[str, float] | None = None
                ) -> tuple[dict[str, Any], dict[str, str]]:
        """One round's scores: the record's ``anomaly`` field, and with a threshold the devices left out of
        this round (device -> why) and quarantine for a streak of such rounds."""
        kinds = (("act", act), ("update", update), ("loss", loss or {}))
        devices = sorted(set(act) | set(update) | set(loss or {}))
        record: dict[str, Any] = {d: {k: round(v[d], 4) for k, v in kinds if d in v} for d in devices}
        held: dict[str, str] = {}
        if not self.threshold:
            return record, held
        if len(devices) <= ACT_WITH:  # too few to tell who is odd: the scores are recorded, nothing more
            act, update, loss = {}, {}, {}
            kinds = (("act", act), ("update", update), ("loss", loss))
        names = {"act": "activations", "update": "update", "loss": "loss"}
        for d in sorted(set(devices) | set(self.refused)):
            beyond = [f"{names[k]} {v[d]:+.2f}" for k, v in kinds
                      if d in v and (v[d] if k == "loss" else abs(v[d])) > self.threshold]
            beyond += [self.refused[d]] if d in self.refused else []
            self.streak[d] = self.streak.get(d, 0) + 1 if beyond else 0
            if beyond:
                held[d] = f"round {t}: log2 ratio to the fleet ({', '.join(beyond)}) beyond {self.threshold:g}"
            if self.streak[d] >= self.rounds and d not in self.quarantined:
                self.quarantined[d] = f"{held[d]} for {self.streak[d]} rounds in a row"
        return record, held

    def state_dict(self) -> dict[str, Any]:
        return {"streak": dict(self.streak), "quarantined": dict(self.quarantined)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = dict(state.get("streak", {}))
        self.quarantined = dict(state.get("quarantined", {}))
