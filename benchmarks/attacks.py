"""A device that keeps attacking inside the bounds, round after round, with the defences off and on.

Each scenario is one device (``client-001``) of the fleet doing one thing every round, in-process
(the loopback transport carries the real encoded bytes; the attacks are on values and claims, not
on the transport, which benchmarks/hostile.py covers):

* ``scaled``: its activations at 2.9x (under the 3x activation bound);
* ``label_flip``: its labels flipped (y -> C-1-y) at normal scale; ``label_flip_scaled``: and at 2.9x;
* ``sign_flip``: its update is the round's global weights minus 4.9x its own change (under the 5x bound);
* ``drag``: its activations x 1e-3 (dragging the activation bound of the others down);
* ``sample_lie``: it claims 10^9 samples, the fleet bringing its own data (counts unverified),
  with its update sign-flipped as above (the claim is what makes one update weigh);
* ``forged_eval``: it reports ``eval_acc = 1.0`` for its held-out slice (whole-model devices, FedAvg);
* ``absent``: no attack, the device quarantined before round 1 (its data never trains): what a defence
  that catches the attacker at once, and leaves its data out with it, ends at.

"off" is the bounds alone (``--aggregation mean --sample-cap 0 --quarantine 0``); "on" adds
``--sample-cap 3 --quarantine 1`` (the anomaly scores leave a device out within the round, quarantine
after two such rounds) and ``--on-aggregation`` (mean; median, trimmed_mean, norm_bounded, krum). The
regime (momentum 0.9, 6 rounds, every batch: 0.939 and 0.944 clean on the tuning seeds 100 and 101) is
one where a clean run has converged enough that 2 points can be read. Every run is paired with the
clean run of the same seed and defences::

    python benchmarks/attacks.py                                  # every scenario, 5 devices, seeds 0-2
    python benchmarks/attacks.py --scenarios scaled,drag --clients 10 --seeds 0 --json out.json
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
SCENARIOS = ("clean", "absent", "scaled", "label_flip", "label_flip_scaled", "sign_flip", "drag", "sample_lie", "forged_eval")
DEFENCES = {"off": {"aggregation": "mean", "sample_cap": 0.0, "quarantine": 0.0},
            "on": {"aggregation": "mean", "sample_cap": 3.0, "quarantine": 1.0}}


def config(scenario: str, defences: str, *, seed: int, clients: int, rounds: int, width: float,
           max_batches: int, server_copies: str, momentum: float = 0.0, local_epochs: int = 1,
           partition: str = "iid", alpha: float = 0.5) -> RunConfig:
    """The run: digits, a narrow resnet18_cifar at split 1 (FedAvg with a held-out slice for ``forged_eval``)."""
    fedavg = scenario == "forged_eval"
    return RunConfig(dataset="digits", clients=clients, rounds=rounds, model="resnet18_cifar", width=width,
                     seed=seed, device="cpu", strategy="fedavg" if fedavg else "static", split=1,
                     server_copies=server_copies, eval_holdout=0.2 if fedavg else 0.0,
                     partition=partition, **({"alpha": alpha} if partition != "iid" else {}),
                     eval_every=1 if fedavg else rounds,  # the final test figure (forged_eval: each round's)
                     train=TrainConfig(local_epochs=local_epochs, batch_size=32, max_batches=max_batches,
                                       momentum=momentum),
                     **DEFENCES[defences])


class Attacker:
    """Wraps the attacker's Peer: rewrites what it sends as the scenario says, every round."""

    def __init__(self, sim: Simulation, scenario: str, num_classes: int = 10) -> None:
        self.sim, self.scenario, self.num_classes = sim, scenario, num_classes
        co = sim.coordinator
        if scenario == "absent":  # the reference of a perfect catch: the device is out from the start
            co.anomaly.quarantined[ATTACKER] = "absent: the benchmark's reference"
        if scenario == "sample_lie":  # the fleet brings its own data: every count is a claim
            co.unverified = set(co.clients)
            co.clients[ATTACKER] = 10**9
        client = next(c for c in sim.clients if c.cid == ATTACKER)
        client.peer.call = self._wrap(client.peer.call)

    def _wrap(self, call: Any) -> Any:
        def wrapped(dst: str, kind: str, rnd: int, body: dict[str, Any], *a: Any, **k: Any) -> Any:
            return call(dst, kind, rnd, self.rewrite(kind, body), *a, **k)
        return wrapped

    def rewrite(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        s = self.scenario
        if kind == "activation":
            z, y = body["z"], body["y"]
            if s in ("scaled", "label_flip_scaled"):
                z = (z * 2.9).astype(z.dtype)
            if s == "drag":
                z = (z * 1e-3).astype(z.dtype)
            if s in ("label_flip", "label_flip_scaled"):
                y = (self.num_classes - 1 - y).astype(y.dtype)
            return dict(body, z=z, y=y)
        if kind == "update" and s in ("sign_flip", "sample_lie"):
            ref = self.sim.coordinator._snapshot
            weights = {n: (ref[n].cpu().numpy() - 4.9 * (w - ref[n].cpu().numpy())).astype(w.dtype)
                       if w.dtype.kind == "f" else w for n, w in body["weights"].items()}
            # the update repeats the hello's count (coordinator/checks.py): the liar repeats its lie
            return dict(body, weights=weights, **({"num_samples": 10**9} if s == "sample_lie" else {}))
        if kind == "update" and s == "forged_eval" and "eval_acc" in body:
            return dict(body, eval_acc=1.0, eval_loss=0.0)
        return body


def simulate(scenario: str, defences: str, data: Any = None, **kw: Any) -> tuple[Simulation, list[dict[str, Any]]]:
    """One run under attack (``clean``: none): the simulation and its round records."""
    from fedsga_edge.data import load_dataset

    torch.manual_seed(kw["seed"])
    sim = Simulation(config(scenario, defences, **kw), data if data is not None else load_dataset("digits"))
    if scenario != "clean":
        Attacker(sim, scenario)
    return sim, list(sim.rounds())


def run(scenario: str, defences: str, **kw: Any) -> dict[str, Any]:
    """One run; its final figures and what the defences recorded."""
    _, records = simulate(scenario, defences, **kw)
    last = records[-1]
    held = [sorted(r.get("held_out", {})) for r in records]  # who left each round's aggregation
    out = {"final_acc": last["test_acc"], "quarantined": last.get("quarantined", {}),
           "anomaly": last.get("anomaly", {}).get(ATTACKER), "held_out": held,
           "honest_held_rounds": sum(len([d for d in h if d != ATTACKER]) for h in held),
           "clipped_activations": sum(sum(r.get("clipped", {}).get("activations", {}).values()) for r in records)}
    fed = [r for r in records if "fed_acc" in r]
    if fed:
        out |= {"fed_acc": fed[-1]["fed_acc"], "fed_acc_median": fed[-1]["fed_acc_median"],
                "test_acc_then": next(r["test_acc"] for r in records if r["round"] == fed[-1]["fed_model_round"])
                if fed[-1]["fed_model_round"] else None}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--defences", default="off,on")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--clients", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--width", type=float, default=0.125)
    ap.add_argument("--max-batches", type=int, default=0)
    ap.add_argument("--server-copies", default="per_client", choices=("shared", "per_client"))
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--local-epochs", type=int, default=1)
    ap.add_argument("--partition", default="iid", choices=("iid", "dirichlet"))
    ap.add_argument("--alpha", type=float, default=0.1)
    ap.add_argument("--on-aggregation", default=DEFENCES["on"]["aggregation"],
                    help="the aggregation rule of the defences-on runs")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--report", type=Path, nargs="+", help="only print the summary of these --json files")
    args = ap.parse_args(argv)
    if args.report:
        print(report(args.report))
        return {}
    kw = dict(clients=args.clients, rounds=args.rounds, width=args.width, max_batches=args.max_batches,
              server_copies=args.server_copies, momentum=args.momentum, local_epochs=args.local_epochs,
              partition=args.partition, alpha=args.alpha)
    DEFENCES["on"]["aggregation"] = args.on_aggregation
    results: dict[str, Any] = {"setup": vars(args) | {"json": str(args.json)}, "runs": {}}
    for d in args.defences.split(","):
        for sc in args.scenarios.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                r = run(sc, d, seed=seed, **kw)
                results["runs"][f"{d}/{sc}/{seed}"] = r
                print(f"{d:3s} {sc:18s} seed {seed}: acc {r['final_acc']:.4f} quarantined "
                      f"{sorted(r['quarantined'])} held out {r['held_out']} fed {r.get('fed_acc')} "
                      f"fed_median {r.get('fed_acc_median')}",
                      flush=True)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1, default=str))
    print(summary(results))
    return results


