"""The per-client server copies on one rank and on several, side by side: the server side's seconds per round.

Both runs drive the coordinator's server side alone (no devices, no transport): every device of the round
sends ``--batches`` activations at split ``--split`` (random tensors of the interface's shape, seeded, the
same for both runs), each device's copy takes its steps, the copies are averaged. A round's server time runs
from ``begin_round`` to the end of ``end_round``: on one rank ``PerClientServer``, on ``--world-size`` ranks
``ShardedServer`` (coordinator/sharding.py) with the copies dealt over them. Every rank runs one torch thread.
The two run side by side, a round of one then the same round of the other, so both meet the same load. It
prints both times per round, their ratio, each rank's CPU seconds in the round (rank 0: this process; the
others: from /proc) and the largest difference of the averaged weights.

    nice python benchmarks/server_ranks.py --devices 20 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedsga_edge.config import RunConfig, TrainConfig  # noqa: E402
from fedsga_edge.runbuild import build_coordinator, plan_run  # noqa: E402
from fedsga_edge.serverranks import ServerRanks  # noqa: E402
from fedsga_edge.wire import Message  # noqa: E402


def config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(strategy="static", split=args.split, dataset="digits", clients=args.devices, rounds=args.rounds,
                     model="resnet18_cifar", width=args.width, seed=0, device="cpu", server_copies="per_client",
                     train=TrainConfig(local_epochs=1, batch_size=args.batch_size, max_batches=args.batches))


def activations(co: Any, args: argparse.Namespace) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    shape = co.model.interface_shape(co.model.depth_of(args.split))
    return {d: [(torch.randn(args.batch_size, *shape, generator=g),
                 torch.randint(0, co.num_classes, (args.batch_size,), generator=g)) for _ in range(args.batches)]
            for d in co.clients}


def server_round(co: Any, t: int, acts: dict[str, list[tuple[torch.Tensor, torch.Tensor]]],
                 split: int) -> tuple[float, float]:
    """One round of the server side alone: its wall seconds, and the CPU seconds of this process (rank 0)."""
    from fedsga_edge.coordinator.server_side import Activation

    side, devices = co.server, list(co.clients)
    snapshot = {n: v.detach().clone() for n, v in co.model.state_dict().items()}
    started, cpu = time.perf_counter(), time.process_time()
    side.set_lr_scale(1.0)
    side.begin_round(snapshot)
    for b in range(len(acts[devices[0]])):
        for d in devices:
            z, y = acts[d][b]
            side.submit(Activation(Message("activation", "bench", t, b + 1, d, {}), split, z.clone(), y, None, 0,
                                   None, None), co.strategy)
    while side.wait_held():
        side.release(set(devices), False, co.strategy)
    depth = co.model.depth_of(split)
    for d in devices:
        side.finish_device(d, depth)
    side.end_round(snapshot)
    return time.perf_counter() - started, time.process_time() - cpu


def _probe(args: argparse.Namespace, rounds: int, ready: Any = None, go: Any = None, out: Any = None) -> float:
    """Seconds per one-rank server round of this process (``ready``/``go``: start together with another)."""
    torch.set_num_threads(1)
    co = build_coordinator(plan_run(config(args))).coordinator
    acts = activations(co, args)
    server_round(co, 0, acts, args.split)  # warm
    if ready is not None:
        ready.set()
        go.wait()
    took = sum(server_round(co, t, acts, args.split)[0] for t in range(1, rounds + 1)) / rounds
    if out is not None:
        out.put(took)
    return took


def co_run(args: argparse.Namespace, rounds: int = 2) -> tuple[float, float]:
    """The machine's own limit on two ranks: a one-rank round alone, then while another process runs the same
    rounds (memory bandwidth and caches are shared; on a virtual machine the cores may be too)."""
    import multiprocessing as mp

    alone = _probe(args, rounds)
    ctx = mp.get_context("spawn")
    ready, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    other = ctx.Process(target=_probe, args=(args, rounds + 1, ready, go, out), daemon=True)
    other.start()
    ready.wait()
    go.set()
    together = _probe(args, rounds)
    out.get()
    other.join()
    return alone, together


def _cpu(pids: list[int]) -> float:
    """The CPU seconds (user and system) the processes ``pids`` have used so far."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--batches", type=int, default=4, help="activations per device per round")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--split", type=int, default=1)
    p.add_argument("--width", type=float, default=0.25)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--co-run", action="store_true", help="first measure a one-rank round alone and beside another "
                   "process running the same: the slowdown of sharing the machine, so 2 ranks can do no better "
                   "than half of it")
    p.add_argument("--own-session", action="store_true", help="each other rank in a session of its own: on a "
                   "machine busy with other jobs, Linux's autogroup scheduling then gives it its own CPU share")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    floor = co_run(args) if args.co_run else None
    cfg = config(args)
    ranks = ServerRanks(cfg, args.world_size, threads=1, own_session=args.own_session)
    try:
        one, many = build_coordinator(plan_run(cfg)).coordinator, build_coordinator(plan_run(cfg)).coordinator
        ranks.shard(many)
        acts = activations(one, args)
        others = [q.pid for q in ranks.procs if q.pid is not None]
        rows = []
        for t in range(1, args.rounds + 1):  # the two side by side, round after round: the same load on both
            a, ca = server_round(one, t, acts, args.split)
            before, dealt = _cpu(others), [list(many.server.owners.values()).count(r) for r in range(args.world_size)]
            b, cb = server_round(many, t, acts, args.split)
            rows.append((a, ca, b, cb, (_cpu(others) - before) / max(1, len(others)), dealt))
        st1, st2 = one.model.state_dict(), many.model.state_dict()
    finally:
        ranks.close()
    diff = max(float((st1[n].double() - st2[n].double()).abs().max()) for n in st1)
    w = args.world_size
    print(f"{args.devices} devices, per-client copies, {args.batches} activations of {args.batch_size} each per "
          f"round at split {args.split}, resnet18_cifar width {args.width}; load average {os.getloadavg()[0]:.1f}"
          + ("; other ranks in sessions of their own" if args.own_session else ""))
    for t, (a, ca, b, cb, co, dealt) in enumerate(rows, 1):
        print(f"  round {t}: 1 rank {a:.2f} s, {w} ranks {b:.2f} s ({b / a:.2f}x); CPU: 1 rank {ca:.2f} s, "
              f"rank 0 {cb:.2f} s, other ranks {co:.2f} s each; devices per rank {'/'.join(map(str, dealt))}")
    w1, w2 = sum(r[0] for r in rows), sum(r[2] for r in rows)
    c1, c0, co = (sum(r[i] for r in rows) for i in (1, 3, 4))
    print(f"mean per round: 1 rank {w1 / len(rows):.2f} s, {w} ranks {w2 / len(rows):.2f} s: {w2 / w1:.2f}x; "
          f"CPU over one rank's: rank 0 {c0 / c1:.2f}x, other ranks {co / c1:.2f}x each; "
          f"weights' largest difference {diff:.2e}")
    if floor is not None:
        alone, together = floor
        print(f"sharing the machine: a one-rank round {alone:.2f} s alone, {together:.2f} s beside another process "
              f"running the same ({together / alone:.2f}x): {w} ranks can do no better than "
              f"{together / alone / w:.2f}x one rank's")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
