"""FedProx: FedAvg whose devices add a proximal term mu/2 ||w - w_global||^2 to their loss."""

from __future__ import annotations

from ..instructions import Instruction
from ..strategy import register_strategy
from .fedavg import FedAvg


@register_strategy
class FedProx(FedAvg):
    name = "fedprox"
    help = "FedAvg with a proximal term (--mu)"
    label = "FedProx"
    owns_options = ("prox_mu",)

    def configure_round(self, t: int, devices: list[str]) -> dict[str, Instruction]:
        return {cid: i.with_train(mu=self.cfg.prox_mu) for cid, i in super().configure_round(t, devices).items()}
