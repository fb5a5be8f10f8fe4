"""Bounded influence per device: what one device's finite values can do to the shared model.

Values that are finite and under ``MAX_ABS_VALUE`` can still wreck a run: one accepted activation
at ~9x the honest maximum took a digits run from 0.81 to 0.16. The bounds here come from what the
fleet itself has been sending, so they need no tuning per backbone:

* **Activations** (``ActivationBound``): per split, each device's recent per-sample L2 norms, as
  sent (before clipping); a device's bound is ``factor`` x the upper median over the *other*
  devices of each one's median norm. A sample above it is scaled down onto it (its direction kept)
  and counted.
* **Updates** (``clip_updates``): per aggregation unit, each device's change from the round's
  global weights is scaled down to ``factor`` x the upper median change of the *other* devices.

Leave-one-out: a device's own values never enter its own bound, so a device cannot raise its bound
by sending more, round after round. The upper median over the others means one device sending
tiny values (x 1e-3) cannot drag an honest device's bound down either: with two others it is their
larger one, so the lone attacker can only raise an honest device's bound, which costs nothing. In a
fleet of two each device's bound is the other's: nothing there can tell who is lying.

Clipping, not refusal: an honest device whose batch lands just over the bound loses a little
signal, not its round. docs/protocol.md, "Bounded influence", gives what it costs honest runs.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor

__all__ = ["ActivationBound", "clip_updates", "upper_median"]

_PER_DEVICE = 256  # per-sample norms kept per device and split


class ActivationBound:
    """Per split: recent per-sample activation norms by device; samples over the bound are clipped."""

    def __init__(self, factor: float) -> None:
        self.factor = float(factor)
        self.norms: dict[int, dict[str, deque[float]]] = {}
        self._medians: dict[int, dict[str, float]] = {}  # split -> device -> median of its norms (kept current)

    def bound(self, k: int, device: str | None = None) -> float | None:
        """``device``'s bound at split k: factor x the upper median over the other devices heard at k
        of their median norm; None while no other device has been heard there."""
        medians = self._medians.get(k, {})
        others = [m for d, m in medians.items() if d != device]
        if not self.factor or not others:
            return None
        return self.factor * upper_median(others)

    def devices(self, k: int) -> list[str]:
        """The devices heard at split k."""
        return list(self._medians.get(k, {}))

    def median(self, k: int, device: str) -> float | None:
        """The median norm ``device`` has sent at split k (None: nothing yet)."""
        return self._medians.get(k, {}).get(device)

    def clip(self, k: int, z: Tensor, device: str) -> tuple[Tensor, Tensor | None, int, Tensor | None]:
        """``z`` with every sample's norm at most ``device``'s bound, the per-sample scale (None:
        untouched; shaped to broadcast over ``z``), how many samples were scaled, and the per-sample
        norms as sent (for ``accept``; None when off)."""
        if not self.factor:
            return z, None, 0, None
        norms = z.detach().flatten(1).norm(dim=1)
        limit = self.bound(k, device)
        if limit is None or not bool((over := norms > limit).any()):
            return z, None, 0, norms
        scale = torch.where(over, limit / norms.clamp_min(1e-30), torch.ones_like(norms))
        return z * scale.view(-1, *([1] * (z.dim() - 1))), scale.view(-1, *([1] * (z.dim() - 1))), \
            int(over.sum()), norms

    def accept(self, device: str, k: int, norms: Tensor | None) -> None:
        """Remember an accepted activation's per-sample norms as the device sent them (before clipping:
        a bound that stored its own output would follow a device that keeps sending less)."""
        if norms is None:
            return
        rows = self.norms.setdefault(k, {}).setdefault(device, deque(maxlen=_PER_DEVICE))
        rows.extend(norms.tolist())
        self._medians.setdefault(k, {})[device] = _lower_median(rows)

    def state_dict(self) -> dict[str, Any]:
        return {str(k): {d: list(v) for d, v in rows.items()} for k, rows in self.norms.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norms = {int(k): {d: deque(v, maxlen=_PER_DEVICE) for d, v in rows.items()} for k, rows in state.items()}
        self._medians = {k: {d: _lower_median(v) for d, v in rows.items()} for k, rows in self.norms.items()}


def _lower_median(values: Any) -> float:
    """The lower middle value (torch.median's rule), without building a tensor per call."""
    ordered = sorted(values)
    return float(ordered[(len(ordered) - 1) // 2])


def upper_median(values: Any) -> float:
    """The upper middle value: of two, the larger (one low value among the others cannot pull it down)."""
    ordered = sorted(values)
    return float(ordered[len(ordered) // 2])


@torch.no_grad()
def change_norms(global_units: dict[Any, dict[str, Tensor]], updates: dict[str, dict[Any, dict[str, Tensor]]]
                 ) -> dict[Any, dict[str, float]]:
    """unit -> device -> the L2 norm of the device's change of that unit (its floating-point tensors)."""
    norms: dict[Any, dict[str, float]] = {}
    for d, states in updates.items():
        for u, st in states.items():
            ref = global_units[u]
            sq = sum(((v - ref[n]).double() ** 2).sum() for n, v in st.items() if v.is_floating_point())
            norms.setdefault(u, {})[d] = float(torch.sqrt(torch.as_tensor(sq, dtype=torch.float64)))
    return norms


@torch.no_grad()
def clip_updates(global_units: dict[int, dict[str, Tensor]], updates: dict[str, dict[int, dict[str, Tensor]]],
                 factor: float, elsewhere: dict[Any, dict[str, float]] | None = None) -> dict[str, int]:
    """Scale each device's change of each unit down to ``factor`` x the upper median change of that
    unit among the round's *other* devices (in place); returns how many units were clipped per
    device. Needs 3 devices or more, so that two others set each device's bound. ``elsewhere``: the
    change norms (``change_norms``) of the round's devices whose copies another process holds
    (coordinator/sharding.py): they set bounds here, and are not clipped here."""
    clipped: dict[str, int] = {}
    if not factor:
        return clipped
    own = change_norms(global_units, updates)
    for u, norms in own.items():
        everyone = {**(elsewhere or {}).get(u, {}), **norms}
        if len(everyone) < 3:
            continue
        ref = global_units[u]
        for d, norm in norms.items():
            limit = factor * upper_median(v for o, v in everyone.items() if o != d)
            if norm > limit > 0:
                s = limit / norm
                for n, v in updates[d][u].items():
                    if v.is_floating_point():
                        v.copy_(ref[n] + (v - ref[n]) * s)
                clipped[d] = clipped.get(d, 0) + 1
    return clipped
