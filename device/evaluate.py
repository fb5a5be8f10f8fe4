"""Federated evaluation on the device: the global model on the device's held-out slice.

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
  ``eval_acc`` in its update;
* under FedBABU a whole-model device also reports ``eval_loss_finetuned`` and ``eval_acc_finetuned``: a
  copy of the received head fine-tuned on its training data, on the same slice (``finetuned_evaluation``).

After the last round a ``round_start`` with ``evaluate_only`` asks for the same evaluation of the model the
run ended with, and nothing else (the final evaluation: device/role.py returns the figures as its update).

docs/protocol.md, "Federated evaluation", says what this reveals. Only numpy is imported here; the torch
backend's forward is imported where it runs, so the torch-free device never loads torch.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

import numpy as np

from fedsga_edge.batches import cut_batches

from .seeds import stable_hash

__all__ = ["EVAL_SPAWN", "FINETUNE_SPAWN", "hold_out", "held_out_evaluation", "finetuned_evaluation",
           "finetune_rng"]

EVAL_SPAWN = 0xE7A1  # the held-out slice's own stream: it draws nothing from the batch order's
FINETUNE_SPAWN = 0xF1E7  # FedBABU's fine-tuning batch order: its own stream per round, none of the training's


def hold_out(indices: np.ndarray, fraction: float, seed: int, cid: str) -> tuple[np.ndarray, np.ndarray]:
    """(indices to train on, indices held out): ``fraction`` of them, at least 2, drawn by (seed, cid).

    Both keep ``indices``' order. ValueError when the share is too small to hold 2 out and train on 2."""
    indices = np.asarray(indices, dtype=np.int64)
    if fraction <= 0:
        return indices, np.empty(0, dtype=np.int64)
    n = len(indices)
    take = max(2, int(round(fraction * n)))
    if n - take < 2:
        raise ValueError(f"{cid} has {n} samples: too few to hold {take} out for evaluation (--eval-holdout "
                         f"{fraction:g}) and train on at least 2; lower --eval-holdout or give it more data")
    chosen = np.zeros(n, dtype=bool)
    chosen[np.random.default_rng([seed, stable_hash(cid), EVAL_SPAWN]).choice(n, size=take, replace=False)] = True
    return indices[~chosen], indices[chosen]


_Steps = Generator[tuple[str, dict[str, Any]], Any, dict[str, Any]]


def held_out_evaluation(client: Any, plan: Any, expect: Callable[[Any, str], Any]) -> _Steps:
    """The round's evaluation requests (a split device) or none (a whole-model device); returns what the
    update reports. ``client`` is the ``SplitClient``, ``plan`` its round plan (weights loaded, split chosen),
    ``expect`` the role's reply check (an error reply ends the round like any refused request)."""
    held = getattr(client.data, "eval_indices", None)
    if held is None or not len(held):
        return {}
    be = client.backend
    batches = cut_batches(np.asarray(held), plan.train.batch_size)
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


def finetune_rng(client: Any, t: int) -> np.random.Generator:
    """Round ``t``'s fine-tuning batch order: a child of the device's seed (the run's seed and its id), so it
    is the same in every run with that seed and draws nothing from the training's batch order."""
    ss = getattr(client.rng.bit_generator, "seed_seq", None)
    if ss is None:
        ss = np.random.SeedSequence(stable_hash(client.cid))
    return np.random.default_rng(np.random.SeedSequence(ss.entropy, spawn_key=(*ss.spawn_key, FINETUNE_SPAWN, t)))


def finetuned_evaluation(client: Any, plan: Any, epochs: int, t: int) -> dict[str, Any]:
    """FedBABU's personalised figure of the received model (docs/method.md, "FedBABU"): a copy of its head
    trained for ``epochs`` epochs on the device's training data (``client.data.indices``, never the held-out
    slice; each epoch a fresh order from ``finetune_rng``, in batches of ``batch_size``, at most ``max_batches``
    of them; plain SGD at the round's lr, momentum and weight decay), the body fixed as received (eval mode:
    the features the head is scored on), then scored on the held-out slice in the batches of the global figure.
    {} without a slice or outside a whole-model round. The device's model, its optimizer and its random
    streams are left as they were: the copy is dropped. 0 epochs scores the received head itself."""
    held = getattr(client.data, "eval_indices", None)
    if held is None or not len(held) or not plan.full:
        return {}
    tc = plan.train
    train = np.asarray(client.data.indices)
    rng = finetune_rng(client, t)
    order = []  # per epoch, its batches as positions in ``train``
    for _ in range(epochs):
        batches = cut_batches(rng.permutation(len(train)), tc.batch_size, tc.batching)
        order.append(batches[: tc.max_batches] if tc.max_batches else batches)
    loss_sum, correct = _finetuned_eval(client, plan, train, order, cut_batches(np.asarray(held), tc.batch_size))
    n = len(held)
    return {"eval_loss_finetuned": loss_sum / n, "eval_acc_finetuned": correct / n}


def _finetuned_eval(client: Any, plan: Any, train: np.ndarray, order: list[list[np.ndarray]],
                    held: list[np.ndarray]) -> tuple[float, int]:
    """The torch part of ``finetuned_evaluation``: (summed cross-entropy, correct) of the fine-tuned head."""
    import copy

    import torch
    import torch.nn.functional as F

    model, tc = client.backend.model, plan.train
    was = model.training
    model.eval()
    try:
        def features(idx: np.ndarray) -> tuple[Any, Any]:
            x, y = client._inputs(idx, augment=False)
            with torch.no_grad():
                f = model.pool(model.prefix(x, model.num_blocks))
            return f, torch.from_numpy(np.asarray(y, dtype=np.int64)).to(f.device)

        head = copy.deepcopy(model.head)
        if order:
            used = np.unique(np.concatenate([b for epoch in order for b in epoch]))  # the samples some batch takes
            row = np.full(len(train), -1, dtype=np.int64)
            row[used] = np.arange(len(used))
            parts = [features(train[used[i : i + tc.batch_size]]) for i in range(0, len(used), tc.batch_size)]
            feats, labels = torch.cat([f for f, _ in parts]), torch.cat([y for _, y in parts])
            opt = torch.optim.SGD(head.parameters(), lr=tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
            head.train()
            for epoch in order:
                for b in epoch:
                    r = torch.from_numpy(row[b]).to(feats.device)
                    opt.zero_grad(set_to_none=True)
                    F.cross_entropy(head(feats[r]), labels[r]).backward()
                    opt.step()
        head.eval()
        loss, correct = 0.0, 0
        with torch.no_grad():
            for idx in held:
                f, y = features(idx)
                logits = head(f)
                loss += float(F.cross_entropy(logits, y, reduction="sum"))
                correct += int((logits.argmax(1) == y).sum())
    finally:
        model.train(was)
    return loss, correct


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
