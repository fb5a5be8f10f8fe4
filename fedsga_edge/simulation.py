"""In-process simulation: the coordinator and N device roles joined by the loopback transport.

This is wiring, not core: it is the one place (with the CLI) that imports both roles. The roles
exchange real encoded messages through the transport, so the bytes counted are the wire's bytes.
Devices run concurrently under a deterministic scheduler (``RunConfig.schedule``): each turn
advances one device by one request (one local batch), so the coordinator answers the devices'
activations interleaved, as it would from real devices in arrival order.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsga_edge.config import SCHEDULES, RunConfig
from fedsga_edge.data import DatasetBundle, load_dataset, partition
from fedsga_edge.models import CostTable, SplitModel, create_model
from fedsga_edge.transport import LoopbackTransport, Peer

__all__ = ["Simulation", "run_simulation", "validate_config", "resolve_device"]

COORDINATOR = "coordinator"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available on this machine")
    return dev


def validate_config(cfg: RunConfig) -> None:
    """Reject bad settings with a message that names the flag, before any work starts."""
    from fedsga_edge.coordinator import list_strategies

    problems = []
    if cfg.strategy not in list_strategies():
        problems.append(f"--strategy must be one of {', '.join(list_strategies())} (got {cfg.strategy!r})")
    if cfg.schedule not in SCHEDULES:
        problems.append(f"--schedule must be one of {', '.join(s.replace('_', '-') for s in SCHEDULES)} (got {cfg.schedule!r})")
    if cfg.round_timeout < 0:
        problems.append("--round-timeout must be >= 0 (0 = no deadline)")
    if cfg.prox_mu < 0:
        problems.append("--mu must be >= 0")
    if cfg.clients < 1:
        problems.append("--clients must be >= 1")
    if cfg.rounds < 1:
        problems.append("--rounds must be >= 1")
    t = cfg.train
    if t.local_epochs < 1:
        problems.append("--local-epochs must be >= 1")
    if t.batch_size < 2:
        problems.append("--batch-size must be >= 2 (BatchNorm needs two samples)")
    if not t.lr > 0:
        problems.append("--lr must be > 0")
    if cfg.partition not in ("iid", "dirichlet", "domain"):
        problems.append(f"--partition must be iid, dirichlet or domain (got {cfg.partition!r})")
    if cfg.partition != "iid" and not cfg.alpha > 0:
        problems.append("--alpha must be > 0")
    f = cfg.fedsga
    if cfg.server_copies not in ("shared", "per_client"):
        problems.append(f"--server-copies must be shared or per-client (got {cfg.server_copies!r})")
    if f.cal_every < 1:
        problems.append("--cal-every must be >= 1")
    if not 0 <= f.mu_proto <= 1:
        problems.append("--mu-proto must lie in [0, 1]")
    if f.tau_a <= 0 or f.tau_m <= 0:
        problems.append("--tau-a and --tau-m must be > 0")
    if f.prompts < 0:
        problems.append("--prompts must be >= 0")
    if problems:
        raise ValueError("; ".join(problems))


class Simulation:
    """Builds everything for a run; ``rounds()`` yields one metrics record per round."""

    def __init__(self, cfg: RunConfig, bundle: DatasetBundle | None = None) -> None:
        validate_config(cfg)
        self.cfg = cfg
        _seed_everything(cfg.seed)
        self.device = resolve_device(cfg.device)
        self.bundle = bundle or load_dataset(cfg.dataset, cfg.data_root, image_size=cfg.img_size)
        b = self.bundle
        train_idx = _subset(b.train.labels, cfg.train_subset, cfg.seed)
        domains = None if b.train.domains is None else b.train.domains[train_idx]
        parts = partition(b.train.labels[train_idx], cfg.clients, cfg.partition, alpha=cfg.alpha, seed=cfg.seed, domains=domains)
        self.parts = [train_idx[p] for p in parts]
        if cfg.train.augment is None:  # auto: crop + flip for natural images, not for digits
            cfg.train.augment = cfg.dataset != "digits"
        self.model = self._make_model()
        K = self.model.num_splits
        if cfg.strategy == "static" and not 1 <= cfg.split <= K:
            raise ValueError(f"--split must be in 1..{K} for {cfg.model} (candidates after blocks {self.model.splits})")
        prompts_m = cfg.fedsga.prompts if cfg.strategy == "fedsga" and cfg.fedsga.adapt else 0
        self.costs = CostTable(self.model, prompts_m)
        self.transport = LoopbackTransport()
        run_id = f"sim-{cfg.seed}"
        self.client_ids = [f"client-{i:03d}" for i in range(cfg.clients)]
        sizes = {cid: len(p) for cid, p in zip(self.client_ids, self.parts)}

        from fedsga_edge.coordinator import Coordinator, create_strategy
        from fedsga_edge.device.client import ClientData, TorchClient

        train_flops = {k: self.costs.train(k) for k in range(0, K + 1)}
        self.strategy = create_strategy(cfg, K, self.client_ids, train_flops)
        self.assignment_info = self.strategy.info()
        self.peer = Peer(self.transport, COORDINATOR, run_id)
        self.coordinator = Coordinator(self.model, cfg, sizes, b.num_classes, self.strategy, self.costs,
                                       device=self.device)
        self.peer.register(self.coordinator.receive)
        self.clients = []
        for cid, idx in zip(self.client_ids, self.parts):
            cpeer = Peer(self.transport, cid, run_id)
            client = TorchClient(
                cid, ClientData(b.train, idx, b.mean, b.std), self._make_model, cpeer,
                server=COORDINATOR, seed=cfg.seed, device=self.device,
            )
            cpeer.register(client.handle)
            self.clients.append(client)
        self.schedule_rng = np.random.default_rng([cfg.seed, 13])

    def _make_model(self) -> SplitModel:
        cfg = self.cfg
        kwargs: dict[str, Any] = {"num_classes": self.bundle.num_classes, "img_size": cfg.img_size or self.bundle.image_size,
                                  "width": cfg.width, **cfg.model_args}
        return create_model(cfg.model, pretrained=cfg.pretrained, **kwargs)

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
            ks = rec["splits"]
            weights = {c: co.clients[c] for c in ks}  # client FLOPs per sample, weighted by |D_i|
            total = sum(weights.values())
            rec["client_flops_per_sample"] = (sum(weights[c] * self.costs.train(k) for c, k in ks.items()) / total
                                              if total else 0.0)
            rec["client_params"] = float(np.mean([self.costs.params[k] for k in ks.values()])) if ks else 0.0
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
        config = cfg.to_dict() | {"resolved_device": str(sim.device), "candidate_depths": list(sim.model.splits),
                                  "client_sizes": {c: len(p) for c, p in zip(sim.client_ids, sim.parts)}} | sim.assignment_info
        (out_dir / "config.json").write_text(json.dumps(config, indent=2))
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
    summary = summarize(records, sim, time.perf_counter() - started)
    if out_dir is not None:
        # Global model weights (loadable by `create_model(..., pretrained=...)` and `export --checkpoint`)
        # plus the coordinator's own state (harmonizer, prototypes, estimator, calibration pairs).
        torch.save({"model": sim.model.state_dict(), "arch": cfg.model, "coordinator": sim.coordinator.state_dict()},
                   out_dir / "checkpoint.pt")
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def summarize(records: list[dict[str, Any]], sim: Simulation, wall_s: float) -> dict[str, Any]:
    accs = [r["test_acc"] for r in records if "test_acc" in r]
    cal = [r.get("calibration_flops", {}) for r in records]
    rounds = len(records)
    return {
        "strategy": sim.cfg.strategy,
        "rounds": rounds,
        "final_acc": accs[-1] if accs else None,
        "final_acc_by_split": next((r["test_acc_by_split"] for r in reversed(records) if "test_acc_by_split" in r), None),
        "eval_split": next((r["eval_split"] for r in reversed(records) if "test_acc_by_split" in r), None),
        "best_acc": max(accs) if accs else None,
        "final_test_loss": next((r["test_loss"] for r in reversed(records) if "test_loss" in r), None),
        "client_flops_per_sample": float(np.mean([r["client_flops_per_sample"] for r in records])),
        "client_params": float(np.mean([r["client_params"] for r in records])),
        "bytes_total": int(sum(r["bytes_up"] + r["bytes_down"] for r in records)),
        "bytes_up": int(sum(r["bytes_up"] for r in records)),
        "bytes_down": int(sum(r["bytes_down"] for r in records)),
        "calibration_flops": {
            "client": int(sum(c.get("client", 0) for c in cal)),
            "server": int(sum(c.get("server", 0) for c in cal)),
        },
        "split_histogram": _histogram(records),
        "failures": sum(len(r.get("failures", {})) for r in records),
        "wall_s": wall_s,
    }


def _histogram(records: list[dict[str, Any]]) -> dict[str, int]:
    hist: dict[str, int] = {}
    for r in records:
        for k in r["splits"].values():
            hist[str(k)] = hist.get(str(k), 0) + 1
    return dict(sorted(hist.items()))


def _subset(labels: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A stratified subset of ``n`` training samples (all when n is 0 or too large)."""
    if n <= 0 or n >= len(labels):
        return np.arange(len(labels))
    rng = np.random.default_rng([seed, 3])
    picked = []
    classes = np.unique(labels)
    for c in classes:
        idx = np.flatnonzero(labels == c)
        take = max(1, round(n * len(idx) / len(labels)))
        picked.append(rng.choice(idx, size=min(take, len(idx)), replace=False))
    return np.sort(np.concatenate(picked))


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
