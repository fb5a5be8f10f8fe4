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
    device_passes = True
    options = (
        Opt("align_lr", float, 0.01, "SGD learning rate of the device's body alignment to its class prototypes "
            "(reference code: 0.01; 0 = no alignment).", ge=0, le=10, finite=True),
        Opt("align_epochs", int, 1, "Passes over the device's data for the alignment (reference code: 1).",
            ge=0, le=100),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._coordinator: Any = None
        self._kept: set[str] = set()  # devices that reported a model: from their next round on they align to it

    def attach(self, coordinator: Any) -> None:
        self._coordinator = coordinator  # its cost table and devices' sample counts, for the devices' FLOPs

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
        record["method_flops"] = {"client": self._device_flops(updates)}
        self._kept |= set(updates)

    def _device_flops(self, updates: dict[str, dict[str, Any]]) -> int:
        """docs/method.md, "Costs": what FedAS adds to a device's training, counted from the plan as FedSGA's
        probes are. Each pass goes over the device's training batches (device/methods.py ``FedASDevice``): the
        alignment's ``align_epochs`` forward + backward passes (from a device's second round: it aligns to the
        model it kept), the Fisher trace's one forward + backward and the class means' one forward. The
        alignment's and the class means' passes run the body alone and are counted at the whole model's
        cost: the head, one linear layer, is under 0.1 % of it at this project's models (an approximation)."""
        co = self._coordinator
        if co is None or not updates:
            return 0
        from ..server import samples_per_epoch

        costs, tc = co.costs, self.cfg.train
        align = int(self.args["align_epochs"]) if float(self.args["align_lr"]) > 0 else 0
        total = 0
        for cid in updates:
            n = samples_per_epoch(int(co.clients[cid]), tc.batch_size, tc.max_batches, tc.batching)
            passes = (align if cid in self._kept else 0) + 1  # alignment, then the Fisher trace
            total += n * (passes * costs.full_train + costs.full_fwd)
        return int(total)

    def state_dict(self) -> dict[str, Any]:
        return {"kept": sorted(self._kept)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._kept = set(state.get("kept", ()))

    def info(self) -> dict[str, Any]:
        return {"weights": "Fisher-information weights (trace, all parameters)",
                "head": "kept per device; the coordinator's head is the Fisher-weighted average, for its test figure"}
