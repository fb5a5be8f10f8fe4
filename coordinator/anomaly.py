"""Anomaly scores per device over rounds, and quarantine: influence a device cannot build up round after round.

The bounds of coordinator/influence.py cut what one message can do; a device that stays just inside
them (activations at 2.9x the fleet's, an update sign-flipped at 4.9x its own change) still steers
the run if it does so every round. Each round every device gets scores against the rest of the
fleet, as log2 ratios (0: like the others; 1: twice theirs; -10: a thousandth) or a cosine:

* ``act``: its median activation norm at its split (the norms ``ActivationBound`` keeps, as sent)
  over the upper median of the other devices' at that split;
* ``update``: per aggregation unit, its change from the round's global weights over the upper median
  change of the other devices that trained the unit; the median over its units;
* ``direction``: per unit, the cosine between its change and the other devices' coordinate-wise median
  change (one attacker among them cannot turn it); the
  median over its units (a sign-flipped update points against the fleet whatever its norm);
* ``loss``: the server's loss on its first activation batch of the round (the round's model, before
  any of its steps; ``LOSS_FLOOR`` nats added) over the upper median of the other devices'. Labels
  flipped at normal scale look honest by every norm, but the server's model keeps disagreeing with
  them while the honest devices' losses fall; only a higher loss counts (a device the model fits
  better than the rest harms no one).

Each needs two other devices to compare with (in a fleet of two nothing says which one is odd), and
acts only with three (``ACT_WITH``: of two others one may be the attacker, and the upper median is
then its value). With ``--quarantine S`` the scores act, within the round and over rounds:

* an activation batch whose median norm is beyond S against the other devices' medians is refused
  before it steps the server (``check_batch``), so a shared server copy never takes it;
* a device whose round scores beyond S (``act`` either way, ``loss`` upwards) or whose ``direction``
  is under ``AGAINST`` is left out of that very round's aggregation, its per-client server copy too
  (``held_out`` in the record); the ``update`` norm is recorded only (honest devices' changes differ
  by up to 8x, round after round, under Dirichlet(0.1) labels);
* a device left out for ``--quarantine-rounds`` rounds in a row (a refused batch counts)
  is quarantined for the rest of the run: its updates leave aggregation and its activations are
  refused, with the reason in the round's record (``quarantined``) and in the log.

An honest device that has one odd round loses that round's contribution only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from fedsga_edge.wire import RemoteProtocolError

from .influence import ActivationBound, upper_median

__all__ = ["AnomalyScores", "ACT_WITH", "AGAINST", "LOSS_FLOOR"]

ACT_WITH = 3  # other devices a score must be measured against before it may leave a device out
LOSS_FLOOR = 0.3  # nats added to every loss before the ratio: near-zero losses differ a lot, but mean nothing
AGAINST = -0.2  # below this cosine with the others' coordinate-wise median change, an update points against them


def _log_ratio(value: float, others: list[float]) -> float | None:
    """log2 of ``value`` over the upper median of ``others`` (None: fewer than two others, or nothing to scale by)."""
    if len(others) < 2:
        return None
    ref = upper_median(others)
    if ref <= 0 or value <= 0:
        return None if ref <= 0 and value <= 0 else (-60.0 if value <= 0 else 60.0)
    return math.log2(value / ref)


def _leave_one_out_medians(rows: list[Tensor]) -> Callable[[int], Tensor]:
    """``i`` -> the coordinate-wise (lower) median of every row but row i (two rows or more), as ``torch.median``
    gives it, from one sort of all the rows: O(n P log n) for n rows of P coordinates, where a median per
    left-out row would be O(n^2 P) (a 1,000-device round would spend minutes here). Without row i, the others' median is the whole
    sorted column's entry m = (n - 2) // 2 where row i sorts above m, else entry m + 1."""
    stacked = torch.stack(rows)
    ordered, order = stacked.sort(dim=0)
    rank = torch.empty_like(order)
    rank.scatter_(0, order, torch.arange(len(rows)).unsqueeze(1).expand_as(order))
    m = (len(rows) - 2) // 2
    return lambda i: torch.where(rank[i] > m, ordered[m], ordered[m + 1])


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
        update, direction = self.update_scores(global_units, states)
        scores, held = self.observe(t, self.activation_scores(bounds, splits), update, loss, direction)
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
                      ) -> tuple[dict[str, float], dict[str, float]]:
        """Each device's update score (the median over its units of its change's norm against the others')
        and direction (the median over its units of the cosine between its change and the coordinate-wise
        median of the others' changes: a sign-flipped update points against the fleet, whatever its norm)."""
        deltas: dict[int, dict[str, Tensor]] = {}
        for d, units in states.items():
            for u, st in units.items():
                ref = global_units.get(u)
                if ref is None or set(st) != set(ref):
                    continue
                deltas.setdefault(u, {})[d] = torch.cat([(v.double() - ref[n].double()).reshape(-1)
                                                         for n, v in st.items() if v.is_floating_point()])
        per_device: dict[str, list[float]] = {}
        cosines: dict[str, list[float]] = {}
        for by_device in deltas.values():
            if len(by_device) < 3:  # a score needs two others (``_log_ratio``): nothing to sort for
                continue
            norms = {d: float(v.norm()) for d, v in by_device.items()}
            others_median = _leave_one_out_medians(list(by_device.values()))
            for i, (d, v) in enumerate(by_device.items()):
                score = _log_ratio(norms[d], [o for e, o in norms.items() if e != d])
                if score is None:
                    continue
                per_device.setdefault(d, []).append(score)
                cosines.setdefault(d, []).append(float(torch.nn.functional.cosine_similarity(v, others_median(i),
                                                                                             dim=0)))
        median = lambda v: sorted(v)[len(v) // 2]
        return ({d: median(v) for d, v in per_device.items()}, {d: median(v) for d, v in cosines.items()})

    def observe(self, t: int, act: dict[str, float], update: dict[str, float], loss: dict[str, float] | None = None,
                direction: dict[str, float] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
        """One round's scores: the record's ``anomaly`` field, and with a threshold the devices left out of
        this round (device -> why: activations either way, loss upwards, an update against the fleet) and
        quarantine for a streak of such rounds. The update's norm is recorded only: honest devices' differ
        by up to 8x round after round under Dirichlet(0.1) labels."""
        kinds = {"act": act, "update": update, "loss": loss or {}, "direction": direction or {}}
        devices = sorted(set().union(*kinds.values()))
        record: dict[str, Any] = {d: {k: round(v[d], 4) for k, v in kinds.items() if d in v} for d in devices}
        held: dict[str, str] = {}
        if not self.threshold:
            return record, held
        if len(devices) <= ACT_WITH:  # too few to tell who is odd: the scores are recorded, nothing more
            kinds = {k: {} for k in kinds}
        s = self.threshold
        for d in sorted(set(devices) | set(self.refused)):
            now = [f"{name} {v[d]:+.2f}" for name, v, off in (
                ("activations", kinds["act"], lambda x: abs(x) > s), ("loss", kinds["loss"], lambda x: x > s),
                ("direction", kinds["direction"], lambda x: x < AGAINST)) if d in v and off(v[d])]
            now += [self.refused[d]] if d in self.refused else []
            self.streak[d] = self.streak.get(d, 0) + 1 if now else 0
            if not now:
                continue
            held[d] = f"round {t}: scores against the fleet ({', '.join(now)}) beyond {s:g} (direction {AGAINST:g})"
            if self.streak[d] >= self.rounds and d not in self.quarantined:
                self.quarantined[d] = f"{held[d]} for {self.streak[d]} rounds in a row"
        return record, held

    def state_dict(self) -> dict[str, Any]:
        return {"streak": dict(self.streak), "quarantined": dict(self.quarantined)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak = dict(state.get("streak", {}))
        self.quarantined = dict(state.get("quarantined", {}))
