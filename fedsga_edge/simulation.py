"""In-process simulation: the coordinator and N device roles joined by the loopback transport.

This is wiring, not core: it is the one place (with the CLI) that imports both roles. The roles
exchange real encoded messages through the transport, so the bytes counted are the wire's bytes.
Rounds run through the coordinator's one round driver (coordinator/driver.py), the same one the
coordinator service uses, with a virtual clock and an in-process scheduler: devices run
concurrently under a deterministic schedule (``RunConfig.schedule``), each turn advancing one
device by one request (one local batch), so the coordinator answers the devices' activations
interleaved, as it would from real devices in arrival order. With ``--fleet`` (docs/fleet.md) a
``FleetScheduler`` replaces the interleaving: each request is served at the virtual time it would
arrive from its device's class (FLOPs over speed, bytes over link, delay). With ``--engine ray``
(fedsga_edge/rayengine.py) the device roles' compute runs on Ray actors and only their proxies live here:
the coordinator, the scheduler and the clock stay in this process.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from fedsga_edge.config import RunConfig
from fedsga_edge.coordinator.checkpoint import CheckpointWriter
from fedsga_edge.coordinator.clock import Clock, VirtualClock
from fedsga_edge.coordinator.driver import RoundDriver
from fedsga_edge.coordinator.scheduling import FleetScheduler, InProcessScheduler
from fedsga_edge.data import DatasetBundle
from fedsga_edge.fleet import load_fleet
from fedsga_edge.runbuild import (
    COORDINATOR,
    build_client,
    build_coordinator,
    default_run_id,
    peer_format,
    plan_run,
    resolve_device,
    validate_config,
)
from fedsga_edge.runfiles import RunFiles, summarize
from fedsga_edge.transport import LoopbackTransport, Peer

__all__ = ["DeviceEngine", "Simulation", "run_simulation", "validate_config", "resolve_device"]


class DeviceEngine(Protocol):
    """Where the device roles compute: ``client`` returns device ``i``'s role (or a proxy with its
    ``step``/``abort``/``busy``/``waiting``/``handle``) talking over ``peer``."""

    def client(self, plan: Any, i: int, peer: Peer, *, backend: str, artifacts: str | Path | None) -> Any: ...


class Simulation:
    """Builds everything for a run; ``rounds()`` yields one metrics record per round."""

    def __init__(self, cfg: RunConfig, bundle: DatasetBundle | None = None, *, backend: str = "torch",
                 artifacts: str | Path | None = None, clock: Clock | None = None,
                 engine: DeviceEngine | None = None, transport: Callable[[str], Any] | None = None) -> None:
        """``backend="onnx"`` runs every device on the torch-free ONNX backend (``export --train`` artifacts);
        ``clock`` (default: a ``VirtualClock`` advanced by each device step's measured time) is what
        ``--round-timeout`` and ``round_s`` are measured on; ``engine`` builds the device roles (default:
        in this process, ``build_client``); ``transport(party)`` gives each party its transport (default:
        one shared loopback; benchmarks/capacity.py passes one MQTT connection per party)."""
        fleet = load_fleet(cfg.fleet) if cfg.fleet else None  # a bad fleet file fails before any data loads
        if fleet is not None and fleet.size != cfg.clients:
            fleet.assign([f"client-{i}" for i in range(cfg.clients)])  # raises the FleetError naming the counts
        plan = plan_run(cfg, bundle)
        self.cfg, self.bundle, self.device = cfg, plan.bundle, plan.device
        self.parts, self.client_ids = plan.parts, plan.client_ids
        side = build_coordinator(plan)
        self.model, self.costs, self.strategy, self.coordinator = side.model, side.costs, side.strategy, side.coordinator
        self.run_info = side.run_info()
        self.transport = LoopbackTransport()
        party = transport or (lambda _: self.transport)
        run_id = default_run_id(cfg)
        fmt = peer_format(cfg)  # --wire-format: per-batch tensors only (docs/protocol.md, "Messages")
        self.peer = Peer(party(COORDINATOR), COORDINATOR, run_id, tensor_format=fmt)
        self.clients = []
        make = engine.client if engine is not None else build_client
        for i, cid in enumerate(self.client_ids):
            cpeer = Peer(party(cid), cid, run_id, tensor_format=fmt)
            client = make(plan, i, cpeer, backend=backend, artifacts=artifacts)
            cpeer.register(client.handle)
            self.clients.append(client)
        self.schedule_rng = np.random.default_rng([cfg.seed, 13])
        self.fleet = fleet
        self.scheduler: InProcessScheduler | FleetScheduler
        if self.fleet is not None:  # a discrete-event schedule on the fleet's time (docs/fleet.md)
            self.scheduler = FleetScheduler(self.clients, self.fleet.assign(self.client_ids), self.costs, cfg.train,
                                            order=cfg.device_order, seed=cfg.seed,
                                            server_gflops=self.fleet.server_gflops, server=COORDINATOR)
            if clock is not None and not isinstance(clock, VirtualClock):
                raise ValueError("a fleet runs on a VirtualClock")
        else:
            self.scheduler = InProcessScheduler(self.clients, cfg.schedule, self.schedule_rng,
                                                order=cfg.device_order, seed=cfg.seed)
        b = self.bundle
        self.driver = RoundDriver(self.coordinator, self.peer, clock or VirtualClock(), self.scheduler,
                                  test=(b.test, b.mean, b.std))
        self.peer.register(self.driver.receive)

    def run_round(self, t: int) -> dict[str, Any]:
        """Start every device at once, step them under the schedule, close the round, aggregate, evaluate."""
        return self.driver.run_round(t)

    def rounds(self) -> Iterator[dict[str, Any]]:
        return self.driver.rounds()


def run_simulation(
    cfg: RunConfig,
    out: str | Path | None = None,
    *,
    bundle: DatasetBundle | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
    engine: DeviceEngine | None = None,
    world_size: int = 1,
    threads: int = 0,
) -> dict[str, Any]:
    """Run all rounds; write ``config.json``, ``metrics.jsonl``, ``summary.json`` and ``checkpoint.pt`` under ``out``.

    The checkpoint holds the global weights (loadable by ``create_model(..., pretrained=...)`` and
    ``export --checkpoint``) plus the coordinator's own state (harmonizer, prototypes, estimator,
    calibration pairs); it is not resumable (coordinator/checkpoint.py). ``engine``: where the devices
    compute (``Simulation``). ``world_size`` > 1: the per-client server copies on that many processes, each
    with ``threads`` torch threads (fedsga_edge/serverranks.py).
    """
    if world_size > 1:
        from fedsga_edge.serverranks import ServerRanks

        with ServerRanks(cfg, world_size, threads) as ranks:
            return _run(cfg, out, bundle, on_round, engine, ranks)
    return _run(cfg, out, bundle, on_round, engine, None)


def _run(cfg: RunConfig, out: str | Path | None, bundle: DatasetBundle | None,
         on_round: Callable[[dict[str, Any]], None] | None, engine: DeviceEngine | None, ranks: Any) -> dict[str, Any]:
    started = time.perf_counter()
    sim = Simulation(cfg, bundle, engine=engine)
    if ranks is not None:
        ranks.shard(sim.coordinator)
    files = None
    if out is not None:
        files = RunFiles(out)
        files.write_config(sim.run_info)
        sim.driver.checkpoints = CheckpointWriter(files.dir / "checkpoint.pt", cfg, resumable=False)
    return sim.driver.run(lambda records, wall_s: summarize(records, cfg, wall_s), files=files, started=started,
                          on_round=on_round)
