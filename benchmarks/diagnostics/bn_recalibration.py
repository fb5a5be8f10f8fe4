"""Is a run's accuracy held back by its BatchNorm running statistics? (RESULTS.md, "Thirty rounds").

    python benchmarks/diagnostics/bn_recalibration.py benchmarks/runs_cpu_r30_static/static/dir0.1/seed2

Re-runs the simulation a finished benchmark run describes (its ``config.json``; same seed, same
result), then evaluates the final global model (a) as it is, (b) on the training images it was
trained on, and (c) after recomputing every BatchNorm layer's running statistics over IID-shuffled
batches of those training images (cumulative average, no weight changes). Prints one JSON line with
the accuracies and the test predictions' class histogram. If (c) were far above (a), the statistics
(not the weights) would be the problem; if (b) is as low as (a), the model is under-fit or biased,
not over-fit.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsga_edge.config import RunConfig
from fedsga_edge.simulation import Simulation
from fedsga_edge.tensors import image_batch


def main(run_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    raw = json.loads(open(f"{run_dir}/config.json").read())
    keys = {f.name for f in dataclasses.fields(RunConfig)}
    cfg = RunConfig.from_dict({k: v for k, v in raw.items() if k in keys})
    cfg.eval_every = cfg.rounds
    sim = Simulation(cfg)
    for rec in sim.rounds():
        pass
    co, b = sim.coordinator, sim.bundle
    train_idx = np.concatenate(sim.parts)

    @torch.no_grad()
    def accuracy(images: Any, idx: np.ndarray) -> tuple[float, list[int]]:
        co.model.eval()
        correct, preds = 0, []
        for s in range(0, len(idx), 256):
            j = idx[s:s + 256]
            logits = co.model.head(co.model.features(image_batch(images.get_batch(j), b.mean, b.std, co.device)))
            p = logits.argmax(1).cpu().numpy()
            preds.append(p)
            correct += int((p == np.asarray(images.labels[j])).sum())
        return correct / len(idx), np.bincount(np.concatenate(preds), minlength=len(b.classes)).tolist()

    test_idx = np.arange(len(b.test))
    out: dict[str, Any] = {"run": run_dir, "logged_final_acc": rec.get("test_acc")}
    out["test"], out["test_predictions_per_class"] = accuracy(b.test, test_idx)
    out["train"], _ = accuracy(b.train, train_idx)
    for m in co.model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.reset_running_stats()
            m.momentum = None  # cumulative: every batch alike
    co.model.train()
    perm = np.random.default_rng(0).permutation(train_idx)
    with torch.no_grad():
        for s in range(0, len(perm) - 63, 64):
            co.model.features(image_batch(b.train.get_batch(perm[s:s + 64]), b.mean, b.std, co.device))
    out["test_bn_recomputed"], out["test_predictions_per_class_bn_recomputed"] = accuracy(b.test, test_idx)
    out["train_bn_recomputed"], _ = accuracy(b.train, train_idx)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
