"""A method's device side beyond the fixed round: hooks keyed by the round start's ``method`` field.

The device round is fixed (device/role.py: plan, fetch, evaluate, train, learn prompts, calibrate,
update). A method that needs more of the device than its training settings (FedGH's class means,
FedAS's body alignment and Fisher information) names itself in ``round_start["method"] = {"name":
..., <its settings>}``; the role then calls this module's hooks at two fixed points, and never asks
which method runs:

* ``before_train(client, plan)``: after the round's weights are loaded (round start and fetch), before
  the held-out evaluation and local training: whatever turns the received model into the one this
  device trains (FedGH: the device's own body back; FedAS: the received body aligned, its own head back);
* ``evaluate(client, plan, t) -> dict``: in an evaluation round, right after the held-out evaluation of the
  received model (before training); the dict's figures go into the update beside ``eval_*`` (FedBABU's
  fine-tuned figure, ``eval_loss_finetuned`` and ``eval_acc_finetuned``);
* ``report(client, plan) -> dict``: after training; the dict goes into the update as ``update["method"]``
  and the coordinator's strategy checks it (``Strategy.check_update``) before it can count.

A method's private state between rounds lives in ``client.method_state[name]`` (numpy only; like the
prompts it never leaves the device; it is not in the agent's state file, so a restarted agent starts
the method's state afresh). A new device side is one ``DeviceMethod`` subclass with
``@register_device_method``; its strategy sends ``{"name": ...}`` through ``round_start_fields``.

Only numpy here: the torch work is the backend's (``device.client.TorchBackend``: ``features``,
``fisher_trace``, ``align_step``); a backend without it refuses the round (``BackendError``), as the
torch-free ONNX device refuses every whole-model round. docs/method.md, "Baselines beyond the paper's own".
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

__all__ = ["DeviceMethod", "register_device_method", "device_method", "check_method", "FedGHDevice",
           "FedASDevice", "FedBABUDevice", "class_means"]

_REGISTRY: dict[str, type["DeviceMethod"]] = {}


class DeviceMethod:
    """Base: no work before training, nothing to report. ``settings`` is the round start's ``method`` map."""

    name: ClassVar[str] = ""

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings

    @classmethod
    def check(cls, settings: dict[str, Any]) -> None:
        """Reject malformed settings (ValueError / TypeError) before the round changes anything."""

    def before_train(self, client: Any, plan: Any) -> None:
        """The round's weights are loaded; make the model this device trains (and evaluates) this round."""

    def evaluate(self, client: Any, plan: Any, t: int) -> dict[str, Any]:
        """Round ``t`` evaluates: after the received model's held-out figure, before training, further figures
        for the update (beside ``eval_count``, ``eval_loss``, ``eval_acc``). None by default."""
        return {}

    def report(self, client: Any, plan: Any) -> dict[str, Any]:
        """After local training: what the update carries for the strategy (``update["method"]``)."""
        return {}


def register_device_method(cls: type[DeviceMethod]) -> type[DeviceMethod]:
    if not cls.name or _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"device method {cls.__name__}: no name, or {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def check_method(spec: Any) -> None:
    """A round start's ``method`` field: a map naming a method this device knows, with valid settings."""
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise TypeError("method must be a map with a name")
    cls = _REGISTRY.get(spec["name"])
    if cls is None:
        raise ValueError(f"this device has no device side for method {spec['name']!r:.40}")
    cls.check(spec)


def device_method(spec: Any) -> DeviceMethod | None:
    """The round's hooks (None when the round start names no method); ``spec`` was checked on arrival."""
    return None if spec is None else _REGISTRY[spec["name"]](spec)


def _need(be: Any, what: str) -> Any:
    from .role import BackendError

    fn = getattr(be, what, None)
    if fn is None:
        raise BackendError(f"the {be.name} backend cannot compute {what}, which this method needs: use --backend torch")
    return fn


def _batches(client: Any, plan: Any) -> list[np.ndarray]:
    """The device's training indices in order, in training-size batches, at most ``max_batches`` of them
    (the same cap as training): no draw from the device's batch-order stream."""
    from fedsga_edge.batches import cut_batches

    out = cut_batches(np.asarray(client.data.indices), plan.train.batch_size, plan.train.batching)
    return out[: plan.train.max_batches] if plan.train.max_batches else out


