"""Private fronts (``--fronts private``): each device's own copy of the blocks it may run, never averaged.

The paper writes the model as (w_s, {w_i}): one server submodel shared across clients and a front
maintained by each client. Here the front is every block below the deepest candidate split (units
``0 .. depth_of(K) - 1``), so a device has its own copy at every depth it may be asked to (or may choose
to) run; it starts as the global model's blocks when the device first takes part. A device is sent its
own copy of the blocks it runs (round start, fetch), and what it trains comes back into its copy, out of
aggregation: the global model's copies of those blocks move only where the server trained them (a device
at a shallower split hands them to the shared server side). docs/method.md, "Private fronts".
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["PrivateFronts", "TEST_MODEL"]

# what the coordinator's test figure scores under private fronts (the record's ``test_model``)
TEST_MODEL = "each device's own front up to its last split with the shared server side past it, averaged by data"


class PrivateFronts:
    """The devices' own fronts, kept by the coordinator (which sees every weight a device sends anyway);
    with ``on`` false (``--fronts shared``) every call hands its input back unchanged."""

    def __init__(self, model: Any, on: bool) -> None:
        self.model, self.on = model, on
        self.depth = model.depth_of(model.num_splits)  # units below this are a device's own
        self.fronts: dict[str, dict[str, Tensor]] = {}
        # units below its last split: what the device runs of its own front (past it, the shared server side)
        self.runs: dict[str, int] = {}

    def is_front(self, name: str) -> bool:
        return self.model.unit_of(name) < self.depth

    def own(self, cid: str, weights: Mapping[str, Tensor], start: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """``weights`` (a slice of the global state) with the front's entries replaced by ``cid``'s copy;
        a device seen for the first time gets its copy from ``start`` (the round's global state)."""
        if not self.on:
            return dict(weights)
        front = self.fronts.get(cid)
        if front is None:
            front = self.fronts[cid] = {n: v.detach().clone() for n, v in start.items() if self.is_front(n)}
        return {n: front[n] if n in front else v for n, v in weights.items()}

    def keep(self, states: dict[str, dict[int, dict[str, Tensor]]]) -> dict[str, dict[int, dict[str, Tensor]]]:
        """Each device's trained front units into its own copy; what remains (units past the front, e.g. a
        whole-model device's head) goes on to aggregation."""
        if not self.on:
            return states
        out = {}
        for cid, units in states.items():
            front = self.fronts.setdefault(cid, {})
            for unit, state in units.items():
                if unit < self.depth:
                    front.update({n: v.detach().clone() for n, v in state.items()})
            if units:
                self.runs[cid] = min(max(units) + 1, self.depth)
            out[cid] = {u: s for u, s in units.items() if u >= self.depth}
        return out

    def test_models(self, global_state: Mapping[str, Tensor],
                    weight: Any) -> list[tuple[float, dict[str, Tensor]]]:
        """Each device's model as it runs at its last split: its own front below the split, the global (shared)
        rest; ``weight(cid)`` its data (none with shared fronts: the global model is every device's).

        Its own copies of blocks past its split are left out: the device has not trained them since it took part
        (or since it last ran that deep), and at its split the shared server side runs them."""
        return [(float(weight(cid)), dict(global_state) | self.running(cid)) for cid in sorted(self.fronts)]

    def running(self, cid: str) -> dict[str, Tensor]:
        """The part of ``cid``'s front it runs at its last split (all of it before its first update)."""
        depth = self.runs.get(cid, self.depth)
        return {n: v for n, v in self.fronts[cid].items() if self.model.unit_of(n) < depth}

    def state_dict(self) -> dict[str, Any]:
        return {"fronts": {cid: {n: v.clone() for n, v in front.items()} for cid, front in self.fronts.items()},
                "runs": dict(self.runs)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        fronts = state["fronts"] if {"fronts", "runs"} <= set(state) else state  # older checkpoints: fronts only
        self.fronts = {str(cid): {n: torch.as_tensor(v).clone() for n, v in front.items()}
                       for cid, front in fronts.items()}
        self.runs = {str(cid): int(d) for cid, d in state.get("runs", {}).items()}
