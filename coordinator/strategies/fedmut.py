"""FedMut (AAAI 2024, "FedMut: Generalized Federated Learning via Stochastic Mutation"): FedAvg whose
devices each start the round from a mutated copy of the global model.

After round t-1's aggregation, device i receives w_i = w + alpha * v_i ⊙ g, where g = w - w_prev is the
last global update and v_i holds one factor per parameter tensor ("layer"). The factors are drawn in
pairs across the round's devices, +1 for one device and -(1 - c_t) for the other, in a random order per
tensor, so that with c_t = 0 the copies average to the global model; c_t = acc_rate * (1 - min(s /
acc_bound, 1)) (s = mutations so far) is the reference code's acceleration, which leans the pair along
the last update early on and vanishes after acc_bound rounds. With an odd number of devices one, drawn
per round, receives the global model itself. Updates are averaged with equal weights, as the reference
code's aggregation does, so that the pairs cancel. docs/method.md, "Baselines beyond the paper's own".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fedsga_edge.config import RunConfig
from fedsga_edge.options import Opt

from ..strategy import register_strategy
from .fedavg import FedAvg

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["FedMut", "mutation_factors"]


def mutation_factors(devices: list[str], names: list[str], rng: np.random.Generator,
                     acc: float) -> dict[str, dict[str, float]]:
    """Device -> parameter name -> its mutation factor: per tensor, pairs (+1, -(1 - acc)) dealt to the
    devices in a random order; with an odd number of devices one device (drawn once) gets 0 everywhere."""
    order = list(rng.permutation(len(devices)))
    idle = devices[order.pop()] if len(devices) % 2 else None
    paired = [devices[i] for i in sorted(order)]
    out: dict[str, dict[str, float]] = {d: {} for d in devices}
    for n in names:
        signs = [f for _ in range(len(paired) // 2)
                 for f in ((1.0, -1.0 + acc) if rng.random() > 0.5 else (-1.0 + acc, 1.0))]
        for d, j in zip(paired, rng.permutation(len(paired))):
            out[d][n] = signs[j]
    if idle is not None:
        out[idle] = {n: 0.0 for n in names}
    return out


@register_strategy
class FedMut(FedAvg):
    name = "fedmut"
    help = "FedMut: FedAvg whose devices start from mutated copies of the global model (--fedmut-alpha)"
    label = "FedMut (stochastic mutation)"
    options = (
        Opt("alpha", float, 4.0, "Mutation radius alpha: w_i = w + alpha * v_i * (w - w_prev) (reference code: 4).",
            ge=0, le=100, finite=True),
        Opt("acc_rate", float, 0.3, "Mutation acceleration at the start: one of each pair gets -(1 - rate) "
            "instead of -1 (reference code: 0.3; 0 = the copies average to the global model).", ge=0, lt=1),
        Opt("acc_bound", int, 50, "Rounds over which the acceleration falls linearly to 0 (reference code: 50).",
            ge=1, le=1_000_000),
    )

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        super().__init__(cfg, num_splits, clients, train_flops)
        self.rng = np.random.default_rng([cfg.seed, 19])  # checkpointed by the coordinator with its state
        self._model: Any = None
        self._params: list[str] = []
        self._devices: list[str] = []
        self._prev: dict[str, Tensor] | None = None  # the global parameters at the last round's start
        self._delta: dict[str, Tensor] = {}  # g = w - w_prev, this round's
        self._factors: dict[str, dict[str, float]] = {}
        self.mutations = 0  # rounds mutated so far (the acceleration's clock)
        self._acc = 0.0  # this round's acceleration c_t

    def attach(self, coordinator: Any) -> None:
        self._model = coordinator.model
        self._params = [n for n, _ in coordinator.model.named_parameters()]  # not BatchNorm statistics

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        self._devices = list(clients)
        return super().assign(t, clients)

    def weight(self, num_samples: int) -> float:
        return 1.0  # equal weights: the paired mutations cancel in the average

    def acceleration(self) -> float:
        return self.args["acc_rate"] * (1.0 - min(self.mutations / self.args["acc_bound"], 1.0))

    def begin_round(self, t: int, calibrate: bool) -> None:
        """The last global update g and this round's factors (none in the first round: no update yet)."""
        state = self._model.state_dict()
        now = {n: state[n].detach().clone() for n in self._params}
        self._delta, self._factors = {}, {}
        if self._prev is not None:
            self._delta = {n: now[n] - self._prev[n] for n in self._params}
            self._acc = self.acceleration()
            self._factors = mutation_factors(self._devices, self._params, self.rng, self._acc)
            self.mutations += 1
        self._prev = now

    def device_weights(self, cid: str, t: int, weights: dict[str, "Tensor"]) -> dict[str, "Tensor"]:
        factors = self._factors.get(cid)
        if not factors or self.args["alpha"] == 0:
            return weights
        alpha = self.args["alpha"]
        return {n: (v + (alpha * factors[n]) * self._delta[n]).to(v.dtype) if factors.get(n) else v
                for n, v in weights.items()}

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        record["mutation_acceleration"] = self._acc if self._factors else None

    def info(self) -> dict[str, Any]:
        return {"mutated": "parameters (not BatchNorm statistics)", "weights": "equal weights"}

    def state_dict(self) -> dict[str, Any]:
        return {"prev_global": self._prev, "mutations": self.mutations}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._prev = state.get("prev_global")
        self.mutations = int(state.get("mutations", 0))
