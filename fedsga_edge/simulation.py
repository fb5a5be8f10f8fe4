"""In-process simulation: the coordinator and N device roles joined by the loopback transport.

This is wiring, not core: it is the one place (with the CLI) that imports both roles. The roles
exchange real encoded messages through the transport, so the bytes counted are the wire's bytes.
Devices run concurrently under a deterministic scheduler (``RunConfig.schedule``): each turn
advances one device by one request (one local batch), so the coordinator answers the devices'
activations interleaved, as it would from real devices in arrival order.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsga_edge.config import RunConfig
from fedsga_edge.data import DatasetBundle
from fedsga_edge.runbuild import (
    COORDINATOR,
    build_client,
    build_coordinator,
    default_run_id,
    peer_format,
    plan_run,
    resolve_device,
    summarize,
    validate_config,
)
from fedsga_edge.transport import LoopbackTransport, Peer

__all__ = ["Simulation", "run_simulation", "validate_config", "resolve_device"]


class Simulation:
    """Builds everything for a run; ``rounds()`` yields one metrics record per round."""

    def __init__(self, cfg: RunConfig, bundle: DatasetBundle | None = None, *, backend: str = "torch",
                 artifacts: str | Path | None = None) -> None:
        """``backend="onnx"`` runs every device on the torch-free ONNX backend (``export --train`` artifacts)."""
        plan = plan_run(cfg, bundle)
        self.cfg, self.bundle, self.device = cfg, plan.bundle, plan.device
        self.parts, self.client_ids = plan.parts, plan.client_ids
        side = build_coordinator(plan)
        self.model, self.costs, self.strategy, self.coordinator = side.model, side.costs, side.strategy, side.coordinator
        self.assignment_info = self.strategy.info()
        self.run_info = side.run_info()
        self.transport = LoopbackTransport()
        run_id = default_run_id(cfg)
        fmt = peer_format(cfg)  # --wire-format: per-batch tensors only (docs/protocol.md, "Messages")
        self.peer = Peer(self.transport, COORDINATOR, run_id, tensor_format=fmt)
        self.peer.register(self.coordinator.receive)
        self.clients = []
        for i, cid in enumerate(self.client_ids):
            cpeer = Peer(self.transport, cid, run_id, tensor_format=fmt)
            client = build_client(plan, i, cpeer, backend=backend, artifacts=artifacts)
            cpeer.register(client.handle)
            self.clients.append(client)
        self.schedule_rng = np.random.default_rng([cfg.seed, 13])

    def run_round(self, t: int) -> dict[str, Any]:
        """Start every device at once, step them under the schedule, close the round, aggregate."""
        co = self.coordinator
        for cid, body in co.begin_round(t).items():
            try:
                self.peer.send(cid, "round_start", t, body)
            except Exception as exc:  # an unreachable device must not stop the round
                co.fail(cid, f"round_start not delivered: {type(exc).__name__}: {exc}")
        active = [c for c in self.clients if c.busy]
        schedule = self.cfg.schedule
        while active and not co.tick():
            if schedule == "sequential":
                client = active[0]
            elif schedule == "random":
                client = active[int(self.schedule_rng.integers(len(active)))]
            else:  # round-robin: one request per device in turn
                client = active.pop(0)
                active.append(client)
            if not self._step(client):
                active.remove(client)
        for client in active:  # the deadline passed: what they still hold is dropped
            client.abort()
        return co.end_round()

    def _step(self, client: Any) -> bool:
        try:
            more = client.step()
        except Exception as exc:  # a broken device must not stop the round
            client.abort()
            self.coordinator.fail(client.cid, f"{type(exc).__name__}: {exc}")
            return False
        if not more and client.last_error:
            self.coordinator.fail(client.cid, client.last_error)
        return more

    def rounds(self) -> Iterator[dict[str, Any]]:
        cfg, co, b = self.cfg, self.coordinator, self.bundle
        stats = self.transport.stats
        for t in range(1, cfg.rounds + 1):
            up0 = sum(stats.bytes_sent(src=c) for c in self.client_ids)
            down0 = stats.bytes_sent(src=COORDINATOR)
            started = time.perf_counter()
            rec = self.run_round(t)
            rec["bytes_up"] = sum(stats.bytes_sent(src=c) for c in self.client_ids) - up0
            rec["bytes_down"] = stats.bytes_sent(src=COORDINATOR) - down0
            if t % cfg.eval_every == 0 or t == cfg.rounds:
                rec.update(co.evaluate(b.test, b.mean, b.std))
            rec["wall_s"] = time.perf_counter() - started
            yield rec


def run_simulation(
    cfg: RunConfig,
    out: str | Path | None = None,
    *,
    bundle: DatasetBundle | None = None,
    on_round: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run all rounds; write ``config.json``, ``metrics.jsonl`` and ``summary.json`` under ``out``."""
    started = time.perf_counter()
    sim = Simulation(cfg, bundle)
    out_dir = Path(out) if out is not None else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "config.json").write_text(json.dumps(sim.run_info, indent=2))
        metrics = (out_dir / "metrics.jsonl").open("w")
    records = []
    try:
        for rec in sim.rounds():
            records.append(rec)
            if out_dir is not None:
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
            if on_round is not None:
                on_round(rec)
    finally:
        if out_dir is not None:
            metrics.close()
    summary = summarize(records, cfg, time.perf_counter() - started)
    if out_dir is not None:
        # Global model weights (loadable by `create_model(..., pretrained=...)` and `export --checkpoint`)
        # plus the coordinator's own state (harmonizer, prototypes, estimator, calibration pairs).
        torch.save({"model": sim.model.state_dict(), "arch": cfg.model, "coordinator": sim.coordinator.state_dict()},
                   out_dir / "checkpoint.pt")
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