def class_means(client: Any, plan: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(classes, counts, means): the body's pooled features (eval mode, no augmentation) averaged per class
    over ``_batches``; classes ascending, means (n_classes, D) float32."""
    features = _need(client.backend, "features")
    sums: dict[int, np.ndarray] = {}
    counts: dict[int, int] = {}
    for idx in _batches(client, plan):
        x, y = client._inputs(idx, augment=False)
        f = np.asarray(features(x), dtype=np.float64)
        for c in np.unique(y):
            rows = f[y == c]
            sums[int(c)] = sums.get(int(c), 0.0) + rows.sum(axis=0)
            counts[int(c)] = counts.get(int(c), 0) + len(rows)
    classes = np.array(sorted(sums), dtype=np.int64)
    means = np.stack([sums[int(c)] / counts[int(c)] for c in classes]).astype(np.float32)
    return classes, np.array([counts[int(c)] for c in classes], dtype=np.int64), means


def _units(be: Any, weights: dict[str, np.ndarray], head: bool) -> dict[str, np.ndarray]:
    """The head's weights (``head``) or the body's (every block), as copies."""
    return {n: np.array(v) for n, v in weights.items() if (be.unit_of(n) == be.num_blocks) == head}


@register_device_method
class FedGHDevice(DeviceMethod):
    """FedGH: the body stays this device's own; the head is the server's generalized head, received each
    round. After training the device reports its per-class mean representations."""

    name = "fedgh"

    def before_train(self, client: Any, plan: Any) -> None:
        body = client.method_state.get(self.name, {}).get("body")
        if body is not None:  # the first round trains from the received (initial) body
            client.backend.load(body)

    def report(self, client: Any, plan: Any) -> dict[str, Any]:
        be = client.backend
        classes, counts, means = class_means(client, plan)
        client.method_state[self.name] = {"body": _units(be, be.weights(be.num_blocks, False), head=False)}
        return {"classes": classes, "counts": counts, "means": means}


def _positive(spec: dict[str, Any], key: str, kind: type, high: float) -> None:
    v = spec.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else int):
        raise TypeError(f"method.{key} must be a {kind.__name__}")
    if not (math.isfinite(v) and 0 <= v <= high):
        raise ValueError(f"method.{key} = {v!r} is outside 0..{high:g}")


@register_device_method
class FedASDevice(DeviceMethod):
    """FedAS: the received (shared) body is aligned to this device's class prototypes from its last local
    model, its own (personalized) head is put back, and after training it reports its Fisher information."""

    name = "fedas"

    @classmethod
    def check(cls, settings: dict[str, Any]) -> None:
        _positive(settings, "align_lr", float, 10.0)
        _positive(settings, "align_epochs", int, 100)

    def before_train(self, client: Any, plan: Any) -> None:
        own = client.method_state.get(self.name)
        if own is None:  # first round: nothing local to align to yet
            return
        step = _need(client.backend, "align_step")
        lr, epochs = float(self.settings["align_lr"]), int(self.settings["align_epochs"])
        for _ in range(epochs if lr > 0 else 0):
            for idx in _batches(client, plan):
                x, y = client._inputs(idx, augment=False)
                step(x, y, own["classes"], own["means"], lr)
        client.backend.load(own["head"])

    def report(self, client: Any, plan: Any) -> dict[str, Any]:
        be = client.backend
        fisher = _need(be, "fisher_trace")
        total = 0.0
        for idx in _batches(client, plan):
            x, y = client._inputs(idx, augment=False)
            total += float(fisher(x, y))
        classes, _, means = class_means(client, plan)
        client.method_state[self.name] = {"classes": classes, "means": means,
                                          "head": _units(be, be.weights(be.num_blocks, True), head=True)}
        return {"fisher": total}


@register_device_method
class FedBABUDevice(DeviceMethod):
    """FedBABU's personalised figure: in an evaluation round, a copy of the received head fine-tuned for
    ``finetune_epochs`` epochs on this device's training data, scored on its held-out slice beside the global
    model's figure (device/evaluate.py ``finetuned_evaluation``). The device's own model is only read."""

    name = "fedbabu"

    @classmethod
    def check(cls, settings: dict[str, Any]) -> None:
        _positive(settings, "finetune_epochs", int, 1000)

    def evaluate(self, client: Any, plan: Any, t: int) -> dict[str, Any]:
        from .evaluate import finetuned_evaluation

        return finetuned_evaluation(client, plan, int(self.settings["finetune_epochs"]), t)
