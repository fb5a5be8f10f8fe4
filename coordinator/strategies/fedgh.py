"""FedGH (ACM MM 2023, "FedGH: Heterogeneous Federated Learning with Generalized Global Header"): each
device trains its whole model (its own body under the global head it received), then uploads the mean
representation of each class of its data; the server trains the shared "generalized" head on those class
means (class mean -> its label, cross-entropy, one SGD step per mean) and sends it back.

The bodies stay on the devices (FedGH's rule; device/methods.py ``FedGHDevice`` keeps each device's own
body between rounds and only takes the received one in its first round). FedGH has no global model, so its
test figure is the data-weighted mean over the devices of each one's model (its latest uploaded body under
the server's head: ``test_models``) on the test set. The coordinator still averages the bodies (no device
trains from that average); its figure is kept as ``test_acc_global``: bodies trained apart for rounds do
not average into a model (chance on CIFAR-10 under Dirichlet(0.1)). docs/method.md, "Baselines beyond the
paper's own".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from fedsga_edge.options import Opt
from fedsga_edge.wire import RemoteProtocolError

from ..instructions import Instruction
from ..limits import check_values
from ..strategy import head_state, register_strategy
from .fedavg import FedAvg

if TYPE_CHECKING:
    from torch import Tensor, nn

__all__ = ["FedGH", "train_head"]


def train_head(head: "nn.Module", samples: list[tuple["Tensor", int]], lr: float, epochs: int) -> list[float]:
    """The server's head training: for each epoch, one plain SGD step (lr, no momentum, no weight decay)
    per (class mean, label) in ``samples``' order, on the cross-entropy of head(mean) and the label.
    Returns each step's loss (before the step)."""
    import torch
    import torch.nn.functional as F

    params = [p for p in head.parameters() if p.requires_grad]
    losses: list[float] = []
    for _ in range(epochs):
        for mean, label in samples:
            logits = head(mean.reshape(1, -1))
            loss = F.cross_entropy(logits, torch.tensor([label], device=logits.device))
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads):
                    p.add_(g, alpha=-lr)
            losses.append(float(loss.detach()))
    return losses


def _head_flops(head: "nn.Module", sample: tuple["Tensor", int]) -> float:
    """FLOPs of one of ``train_head``'s steps (one class mean through the head, forward and backward)."""
    import torch
    import torch.nn.functional as F

    from ..server_work import pass_flops

    mean, label = sample
    target = torch.tensor([label], device=mean.device)
    return pass_flops((head,), lambda h: F.cross_entropy(h(mean.reshape(1, -1)), target), 1)


