"""FedBABU (ICLR 2022, "FedBABU: Toward Enhanced Representation for Federated Image Classification"):
FedAvg in which the devices train the body only and the classifier head stays at its random
initialisation for the whole federated training.

The devices get ``freeze_head`` in their training settings (the torch device leaves the head out of
its optimizer; the torch-free ONNX device refuses whole-model rounds with its reason), and only the
body is aggregated: after aggregation the head is put back to the round's starting value, whatever a
device sent. docs/method.md, "Baselines beyond the paper's own".
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fedsga_edge.config import TrainConfig

from ..strategy import head_state, register_strategy
from .fedavg import FedAvg

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["FedBABU"]


@register_strategy
class FedBABU(FedAvg):
    name = "fedbabu"
    help = "FedBABU: the whole model on every device, the head frozen at its initialisation, the body averaged"
    label = "FedBABU (body trained, head fixed)"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._model: Any = None
        self._head: dict[str, Tensor] = {}

    def attach(self, coordinator: Any) -> None:
        self._model = coordinator.model

    def device_train(self, train: TrainConfig) -> TrainConfig:
        return dataclasses.replace(train, mu=0.0, freeze_head=True)

    def begin_round(self, t: int, calibrate: bool) -> None:
        self._head = head_state(self._model)

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        """Only the body is aggregated: the head goes back to its value at the round's start."""
        if self._head:
            self._model.load_state_dict(self._head, strict=False)
