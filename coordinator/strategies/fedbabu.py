"""FedBABU (ICLR 2022, "FedBABU: Toward Enhanced Representation for Federated Image Classification"):
FedAvg in which the devices train the body only and the classifier head stays at its random
initialisation for the whole federated training.

The devices get ``freeze_head`` in their training settings (the torch device leaves the head out of
its optimizer; the torch-free ONNX device refuses whole-model rounds with its reason), and only the
body is aggregated: after aggregation the head is put back to the round's starting value, whatever a
device sent.

The paper's personalised figure: in an evaluation round (``--eval-holdout``) each device also fine-tunes
a copy of the received head for ``--fedbabu-finetune-epochs`` epochs on its own training data and scores
it on its held-out slice (the round start's ``method`` map carries the epochs; device/methods.py
``FedBABUDevice``, device/evaluate.py ``finetuned_evaluation``); the record gets ``fed_acc_finetuned``
beside the global ``fed_acc``. docs/method.md, "Baselines beyond the paper's own".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedsga_edge.options import Opt
from fedsga_edge.wire import RemoteProtocolError

from ..instructions import Instruction
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
    options = (
        Opt("finetune_epochs", int, 5, "Evaluation rounds (--eval-holdout): epochs of head-only fine-tuning on each "
            "device's own training data (a copy of the received head, the run's --lr, --batch-size and --max-batches) "
            "before the fine-tuned figure is scored on its held-out slice (the paper's tau_f = 5); 0 scores the global "
            "model again.", ge=0, le=1000),
    )
    finetuned_eval = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._model: Any = None
        self._head: dict[str, Tensor] = {}

    def attach(self, coordinator: Any) -> None:
        self._model = coordinator.model

    def configure_round(self, t: int, devices: list[str]) -> dict[str, Instruction]:
        """The head frozen in training, and the device side's settings (device/methods.py ``FedBABUDevice``): a
        device that predates them refuses the round, naming the method, instead of evaluating without the
        fine-tuned figure."""
        method = {"name": self.name, "finetune_epochs": int(self.args["finetune_epochs"])}
        return {cid: i.with_train(freeze_head=True).with_fields(method=method)
                for cid, i in super().configure_round(t, devices).items()}

    def check_update(self, body: dict[str, Any]) -> None:
        """The device side reports nothing of its own (its figures are ``eval_*``, checked by the evaluation)."""
        m = body.get("method")
        if m is not None and not (isinstance(m, dict) and not m):
            raise RemoteProtocolError("a FedBABU update's method fields must be empty")

    def begin_round(self, t: int, calibrate: bool) -> None:
        self._head = head_state(self._model)

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        """Only the body is aggregated: the head goes back to its value at the round's start."""
        if self._head:
            self._model.load_state_dict(self._head, strict=False)
