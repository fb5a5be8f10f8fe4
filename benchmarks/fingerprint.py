"""Behaviour fingerprints: a few small digits runs, hashed, so a refactor can show it changed nothing.

Each run's metrics (timing fields removed) and final weights are hashed; the same code and seed on
the same machine give the same hashes. Run it before and after a change and compare the lines::

    python benchmarks/fingerprint.py            # prints one line per run
    python benchmarks/fingerprint.py --json F   # also writes them to F

Bit-identity holds on one machine and torch build (CPU kernels may differ elsewhere).

Every run takes its devices in the fixed order (``--device-order fixed``), the only order before the
per-round shuffled one became the default: so the eight runs' weights stay comparable with
``fingerprint_before.json`` (their metrics hashes changed when the records gained the client cost's parts,
the six runs other than FedSGA's kept their weights hashes). ``shuffled`` is the default
order's run (static); it has no line there, nor has ``mergesfl`` (held replies: one merged server step per
step of the fleet).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from pathlib import Path

import torch

from fedsga_edge.config import FedSGAConfig, RunConfig, TrainConfig
from fedsga_edge.simulation import run_simulation

TIMING = {"round_s", "wall_s"}

RUNS: dict[str, dict] = {
    "static": {"strategy": "static"},
    "fedsga": {"strategy": "fedsga", "fedsga": FedSGAConfig(cal_every=1)},
    "fedavg": {"strategy": "fedavg"},
    "per_client": {"strategy": "static", "server_copies": "per_client"},
    "bn_context": {"strategy": "static", "server_bn_context": 2, "server_lr": 0.03},
    "fedprox": {"strategy": "fedprox"},
    "resource": {"strategy": "resource"},
    "fedsga_noharm": {"strategy": "fedsga", "fedsga": FedSGAConfig(cal_every=1, harmonizer=False)},
    "shuffled": {"strategy": "static", "device_order": "shuffled"},
    "mergesfl": {"strategy": "mergesfl", "server_copies": "shared"},
}


def config(name: str) -> RunConfig:
    extra = {"device_order": "fixed"} | RUNS[name]
    return RunConfig(dataset="digits", partition="dirichlet", alpha=0.3, clients=3, rounds=3, width=0.25, seed=0,
                     device="cpu", train=TrainConfig(local_epochs=1, max_batches=3), **extra)


def fingerprint(name: str) -> dict[str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        run_simulation(config(name), tmp)
        records = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        for rec in records:
            for key in TIMING:
                rec.pop(key, None)
        ckpt = torch.load(Path(tmp) / "checkpoint.pt", weights_only=False)
    h = hashlib.sha256()
    for key, value in sorted(ckpt["model"].items()):
        h.update(key.encode())
        h.update(value.detach().cpu().numpy().tobytes())
    final = next((r["test_acc"] for r in reversed(records) if "test_acc" in r), None)
    return {"metrics": hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()[:16],
            "weights": h.hexdigest()[:16], "final_acc": final}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", default=",".join(RUNS), help="comma-separated subset of " + ", ".join(RUNS))
    ap.add_argument("--json", type=Path, help="also write the fingerprints here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {}
    for name in args.runs.split(","):
        out[name] = fingerprint(name)
        print(f"{name:<11} metrics={out[name]['metrics']} weights={out[name]['weights']} "
              f"final_acc={out[name]['final_acc']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
