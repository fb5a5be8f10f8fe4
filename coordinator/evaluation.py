"""How the coordinator measures the global model: test accuracy under the strategy's heads."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsga_edge.method import reference_index
from fedsga_edge.tensors import image_batch

__all__ = ["headline_split", "evaluate"]


def headline_split(split_samples: dict[int, int], num_splits: int) -> int:
    """The depth embedding the headline accuracy uses: the split most trained so far (by samples),
    ties to the shallower; p_ref before any split training (docs/method.md, "Evaluation")."""
    if not split_samples or set(split_samples) == {0}:
        return reference_index(num_splits)
    split = {k: n for k, n in split_samples.items() if k > 0}
    return min(split, key=lambda k: (-split[k], k)) if split else reference_index(num_splits)


@torch.no_grad()
def evaluate(model: Any, head: nn.Module, strategy: Any, headline: int, num_classes: int, images: Any,
             mean: tuple, std: tuple, device: torch.device, batch_size: int = 256) -> dict[str, Any]:
    """Accuracy and loss of the global model under every depth embedding the strategy evaluates
    (no prompts: they are private). Prefix + suffix is the whole backbone for any split, so the
    pooled features are computed once; only the strategy's per-depth head can differ. A strategy
    with one head for every split (key 0) is reported under every split."""
    model.eval()
    head.eval()
    K = model.num_splits
    correct: dict[int, int] = {}
    loss_sum: dict[int, float] = {}
    shown: int | None = None
    # how often the headline model predicts each class: a collapse onto few classes shows here first
    predicted = torch.zeros(num_classes, dtype=torch.long)
    n = len(images)
    for start in range(0, n, batch_size):
        idx = np.arange(start, min(n, start + batch_size))
        x = image_batch(images.get_batch(idx), mean, std, device)
        y = torch.from_numpy(np.asarray(images.labels[idx], dtype=np.int64)).to(device)
        by_k = strategy.eval_logits(model, model.features(x))
        if shown is None:
            shown = 0 if 0 in by_k else headline
        for k, logits in by_k.items():
            loss_sum[k] = loss_sum.get(k, 0.0) + float(F.cross_entropy(logits, y, reduction="sum"))
            pred = logits.argmax(1)
            correct[k] = correct.get(k, 0) + int((pred == y).sum())
            if k == shown:
                predicted += torch.bincount(pred.cpu(), minlength=num_classes)
    if shown is None:
        raise ValueError("evaluate needs at least one test image")
    ks = sorted(correct)
    acc = {k: correct[k] / n for k in ks}
    loss = {k: loss_sum[k] / n for k in ks}
    by_split = {str(k): acc[k] for k in ks} if ks != [0] else {str(k): acc[0] for k in range(1, K + 1)}
    share = [round(int(c) / n, 4) for c in predicted]
    return {"test_acc": acc[shown], "test_loss": loss[shown], "test_acc_by_split": by_split,
            "eval_split": shown if shown else None, "test_pred_share": share}
