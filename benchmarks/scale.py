"""The ray engine against the in-process engine, and a large virtual fleet on Ray.

``compare`` runs the same seeded simulation twice in this process, in-process and with ``--engine ray``
(fedsga_edge/rayengine.py), checks that the metrics and the final global weights are identical, and
prints both engines' round seconds, their ratio, and what Ray adds around the rounds (starting Ray and
the actors). ``fleet`` runs ``--devices`` virtual devices on Ray (digits tiled so that each device holds
``--per-device`` samples) and prints the actors, the start-up and the round seconds.

    python benchmarks/scale.py compare --devices 10 --rounds 3
    python benchmarks/scale.py fleet --devices 1000 --rounds 1

Both use one torch thread per process (the driver and each actor): the bit-identical results need the
same thread count on both sides (torch's float sums depend on it).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedsga_edge.config import FedSGAConfig, RunConfig, TrainConfig  # noqa: E402
from fedsga_edge.rayengine import RayEngine  # noqa: E402
from fedsga_edge.simulation import Simulation  # noqa: E402


def config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(strategy=args.strategy, dataset="digits", clients=args.devices, rounds=args.rounds,
                     model="resnet18_cifar", width=args.width, seed=0, device="cpu", eval_every=args.rounds,
                     fedsga=FedSGAConfig(),
                     train=TrainConfig(local_epochs=1, batch_size=args.batch_size, max_batches=args.max_batches))


def run(cfg: RunConfig, data: Callable[[], Any], actors: int | None = None) -> Run:
    """One run, timed as the command line runs it: from the engine's creation (with ``actors`` not None, a
    ``RayEngine``: Ray starts on a thread of its own), through loading the data (``data()``), the driver's
    setup and every round."""
    started = time.perf_counter()
    ray = RayEngine(actors=actors) if actors is not None else None
    try:
        sim = Simulation(cfg, data(), engine=ray)
        setup = time.perf_counter() - started
        records = list(sim.rounds())
        weights = {n: v.clone() for n, v in sim.model.state_dict().items()}
        total = time.perf_counter() - started
        return Run(records, weights, setup, total, ray, len(ray.pool) if ray is not None else 0)
    finally:
        if ray is not None:
            ray.close()


@dataclasses.dataclass
class Run:
    records: list[dict[str, Any]]
    weights: dict[str, Any]
    setup_s: float  # from the start to the first round: data, partition, models, devices (and Ray's wait)
    total_s: float
    engine: RayEngine | None
    actors: int


def identical(a: Run, b: Run) -> bool:
    measured = ("wall_s", "round_s")  # host seconds, not results
    strip = [[{k: v for k, v in r.items() if k not in measured} for r in run.records] for run in (a, b)]
    import torch

    return strip[0] == strip[1] and all(torch.equal(a.weights[n], b.weights[n]) for n in a.weights)


def compare(args: argparse.Namespace, data: Callable[[], Any]) -> None:
    cfg = config(args)
    local, remote = run(cfg, data), run(cfg, data, args.actors)
    e, actors = remote.engine, remote.actors
    assert e is not None
    lr, rr = (sum(r["wall_s"] for r in x.records) for x in (local, remote))
    print(f"{args.devices} devices, {args.rounds} rounds, {args.strategy}, identical metrics and weights: "
          f"{identical(local, remote)}; load average {os.getloadavg()[0]:.1f}")
    print(f"in-process: setup {local.setup_s:.2f} s, rounds {lr:.2f} s, total {local.total_s:.2f} s")
    print(f"ray: setup {remote.setup_s:.2f} s, rounds {rr:.2f} s, total {remote.total_s:.2f} s")
    print(f"  Ray and {actors} actors started in {e.init_s:.2f} s on their own thread, beside the driver's setup; "
          f"the actors held their devices at {e.setup_s:.2f} s; the driver waited {e.waited_s:.2f} s for them")
    print(f"ray / in-process, rounds: {rr / lr:.2f}x; setup: {remote.setup_s / local.setup_s:.2f}x; "
          f"whole run: {remote.total_s / local.total_s:.2f}x")
    for a, b in zip(local.records, remote.records):
        print(f"  round {a['round']}: in-process {a['wall_s']:.2f} s, ray {b['wall_s']:.2f} s")


def tiled(bundle: Any, devices: int, per_device: int) -> Any:
    """digits' training set repeated until each of ``devices`` devices can hold ``per_device`` samples."""
    from fedsga_edge.data.imagesets import ArrayImageSet

    reps = -(-devices * per_device // len(bundle.train.labels))
    idx = np.tile(np.arange(len(bundle.train.labels)), reps)
    train = ArrayImageSet(np.asarray(bundle.train.images)[idx], np.asarray(bundle.train.labels)[idx])
    return dataclasses.replace(bundle, train=train)


def fleet(args: argparse.Namespace, data: Callable[[], Any]) -> None:
    cfg = config(args)
    out = run(cfg, lambda: tiled(data(), args.devices, args.per_device), args.actors)
    e, actors = out.engine, out.actors
    assert e is not None
    print(f"{args.devices} virtual devices on {actors} actors, {args.devices * args.per_device}+ samples: Ray and "
          f"actors started in {e.init_s:.1f} s, holding their devices at {e.setup_s:.1f} s (the driver waited "
          f"{e.waited_s:.1f} s), total {out.total_s:.1f} s")
    for r in out.records:
        print(f"  round {r['round']}: {r['wall_s']:.1f} s, {len(r['splits'])} updates, {len(r['failures'])} "
              f"failures, train_loss {r['train_loss']:.3f}, test_acc {r.get('test_acc', float('nan')):.4f}, "
              f"bytes {(r['bytes_up'] + r['bytes_down']) / 1e6:.1f} MB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=("compare", "fleet"))
    ap.add_argument("--devices", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--strategy", default="static")
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--max-batches", type=int, default=3)
    ap.add_argument("--actors", type=int, default=0, help="0: one per CPU")
    ap.add_argument("--per-device", type=int, default=12, help="fleet: samples per device")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    from fedsga_edge.data import load_dataset

    print("command: python benchmarks/scale.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    (compare if args.what == "compare" else fleet)(args, lambda: load_dataset("digits"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
