"""FedAS (CVPR 2024, "FedAS: Bridging Inconsistency in Personalized Federated Learning"): personalized
FedAvg with Federated Parameter-Alignment and Client-Synchronization.

The body is shared, the head is each device's own. Before local training a device aligns the received
global body with its local model (feature alignment: a pass of SGD pulling the new body's features of
each local class towards that class's prototype under the device's previous local model) and puts its
own head back (device/methods.py ``FedASDevice``); after training it reports the Fisher information of
its model on its local data (the trace: the squared gradients of the mean negative log-likelihood,
summed over parameters and batches). The server averages the devices' models with weights proportional
to that Fisher information, so a device whose model carries no information (a straggler's under-trained
one, in the paper) gets no weight. docs/method.md, "Baselines beyond the paper's own".
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fedsga_edge.options import Opt
from fedsga_edge.wire import RemoteProtocolError

from ..instructions import Instruction
from ..limits import check_values
from ..strategy import register_strategy
from .fedavg import FedAvg

__all__ = ["FedAS"]


@register_strategy
class FedAS(FedAvg):
    name = "fedas"
    help = ("FedAS: whole model on every device, the received body aligned to the device's class prototypes, "
            "the head kept per device, models averaged by Fisher information (--fedas-align-lr)")
    label = "FedAS (alignment + Fisher-weighted aggregation)"
    options = (
        Opt("align_lr", float, 0.01, "SGD learning rate of the device's body alignment to its class prototypes "
            "(reference code: 0.01; 0 = no alignment).", ge=0, le=10, finite=True),
        Opt("align_epochs", int, 1, "Passes over the device's data for the alignment (reference code: 1).",
            ge=0, le=100),
    )

    def configure_round(self, t: int, devices: list[str]) -> dict[str, Instruction]:
        method = {"name": self.name, "align_lr": float(self.args["align_lr"]),
                  "align_epochs": int(self.args["align_epochs"])}
        return {cid: i.with_fields(method=method) for cid, i in super().configure_round(t, devices).items()}

    def check_update(self, body: dict[str, Any]) -> None:
        """The device's Fisher information: one finite number >= 0 (it weighs the device's model)."""
        m = body.get("method")
        f = m.get("fisher") if isinstance(m, dict) else None
        if isinstance(f, bool) or not isinstance(f, (int, float)):
            raise RemoteProtocolError("a FedAS update must carry its Fisher information (method.fisher, a number)")
        check_values(np.array([f], dtype=np.float64), "method.fisher")  # finite, of a sane size
        if f < 0:
            raise RemoteProtocolError(f"method.fisher must be >= 0, got {f!r:.40}")

    def aggregation_weight(self, cid: str, update: dict[str, Any], weight: float) -> float:
        return float(update["method"]["fisher"])  # in place of |D_i|: normalised over the round's devices

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        fisher = {cid: float(u["method"]["fisher"]) for cid, u in updates.items()}
        total = sum(fisher.values())
        record["fisher"] = fisher
        record["fisher_weights"] = {cid: f / total for cid, f in fisher.items()} if total > 0 else None

    def info(self) -> dict[str, Any]:
        return {"weights": "Fisher-information weights (trace, all parameters)",
                "head": "kept per device; the coordinator's head is the Fisher-weighted average, for its test figure"}
