"""Is a run's accuracy held back by its BatchNorm running statistics? (RESULTS.md, "BatchNorm context").

    python benchmarks/diagnostics/bn_recalibration.py benchmarks/records/cifar/tuning/lr0.1-cosine/fedavg/iid/seed4

Re-runs the simulation a finished benchmark run describes (its ``config.json``; same seed, same
result), then evaluates the final global model (a) as it is, (b) on the training images it was
trained on, and (c) after recomputing every BatchNorm layer's running statistics over IID-shuffled
batches of those training images (cumulative average, no weight changes). Prints one JSON line with
the accuracies and the test predictions' class histogram. If (c) were far above (a), the statistics
(not the weights) would be the problem; if (b) is as low as (a), the model is under-fit or biased,
not over-fit.

    python benchmarks/diagnostics/bn_recalibration.py RUN --every-eval [--batches 40]

does it at every round the run evaluated (its metrics.jsonl), on the full test set: the model as it is
(at the rounds the run evaluated on the full test set this must equal its logged figure: the check
that the re-run is the run) and with its statistics recomputed over ``--batches`` shuffled training
batches, on a copy of the statistics that is put back before the next round (training is untouched).
One JSON line per round, then the headline (mean over the run's headline rounds) both ways: whether
the round-to-round swings and the seed spread are the evaluated model's statistics. An approximation
of what a deployment could do (the devices would have to recompute them on their own data; the
coordinator here reads the training images directly).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import torch
from torch import nn

from fedsga_edge.config import RunConfig
from fedsga_edge.simulation import Simulation
from fedsga_edge.tensors import image_batch


def rerun_config(run_dir: str) -> RunConfig:
    """The finished run's config (its ``config.json``; the benchmark's own keys dropped), evaluating only at the end:
    the diagnostic evaluates itself, and evaluations do not change training."""
    raw = json.loads(open(f"{run_dir}/config.json").read())
    cfg = RunConfig.from_record(raw)
    cfg.eval_every = cfg.rounds
    return cfg


def main(run_dir: str) -> dict[str, Any]:
    torch.set_num_threads(1)
    cfg = rerun_config(run_dir)
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
    perm = np.random.default_rng(0).permutation(train_idx)
    recomputed(co.model, co.model.features, (image_batch(b.train.get_batch(perm[s:s + 64]), b.mean, b.std, co.device)
                                             for s in range(0, len(perm) - 63, 64)))
    out["test_bn_recomputed"], out["test_predictions_per_class_bn_recomputed"] = accuracy(b.test, test_idx)
    out["train_bn_recomputed"], _ = accuracy(b.train, train_idx)
    return out


def recomputed(model: nn.Module, features: Any, batches: Any) -> dict[str, torch.Tensor]:
    """Recompute every BatchNorm statistic of ``model`` over ``batches`` (cumulative, train mode, no gradients);
    returns the statistics it had, for :func:`put_back`."""
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    saved = {k: v.clone() for k, v in model.state_dict().items() if "running_" in k or "num_batches" in k}
    saved["_momenta"] = [m.momentum for m in bns]  # type: ignore[assignment]
    was = model.training
    for m in bns:
        m.reset_running_stats()
        m.momentum = None
    model.train()
    with torch.no_grad():
        for x in batches:
            features(x)
    model.train(was)
    return saved


def put_back(model: nn.Module, saved: dict[str, Any]) -> None:
    bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for m, momentum in zip(bns, saved.pop("_momenta")):
        m.momentum = momentum
    model.load_state_dict(saved, strict=False)


def every_eval(run_dir: str, n_batches: int = 40) -> dict[str, Any]:
    """The run again; at each round it evaluated, the full test accuracy as is and with statistics recomputed."""
    torch.set_num_threads(1)
    cfg = rerun_config(run_dir)
    logged = {}
    for line in open(f"{run_dir}/metrics.jsonl"):
        r = json.loads(line)
        acc = r.get("test_acc", r.get("test_acc_full", r.get("test_acc_subset")))
        if acc is not None:
            logged[r["round"]] = (acc, "test_acc" in r or "test_acc_full" in r)
    full_rounds = sorted(t for t, (_, full) in logged.items() if full)
    window = full_rounds  # the benchmark evaluates on the full test set exactly at its headline's rounds
    sim = Simulation(cfg)
    co, b = sim.coordinator, sim.bundle
    train_idx = np.concatenate(sim.parts)
    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    for rec in sim.rounds():
        t = rec["round"]
        if t not in logged:
            continue
        as_is = co.evaluate(b.test, b.mean, b.std)["test_acc"]
        pick = rng.permutation(train_idx)[:64 * n_batches]
        batches = (image_batch(b.train.get_batch(pick[s:s + 64]), b.mean, b.std, co.device) for s in range(0, len(pick), 64))
        saved = recomputed(co.model, co.model.features, batches)
        recal = co.evaluate(b.test, b.mean, b.std)
        put_back(co.model, saved)
        row = {"round": t, "test_acc": as_is, "test_acc_bn_recomputed": recal["test_acc"],
               "largest_class_share_bn_recomputed": max(recal.get("test_pred_share", [0]) or [0]),
               "logged": logged[t][0] if logged[t][1] else None}
        rows.append(row)
        print(json.dumps(row), flush=True)
    mean = lambda key: float(np.mean([r[key] for r in rows if r["round"] in window]))  # noqa: E731
    summary = {"run": run_dir, "headline_rounds": window, "headline": mean("test_acc"),
               "headline_bn_recomputed": mean("test_acc_bn_recomputed"),
               "reproduced": all(r["logged"] is None or abs(r["logged"] - r["test_acc"]) < 1e-9 for r in rows)}
    print(json.dumps(summary), flush=True)
    return summary | {"rows": rows}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--every-eval", action="store_true", help="At every round the run evaluated, both ways.")
    ap.add_argument("--batches", type=int, default=40, help="Training batches of 64 for the recomputed statistics.")
    args = ap.parse_args()
    if args.every_eval:
        every_eval(args.run_dir, args.batches)
    else:
        print(json.dumps(main(args.run_dir)))
