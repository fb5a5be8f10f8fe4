"""Finite-value poisoning: one device sends one activation at X times the honest maximum.

The values are finite and under the coordinator's absolute bound (1e6), so only bounded influence
(docs/protocol.md, "Bounded influence": activation samples clipped to ``--clip-activations`` times
the fleet's median norm) stands between them and the shared server blocks. For each X the run is
made with the bounds on (the defaults) and off (``--clip-activations 0 --clip-updates 0``), and
compared with the clean run of the same seed::

    python benchmarks/poisoning.py                      # X = 10, 100, 1e4 in round 2, seeds 0-2
    python benchmarks/poisoning.py --scales 10,1e3 --seeds 0,1 --json out.json

The setup is the hostile benchmark's (digits, resnet18_cifar at width 0.25, static split,
per-client server copies, batch 32) with every batch and three rounds, so that the clean model learns
something; the attacker is an ordinary device (``client-001``) whose first activation of the
attack round is replaced. In-process (the loopback transport carries the real encoded bytes): the
attack is on the values, not on the transport, which benchmarks/hostile.py covers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsga_edge.config import RunConfig, TrainConfig
from fedsga_edge.simulation import Simulation

ATTACKER = "client-001"


def config(seed: int, rounds: int, clip: float | None, server_copies: str) -> RunConfig:
    """The run; ``clip`` None keeps the bounds' defaults, a number sets both (0: bounded influence off)."""
    cfg = RunConfig(dataset="digits", clients=3, rounds=rounds, model="resnet18_cifar", width=0.25, seed=seed,
                    device="cpu", strategy="static", server_copies=server_copies,
                    train=TrainConfig(local_epochs=1, batch_size=32))
    if clip is not None:
        cfg.clip_activations = cfg.clip_updates = clip
    return cfg


class Poisoner:
    """Wraps every device's Peer: tracks the honest maximum |z|, and replaces the attacker's first
    activation of ``round`` by the same pattern scaled to ``scale`` x that maximum."""

    def __init__(self, sim: Simulation, scale: float | None, round: int) -> None:
        self.scale, self.round, self.honest_max, self.sent = scale, round, 0.0, None
        for client in sim.clients:
            peer = client.peer
            peer.call = self._wrap(client.cid, peer.call)

    def _wrap(self, cid: str, call: Any) -> Any:
        def wrapped(dst: str, kind: str, rnd: int, body: dict[str, Any], *a: Any, **k: Any) -> Any:
            if kind == "activation":
                z = body["z"]
                if cid == ATTACKER and self.scale and rnd == self.round and self.sent is None:
                    z = (z / np.abs(z).max() * self.scale * self.honest_max).astype(z.dtype)
                    body = dict(body, z=z)
                    self.sent = float(np.abs(z).max())
                else:
                    self.honest_max = max(self.honest_max, float(np.abs(z).max()))
            return call(dst, kind, rnd, body, *a, **k)
        return wrapped


def run(seed: int, rounds: int, scale: float | None, clip: float | None, attack_round: int,
        server_copies: str) -> dict[str, Any]:
    from fedsga_edge.data import load_dataset

    torch.manual_seed(seed)
    sim = Simulation(config(seed, rounds, clip, server_copies), load_dataset("digits"))
    poison = Poisoner(sim, scale, attack_round)
    records = list(sim.rounds())
    clipped = sum(sum(r.get("clipped", {}).get("activations", {}).values()) for r in records)
    params = max(float(v.abs().max()) for v in sim.model.state_dict().values() if v.is_floating_point())
    return {"final_acc": records[-1]["test_acc"], "honest_max": poison.honest_max, "sent_max": poison.sent,
            "clipped_samples": clipped, "max_abs_param": params}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="10,100,1e4", help="attack sizes, times the honest maximum |z|")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--attack-round", type=int, default=2)
    ap.add_argument("--server-copies", default="per_client", choices=("shared", "per_client"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    scales = [float(s) for s in args.scales.split(",")]
    out: dict[str, Any] = {"rows": []}
    print(f"{'seed':>4} {'attack':>8} {'bound':>5} {'final_acc':>9} {'vs clean':>9} {'clipped':>7} {'max|param|':>10}")
    for seed in (int(s) for s in args.seeds.split(",")):
        clean = run(seed, args.rounds, None, None, args.attack_round, args.server_copies)
        print(f"{seed:>4} {'clean':>8} {'on':>5} {clean['final_acc']:>9.4f} {'':>9} {clean['clipped_samples']:>7} "
              f"{clean['max_abs_param']:>10.3g}", flush=True)
        out["rows"].append({"seed": seed, "scale": None, "bound": True, **clean})
        for scale in scales:
            for bound, clip in (("on", None), ("off", 0.0)):
                r = run(seed, args.rounds, scale, clip, args.attack_round, args.server_copies)
                diff = 100 * (r["final_acc"] - clean["final_acc"])
                print(f"{seed:>4} {scale:>7g}x {bound:>5} {r['final_acc']:>9.4f} {diff:>+8.2f}p {r['clipped_samples']:>7} "
                      f"{r['max_abs_param']:>10.3g}", flush=True)
                out["rows"].append({"seed": seed, "scale": scale, "bound": bound == "on", "diff_points": diff, **r})
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