@register_strategy
class FedGH(FedAvg):
    name = "fedgh"
    help = ("FedGH: whole model on every device, bodies kept on the devices, the server trains the shared head "
            "on the devices' class-mean representations (--fedgh-server-lr)")
    label = "FedGH (generalized global head)"
    device_passes = True
    options = (
        Opt("server_lr", float, 0.01, "SGD learning rate of the server's head training on the class means "
            "(the paper's setting: 0.01).", gt=0, le=10, finite=True),
        Opt("server_epochs", int, 1, "Passes over the round's uploaded class means, one SGD step per mean "
            "(the paper: 1).", ge=1, le=1000),
    )

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._model: Any = None
        self._num_classes = 0
        self._head: dict[str, Tensor] = {}
        self._coordinator: Any = None
        # device -> its latest uploaded body (every weight but the head's), for the test figure
        self._bodies: dict[str, dict[str, Tensor]] = {}

    def attach(self, coordinator: Any) -> None:
        self._model = coordinator.model
        self._num_classes = int(coordinator.num_classes)
        self._coordinator = coordinator  # its ``clients``: device -> training samples (the figure's weight)

    def configure_round(self, t: int, devices: list[str]) -> dict[str, Instruction]:
        method = {"name": self.name}
        return {cid: i.with_fields(method=method) for cid, i in super().configure_round(t, devices).items()}

    def begin_round(self, t: int, calibrate: bool) -> None:
        self._head = head_state(self._model)

    def check_update(self, body: dict[str, Any]) -> None:
        """classes (n,) distinct labels, counts (n,) >= 1, means (n, D) finite with D the head's input."""
        m = body.get("method")
        if not isinstance(m, dict):
            raise RemoteProtocolError("a FedGH update must carry its class means (method)")
        classes, counts, means = m.get("classes"), m.get("counts"), m.get("means")
        if not all(isinstance(a, np.ndarray) for a in (classes, counts, means)):
            raise RemoteProtocolError("method.classes, counts and means must be arrays")
        dim = int(self._model.head.in_features)
        n = len(classes) if classes.ndim == 1 else -1
        if classes.dtype.kind not in "iu" or counts.dtype.kind not in "iu" or means.dtype.kind != "f":
            raise RemoteProtocolError("method.classes and counts must be integers, means floating point")
        if n < 1 or counts.shape != (n,) or means.shape != (n, dim):
            raise RemoteProtocolError(f"method: classes {classes.shape}, counts {counts.shape}, means {means.shape} do "
                             f"not fit n classes and the head's {dim} inputs")
        if len(np.unique(classes)) != n or classes.min() < 0 or classes.max() >= self._num_classes:
            raise RemoteProtocolError(f"method.classes must be distinct labels in 0..{self._num_classes - 1}")
        if counts.min() < 1:
            raise RemoteProtocolError("method.counts must be positive")
        check_values(means, "method.means")

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        """The head: the round's starting head trained on the uploaded class means (devices in id order,
        classes ascending), whatever the average of the devices' heads was."""
        import torch

        model = self._model
        if self._head:
            model.load_state_dict(self._head, strict=False)
        device = next(model.head.parameters()).device
        samples = [(torch.from_numpy(np.array(mean, dtype=np.float32)).to(device), int(c))
                   for cid in sorted(updates)
                   for c, mean in zip(updates[cid]["method"]["classes"], updates[cid]["method"]["means"])]
        losses = train_head(model.head, samples, self.args["server_lr"], self.args["server_epochs"])
        if losses:  # the server's work (coordinator/server_work.py): one step per class mean and epoch
            self._coordinator.server.work.add("head", len(losses), lambda: _head_flops(model.head, samples[0]),
                                              steps=len(losses))
        record["head_loss"] = float(np.mean(losses)) if losses else None
        record["class_means"] = len(samples)
        head = head_state(model)
        for cid, u in updates.items():
            if "weights" not in u:  # nothing of the device's own to test (a hand-made update)
                continue
            self._bodies[cid] = {n: torch.from_numpy(np.array(a)).to(device) for n, a in u["weights"].items()
                                 if n not in head}
        record["method_flops"] = {"client": self._device_flops(updates)}

    def _device_flops(self, updates: dict[str, dict[str, Any]]) -> int:
        """docs/method.md, "Costs": the class means FedGH adds to a device's training, one forward pass over its
        training batches (device/methods.py ``class_means``), counted from the plan at the whole model's
        forward cost (the head, one linear layer, included: under 0.1 % of it, an approximation)."""
        from ..server import samples_per_epoch

        co, tc = self._coordinator, self.cfg.train
        return int(sum(samples_per_epoch(int(co.clients[cid]), tc.batch_size, tc.max_batches, tc.batching)
                       for cid in updates) * co.costs.full_fwd)

    def test_models(self) -> list[tuple[float, dict[str, "Tensor"]]]:
        """Each device's latest body under the server's current head, weighted by its data."""
        head = head_state(self._model)
        return [(self.weight(self._coordinator.clients.get(cid, 1)), body | head) for cid, body in sorted(self._bodies.items())]

    def state_dict(self) -> dict[str, Any]:
        return {"bodies": self._bodies}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._bodies = dict(state.get("bodies", {}))

    def info(self) -> dict[str, Any]:
        return {"bodies": "kept on the devices (the coordinator's average is for its test figure only)",
                "head": "trained on the server on the devices' class means"}