def _paired() -> Any:
    """benchmarks/accuracy.py's ``paired`` (mean paired difference, its standard error, wins)."""
    import importlib.util
    import sys

    mod = sys.modules.get("accuracy_bench")
    if mod is None:
        spec = importlib.util.spec_from_file_location("accuracy_bench", Path(__file__).parent / "accuracy.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["accuracy_bench"] = mod  # its dataclasses look their module up here
        spec.loader.exec_module(mod)
    return mod.paired


def summary(results: dict[str, Any]) -> str:
    """Per defence setting and scenario: final accuracy per seed, the paired difference to the clean run of
    the same defences (points, mean ± standard error, seeds under clean / seeds), the seeds on which the
    attacker was quarantined, and how many honest device-rounds were left out; last the defences' honest
    cost (clean, on minus off, paired)."""
    paired = _paired()
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for key, r in results["runs"].items():
        d, sc, seed = key.split("/")
        runs.setdefault((d, sc), []).append({"_seed": int(seed), "acc": r["final_acc"], **r})
    acc = lambda s: s["acc"]
    lines = ["| defences | scenario | final acc per seed | vs clean, points (mean ± SE; seeds not above clean / seeds) | quarantined "
             "| honest device-rounds left out |", "|---|---|---|---|---|---|"]
    for (d, sc), rs in sorted(runs.items()):
        rs = sorted(rs, key=lambda s: s["_seed"])
        # forged_eval runs FedAvg: its clean run is another strategy's, its figures are the claims (below)
        pr = paired(rs, runs[(d, "clean")], acc) if sc not in ("clean", "forged_eval") and (d, "clean") in runs \
            else None
        vs = "-" if pr is None else (f"{100 * pr['mean']:+.1f} ± {100 * (pr['se'] or 0):.1f} "
                                     f"({pr['n'] - pr['wins']}/{pr['n']})")
        quarantined = sum(ATTACKER in s.get("quarantined", {}) for s in rs)
        per_seed = ", ".join(f"{s['acc']:.3f}" for s in rs)
        lines.append(f"| {d} | {sc} | {per_seed} | {vs} "
                     f"| {quarantined}/{len(rs)} | {sum(s.get('honest_held_rounds', 0) for s in rs)} |")
    for (d, sc), rs in sorted(runs.items()):
        if sc == "forged_eval":
            lines.append(f"\n{d}/forged_eval per seed, fed_acc (weighted) / fed_acc_median (device-claimed) / "
                         "test_acc of the same model: " + ", ".join(
                             f"{s.get('fed_acc', 0):.3f} / {s.get('fed_acc_median', 0):.3f} / "
                             f"{s.get('test_acc_then') or 0:.3f}" for s in sorted(rs, key=lambda s: s["_seed"])))
    if ("on", "clean") in runs and ("off", "clean") in runs:
        pr = paired(runs[("on", "clean")], runs[("off", "clean")], acc)
        if pr is not None:
            lines.append(f"\nHonest cost (clean, on minus off, paired over {pr['n']} seeds): "
                         f"{100 * pr['mean']:+.2f} ± {100 * (pr['se'] or 0):.2f} points")
    return "\n".join(lines)


def report(paths: list[Path]) -> str:
    """``summary`` over the runs of several ``--json`` files (one grid run in pieces)."""
    merged: dict[str, Any] = {"runs": {}}
    for p in paths:
        merged["runs"].update(json.loads(p.read_text())["runs"])
    return summary(merged)


if __name__ == "__main__":
    main()
