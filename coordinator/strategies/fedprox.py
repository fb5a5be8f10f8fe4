"""FedProx: FedAvg whose devices add a proximal term mu/2 ||w - w_global||^2 to their loss."""

from __future__ import annotations

import dataclasses

from fedsga_edge.config import TrainConfig

from ..strategy import register_strategy
from .fedavg import FedAvg


@register_strategy
class FedProx(FedAvg):
    name = "fedprox"
    help = "FedAvg with a proximal term (--mu)"
    label = "FedProx"
    owns_options = ("prox_mu",)

    def device_train(self, train: TrainConfig) -> TrainConfig:
        return dataclasses.replace(train, mu=self.cfg.prox_mu)
