"""``simulate --world-size N``: the per-client server copies on N processes (coordinator/sharding.py).

This process is rank 0: the coordinator, the devices and the round driver, with a ``ShardedServer`` in
place of its per-client server side. Ranks 1..N-1 are processes started here: each builds the run's model
and strategy from the same config and serves the steps of its devices' copies until the run ends. They
meet over torch.distributed on a free 127.0.0.1 port: gloo, and NCCL for the round's average when the
copies live on a GPU (docs/scale.md, "The server side across processes").
"""

from __future__ import annotations

import os
import socket
from typing import Any

from fedsga_edge.config import RunConfig

__all__ = ["ServerRanks"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _reduce_group(cfg: RunConfig) -> Any:
    """The group of the average's all_reduce: NCCL for copies on a GPU, else the default (gloo) group."""
    import torch
    import torch.distributed as dist

    from fedsga_edge.runbuild import resolve_device

    return dist.new_group(backend="nccl") if torch.device(resolve_device(cfg.device)).type == "cuda" else None


def _serve(rank: int, world: int, cfg: RunConfig, init: str, threads: int, own_session: bool) -> None:
    """Rank ``rank`` > 0: the run's server side, serving rank 0's steps for its devices."""
    import torch
    import torch.distributed as dist

    if own_session:
        os.setsid()

    from fedsga_edge.coordinator.sharding import serve_shard
    from fedsga_edge.runbuild import build_coordinator, plan_run

    if threads:
        torch.set_num_threads(threads)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        side = build_coordinator(plan_run(cfg))
        group = _reduce_group(cfg)
        dist.barrier()  # built: rank 0's first round may start
        serve_shard(side.coordinator.server, side.strategy, group)
    finally:
        dist.destroy_process_group()


class ServerRanks:
    """Ranks 1..world-1 started, this process rank 0; ``shard(co)`` deals the coordinator's copies over them."""

    def __init__(self, cfg: RunConfig, world: int, threads: int = 0, *, own_session: bool = False) -> None:
        """``own_session``: each other rank in a session of its own. Linux's autogroup scheduling shares a busy
        machine's CPU between sessions, so ranks in one session share one session's share (the default: the
        ranks stop with the run's terminal); apart, each gets a share as a separate job would."""
        import torch.distributed as dist
        import torch.multiprocessing as mp

        if world < 2:
            raise ValueError(f"--world-size takes 2 or more ranks (got {world})")
        from fedsga_edge.coordinator import get_strategy
        from fedsga_edge.coordinator.sharding import check_sharding

        if cfg.fleet:
            raise ValueError("--world-size runs the in-process schedule: leave out --fleet")
        check_sharding(cfg, get_strategy(cfg.strategy))
        self.cfg, self.world = cfg, world
        init = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.procs = [ctx.Process(target=_serve, args=(r, world, cfg, init, threads, own_session),
                                  daemon=True)
                      for r in range(1, world)]
        for p in self.procs:
            p.start()
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=world)
        self.group = _reduce_group(cfg)
        dist.barrier()  # every rank has built the run's server side
        self.server: Any = None

    def shard(self, co: Any) -> None:
        """Put a ``ShardedServer`` in place of ``co``'s per-client server side, its devices dealt by expected work."""
        from fedsga_edge.coordinator.sharding import ShardedServer, deal, expected_work

        old = co.server
        owners = deal(expected_work(co.clients, self.cfg), self.world)
        self.server = co.server = ShardedServer(old.model, old.head, self.cfg, old.weight, owners=owners,
                                                world=self.world, reduce_group=self.group)
        self.server.steps = old.steps

    def close(self) -> None:
        """Stop the other ranks and leave the process group."""
        import torch.distributed as dist

        if self.server is not None:  # else the run failed before its first round: nothing to wait for
            self.server.close()
        for p in self.procs:
            p.join(timeout=30 if self.server is not None else 0)
            if p.is_alive():
                p.kill()
        dist.destroy_process_group()

    def __enter__(self) -> "ServerRanks":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
