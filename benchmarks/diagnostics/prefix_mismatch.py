"""Does the shared server copy fit the devices' own prefixes better than their average? (RESULTS.md, "BatchNorm context").

    python benchmarks/diagnostics/prefix_mismatch.py benchmarks/records/cifar/static/dir0.1/seed10 --every 5

During a round the shared server copy trains on activations from every device's *locally trained*
prefix; at round end the prefixes are averaged and the server copy is kept as it is, so the model
that is evaluated (averaged prefix + server suffix) pairs the suffix with a prefix it never saw. This
re-runs the simulation a finished benchmark run describes (its ``config.json``: same seed, same
result), keeps every device's update, and every ``--every`` rounds evaluates on a fixed test subset:
the global model, and each device's own prefix under the same suffix. If the devices' prefixes did
far better than their average, the mismatch would be the cost; if they do no better, it is not.
Prints one JSON line per evaluated round.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsga_edge.config import RunConfig
from fedsga_edge.simulation import Simulation
from fedsga_edge.tensors import image_batch


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir")
    ap.add_argument("--every", type=int, default=5, help="Evaluate every this many rounds (and the last).")
    ap.add_argument("--test-subset", type=int, default=2000, help="Test images per evaluation (fixed, seeded).")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    raw = json.loads(Path(args.run_dir, "config.json").read_text())
    cfg = RunConfig.from_record(raw)
    cfg.eval_every = cfg.rounds + 1  # no evaluation inside the rounds: this script does its own
    sim = Simulation(cfg)
    co, b = sim.coordinator, sim.bundle
    test_idx = np.sort(np.random.default_rng(0).choice(len(b.test), min(args.test_subset, len(b.test)), replace=False))
    labels = np.asarray(b.test.labels)[test_idx]

    @torch.no_grad()
    def accuracy() -> tuple[float, float]:
        """Accuracy and the largest class's share of the predictions."""
        co.model.eval()
        preds = []
        for s in range(0, len(test_idx), 256):
            x = image_batch(b.test.get_batch(test_idx[s:s + 256]), b.mean, b.std, co.device)
            preds.append(co.model.head(co.model.features(x)).argmax(1).cpu().numpy())
        p = np.concatenate(preds)
        return float((p == labels).mean()), float(np.bincount(p).max() / len(p))

    rows = []
    for t in range(1, cfg.rounds + 1):
        rec = sim.run_round(t)
        if t % args.every and t != cfg.rounds:
            continue
        state = {n: v.clone() for n, v in co.model.state_dict().items()}
        acc, top = accuracy()
        per_device = {}
        for cid, update in sorted(co.round.updates.items()):  # the round's accepted updates, kept until the next
            w = update["weights"]                                 # begin_round
            co.model.load_state_dict({n: torch.as_tensor(np.array(v)) for n, v in w.items()}, strict=False)
            per_device[cid] = accuracy()
            co.model.load_state_dict(state)
        accs = [a for a, _ in per_device.values()]
        row = {"round": t, "train_loss": rec.get("train_loss"), "global_acc": acc, "global_top_share": top,
               "own_prefix_acc_mean": float(np.mean(accs)) if accs else None,
               "own_prefix_acc_max": max(accs) if accs else None,
               "own_prefix_acc": {c: round(a, 4) for c, (a, _) in per_device.items()},
               "own_prefix_top_share": {c: round(s, 4) for c, (_, s) in per_device.items()}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
