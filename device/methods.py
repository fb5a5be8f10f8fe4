"""A method's device side beyond the fixed round: plug-ins armed by the round start.

The device round is fixed (device/role.py: plan, fetch, evaluate, train, after training, the method's
requests, update). A method that needs more of the device than its training settings (FedSGA's split
choice and probe, FedGH's class means, FedAS's body alignment and Fisher information, FedBABU's
fine-tuned figure) names itself in ``round_start["method"] = {"name": ..., <its settings>}`` (FedSGA:
its ``fedsga`` settings field, the wire's original spelling, ``DeviceMethod.field``); the role then
calls its hooks at fixed points, and never asks which method runs:

* ``prepare(client, plan)``: the round's weights are loaded, ``plan.k`` is the coordinator's split (None:
  the device decides); settles what the round trains with (FedSGA: prompts, its own split, calibration);
* ``before_train(client, plan)``: after the fetch, before the held-out evaluation and local training:
  whatever turns the received model into the one this device trains (FedGH: the device's own body back;
  FedAS: the received body aligned, its own head back);
* ``evaluate(client, plan, t) -> dict``: in an evaluation round, right after the held-out evaluation of the
  received model (before training); the dict's figures go into the update beside ``eval_*`` (FedBABU's
  fine-tuned figure, ``eval_loss_finetuned`` and ``eval_acc_finetuned``);
* ``after_train(client, plan, trained)``: local training is over (FedSGA: the prompts' descriptor and q);
* ``requests(client, plan)``: requests of the method's own after training, as the round's steps (FedSGA's
  calibration probe);
* ``report(client, plan) -> dict | None``: goes into the update as ``update["method"]`` (None: no such
  field) and the coordinator's strategy checks it (``Strategy.check_update``) before it can count.

A method's private state between rounds lives in ``client.method_state[name]`` (numpy only; like the
prompts it never leaves the device; it is not in the agent's state file, so a restarted agent starts
the method's state afresh). A new device side is one ``DeviceMethod`` subclass with
``@register_device_method``; its strategy sends ``{"name": ...}`` in its ``Instruction``'s ``method`` field
(coordinator/instructions.py).

Only numpy here: the torch work is the backend's (``device.client.TorchBackend``: ``features``,
``fisher_trace``, ``align_step``); a backend without it refuses the round (``BackendError``), as the
torch-free ONNX device refuses every whole-model round. docs/method.md, "Baselines beyond the paper's own".
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import numpy as np

from .backend import BackendError, Steps

__all__ = ["DeviceMethod", "register_device_method", "device_method", "check_method", "FedGHDevice",
           "FedASDevice", "FedBABUDevice", "class_means"]

_REGISTRY: dict[str, type["DeviceMethod"]] = {}


class DeviceMethod:
    """Base: no work of its own, nothing to report. ``settings`` is the round start's ``method`` map (the
    round start itself for a method armed by its own ``field``)."""

    name: ClassVar[str] = ""
    # The round-start field whose presence arms this method when there is no ``method`` map (FedSGA: "fedsga")
    field: ClassVar[str | None] = None
    # It picks the split when the coordinator names none (FedSGA); a round start naming no split needs one
    chooses_split: ClassVar[bool] = False

    def __init__(self, settings: dict[str, Any]) -> None:
        self.settings = settings

    @classmethod
    def check(cls, settings: dict[str, Any]) -> None:
        """Reject malformed settings (ValueError / TypeError) before the round changes anything."""

    def prepare(self, client: Any, plan: Any) -> None:
        """The round's weights are loaded, ``plan.k`` is the coordinator's split (None: this method picks it):
        set what the round trains with (``plan.k``, ``prompts``, ``want_h1``, ``prompt_lr``, ``calibrate``)."""

    def before_train(self, client: Any, plan: Any) -> None:
        """The round's weights are loaded; make the model this device trains (and evaluates) this round."""

    def evaluate(self, client: Any, plan: Any, t: int) -> dict[str, Any]:
        """Round ``t`` evaluates: after the received model's held-out figure, before training, further figures
        for the update (beside ``eval_count``, ``eval_loss``, ``eval_acc``). None by default."""
        return {}

    def after_train(self, client: Any, plan: Any, trained: Any) -> None:
        """Local training is over (``trained``: its loss, steps, the prompts' contributions and new values)."""

    def requests(self, client: Any, plan: Any) -> Steps[None]:
        """The method's own requests after training, yielded like the round's (none by default)."""
        return
        yield

    def report(self, client: Any, plan: Any) -> dict[str, Any] | None:
        """After training: what the update carries for the strategy (``update["method"]``; None: no field)."""
        return {}


def register_device_method(cls: type[DeviceMethod]) -> type[DeviceMethod]:
    if not cls.name or _REGISTRY.get(cls.name, cls) is not cls:
        raise ValueError(f"device method {cls.__name__}: no name, or {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def _armed(body: dict[str, Any]) -> tuple[type[DeviceMethod], dict[str, Any]] | None:
    """The device side a round start arms and its settings: the ``method`` map's, else a method's own field's."""
    by_field = [cls for cls in _REGISTRY.values() if cls.field is not None and body.get(cls.field)]
    spec = body.get("method")
    if spec is None:
        return (by_field[0], body) if by_field else None
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise TypeError("method must be a map with a name")
    cls = _REGISTRY.get(spec["name"])
    if cls is None:
        raise ValueError(f"this device has no device side for method {spec['name']!r:.40}")
    if by_field:
        raise ValueError(f"round_start arms two device sides: method {spec['name']!r:.40} and {by_field[0].field!r}")
    return cls, spec


def check_method(body: dict[str, Any]) -> type[DeviceMethod] | None:
    """The device side a round start arms (None: none), its settings checked; TypeError / ValueError / KeyError
    when it names a method this device does not know, or settings it cannot take."""
    armed = _armed(body)
    if armed is None:
        return None
    cls, settings = armed
    cls.check(settings)
    return cls


def device_method(body: dict[str, Any]) -> DeviceMethod | None:
    """The round's device side (None when the round start arms none); ``body`` was checked on arrival."""
    armed = _armed(body)
    return None if armed is None else armed[0](armed[1])


def _need(be: Any, what: str) -> Any:
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
