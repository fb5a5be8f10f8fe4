"""Federated evaluation on the device: the global model on the device's held-out slice (issue 18).

A device keeps a slice of its own data out of training (``--eval-holdout``, ``ClientData.eval_indices``;
drawn once from the run's seed and the device id, so the same share gives the same slice whether it came
from an in-process partition or a folder on the device). When a ``round_start`` says ``evaluate``, the
device measures the model that round starts from (the global model after the previous round's
aggregation), before it trains:

* a split device cannot finish the forward pass alone (the coordinator holds the suffix and head), so it
  sends one ``evaluate`` request per batch of its slice: the eval-mode activations at its split, with
  the labels; the coordinator runs them through its copy of the round-start suffix and head and answers
  ``eval_result`` (the batch's summed loss, its correct count and its size), summing them per device;
* a whole-model device (FedAvg, FedProx) evaluates alone and reports ``eval_count``, ``eval_loss`` and
  ``eval_acc`` in its update.

docs/protocol.md, "Federated evaluation", says what this reveals. Only numpy is imported here; the torch
backend's forward is imported where it runs, so the torch-free device never loads torch.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import numpy as np

__all__ = ["EVAL_SPAWN", "hold_out", "held_out_evaluation", "eval_batches"]

EVAL_SPAWN = 0xE7A1  # the held-out slice's own stream: it draws nothing from the batch order's


def hold_out(indices: np.ndarray, fraction: float, seed: int, cid: str) -> tuple[np.ndarray, np.ndarray]:
    """(indices to train on, indices held out): ``fraction`` of them, at least 2, drawn by (seed, cid).

    Both keep ``indices``' order. ValueError when the share is too small to hold 2 out and train on 2."""
    indices = np.asarray(indices, dtype=np.int64)
    if fraction <= 0:
        return indices, np.empty(0, dtype=np.int64)
    from .role import stable_hash

    n = len(indices)
    take = max(2, int(round(fraction * n)))
    if n - take < 2:
        raise ValueError(f"{cid} has {n} samples: too few to hold {take} out for evaluation (--eval-holdout "
                         f"{fraction:g}) and train on at least 2; lower --eval-holdout or give it more data")
    chosen = np.zeros(n, dtype=bool)
    chosen[np.random.default_rng([seed, stable_hash(cid), EVAL_SPAWN]).choice(n, size=take, replace=False)] = True
    return indices[~chosen], indices[chosen]


def eval_batches(indices: np.ndarray, batch_size: int) -> list[np.ndarray]:
    """``indices`` in order, in batches of at most ``batch_size`` (+1: a last batch of one joins the one
    before, so every batch holds 2 or more samples: BatchNorm cannot train on one). Training batches too."""
    out = [indices[i : i + batch_size] for i in range(0, len(indices), batch_size)]
    if len(out) > 1 and len(out[-1]) < 2:
        last = out.pop()  # popped first: out[-2] read after the pop would be the batch before
        out[-1] = np.concatenate([out[-1], last])
    return out


_Steps = Generator[tuple[str, dict[str, Any]], Any, dict[str, Any]]


def held_out_evaluation(client: Any, plan: Any, expect: Callable[[Any, str], Any]) -> _Steps:
    """The round's evaluation requests (a split device) or none (a whole-model device); returns what the
    update reports. ``client`` is the ``SplitClient``, ``plan`` its round plan (weights loaded, split chosen),
    ``expect`` the role's reply check (an error reply ends the round like any refused request)."""
    held = getattr(client.data, "eval_indices", None)
    if held is None or not len(held):
        return {}
    be = client.backend
    batches = eval_batches(np.asarray(held), plan.train.batch_size)
    if plan.full:
        loss_sum, correct = 0.0, 0
        for idx in batches:
            x, y = client._inputs(idx, augment=False)
            batch_loss, batch_correct = _full_eval(be, x, y)
            loss_sum += batch_loss
            correct += batch_correct
        n = int(sum(len(b) for b in batches))
        return {"eval_count": n, "eval_loss": loss_sum / n, "eval_acc": correct / n}
    for idx in batches:
        x, y = client._inputs(idx, augment=False)
        z = _eval_forward(be, x, plan.depth, plan.prompts)
        expect((yield "evaluate", {"z": z, "y": y, "split": plan.k}), "eval_result")
    return {}


def _eval_forward(be: Any, x: Any, depth: int, prompts: np.ndarray | None) -> np.ndarray:
    """The prefix to ``depth`` in eval mode (BatchNorm on its running statistics), with the device's prompts
    as in training; the backend's weights and statistics are left as they were."""
    if hasattr(be, "eval_forward"):
        return be.eval_forward(x, depth, prompts)
    if be.name == "onnx":
        return np.asarray(be.runner(be._split_at(depth)).eval_forward(x, be._feed_prompts(prompts)), np.float32)
    import torch

    from fedsga_edge.tensors import to_numpy

    model = be.model
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            return to_numpy(model.prefix(x, depth, be._prompts(prompts))).astype(np.float32)
    finally:
        model.train(was)


def _full_eval(be: Any, x: Any, y: np.ndarray) -> tuple[float, int]:
    """A whole-model device's own evaluation of a batch: (summed cross-entropy, correct predictions)."""
    import torch
    import torch.nn.functional as F

    model = be.model
    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model.head(model.pool(model.prefix(x, model.num_blocks)))
            target = torch.from_numpy(np.asarray(y, dtype=np.int64)).to(logits.device)
            loss = float(F.cross_entropy(logits, target, reduction="sum"))
            correct = int((logits.argmax(1) == target).sum())
    finally:
        model.train(was)
    return loss, correct
