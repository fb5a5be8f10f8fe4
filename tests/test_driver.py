"""The one round driver (coordinator/driver.py) with its clocks and schedulers, on a fake coordinator.

The fake keeps the real RoundState, so deadlines, completion and failures follow the real
transition table; devices are tiny in-process roles that need a few steps each and send their
update over the loopback, so the wire bytes are real too. No training: the whole file takes well
under a second.
"""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fedsga_edge.config import RunConfig
from fedsga_edge.coordinator.checkpoint import CheckpointWriter
from fedsga_edge.coordinator.clock import MonotonicClock, VirtualClock
from fedsga_edge.coordinator.driver import RoundDriver
from fedsga_edge.coordinator.round import RoundState
from fedsga_edge.coordinator.scheduling import InProcessScheduler, MessageScheduler
from fedsga_edge.runfiles import RunFiles
from fedsga_edge.transport import LoopbackTransport, Peer
from fedsga_edge.wire import Message

import numpy as np


class FakeCoordinator:
    """The driver's view of a Coordinator: begin/receive/tick/fail/end/evaluate over a real RoundState."""

    def __init__(self, cfg: RunConfig, clients: list[str]) -> None:
        self.cfg = cfg
        self.clients = {c: 10 for c in clients}
        self.round = RoundState()
        self.model = torch.nn.Linear(2, 2)
        self.evaluated: list[int] = []
        self.device = "cpu"

    def begin_round(self, t: int, now: float, devices: list[str] | None = None,
                    evaluate_only: bool = False) -> list[tuple[str, Message]]:
        devices = list(self.clients) if devices is None else devices
        deadline = now + self.cfg.round_timeout if self.cfg.round_timeout > 0 else None
        self.round.begin(t, {d: 1 for d in devices}, False, deadline)
        self.started = now
        return [(d, Message("round_start", "", t, 0, "coordinator", {"split": 1})) for d in devices]

    def receive(self, msg: Any, now: float | None = None) -> list[tuple[str, Message]]:
        if msg.kind == "update" and msg.sender in self.round.waiting and self.round.phase == "training":
            self.round.accept_update(msg.sender, {"split": 1, "train_loss": 1.0})
        return []

    @property
    def round_complete(self) -> bool:
        return self.round.complete or self.round.phase == "closed"

    def tick(self, now: float) -> list[tuple[str, Message]]:
        self.round.expire(now)
        return []

    def fail(self, device: str, reason: str) -> list[tuple[str, Message]]:
        self.round.fail(device, reason)
        return []

    def end_round(self, now: float) -> tuple[dict[str, Any], list[tuple[str, Message]]]:
        rs = self.round
        if rs.phase == "training":
            rs.close()
        return {"round": rs.t, "splits": {c: 1 for c in rs.updates}, "failures": dict(rs.failures),
                "train_loss": 1.0, "round_s": now - self.started}, []

    def evaluate(self, images: Any, mean: tuple, std: tuple) -> dict[str, Any]:
        self.evaluated.append(self.round.t)
        return {"test_acc": 0.5}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict()}

    def checkpoint_state(self) -> dict[str, Any]:
        return {"coordinator": self.state_dict(), "opt": {}}


class FakeDevice:
    """Needs ``steps`` requests per round; the last sends its update to the coordinator."""

    def __init__(self, cid: str, transport: LoopbackTransport, steps: int, log: list[str]) -> None:
        self.cid, self.steps, self.log = cid, steps, log
        self.peer = Peer(transport, cid, "run")
        self.peer.register(self.handle)
        self.busy, self.last_error, self.left, self.round = False, None, 0, 0

    def handle(self, msg: Any) -> None:
        if msg.kind == "round_start":
            self.busy, self.left, self.round = True, self.steps, msg.round

    def step(self) -> bool:
        self.log.append(self.cid)
        self.left -= 1
        if self.left == 0:
            self.peer.send("coordinator", "update", self.round, {"weights": {"w": np.zeros(8, np.float32)}, "num_samples": 10})
            self.busy = False
        return self.busy

    def abort(self) -> None:
        self.busy = False


def _setup(schedule: str = "round_robin", *, clients: int = 3, steps: int = 2, clock: Any = None, **cfg: Any):
    cfg = RunConfig(clients=clients, **({"rounds": 2} | cfg))
    transport = LoopbackTransport()
    ids = [f"client-{i:03d}" for i in range(clients)]
    co = FakeCoordinator(cfg, ids)
    peer = Peer(transport, "coordinator", "run")
    peer.register(lambda msg: co.receive(msg))
    log: list[str] = []
    devices = [FakeDevice(c, transport, steps, log) for c in ids]
    sched = InProcessScheduler(devices, schedule, np.random.default_rng(0))
    driver = RoundDriver(co, peer, clock or VirtualClock(), sched, test=(None, (), ()))
    return SimpleNamespace(co=co, driver=driver, devices=devices, log=log, transport=transport)


def test_schedules_order_the_requests() -> None:
    rr, seq = _setup("round_robin"), _setup("sequential")
    assert rr.driver.run_round(1)["failures"] == {} and seq.driver.run_round(1)["failures"] == {}
    assert rr.log == ["client-000", "client-001", "client-002"] * 2
    assert seq.log == ["client-000"] * 2 + ["client-001"] * 2 + ["client-002"] * 2


def test_a_virtual_clock_makes_the_deadline_fall_at_the_same_request() -> None:
    """One second per step, a 2.5 s deadline: three requests, then every device is out of the round."""
    s = _setup(clock=VirtualClock(per_step=1.0), round_timeout=2.5)
    rec = s.driver.run_round(1)
    assert s.log == ["client-000", "client-001", "client-002"]
    assert rec["failures"] == {c: "missed the round deadline" for c in s.co.clients} and rec["splits"] == {}
    assert rec["round_s"] == 3.0 and not any(d.busy for d in s.devices)  # aborted


def test_bytes_per_round_are_the_wire_bytes_and_evaluation_follows_its_cadence() -> None:
    s = _setup(rounds=3, eval_every=2)
    recs = list(s.driver.rounds())
    stats = s.transport.stats
    assert sum(r["bytes_up"] for r in recs) == sum(stats.bytes_sent(src=c) for c in s.co.clients) > 0
    assert sum(r["bytes_down"] for r in recs) == stats.bytes_sent(src="coordinator") > 0
    assert s.co.evaluated == [2, 3] and ["test_acc" in r for r in recs] == [False, True, True]
    assert all(r["wall_s"] >= 0 for r in recs)


def test_an_unreachable_device_fails_and_the_round_goes_on() -> None:
    s = _setup()
    s.transport.unregister("client-001")
    rec = s.driver.run_round(1)
    assert sorted(rec["splits"]) == ["client-000", "client-002"]
    assert rec["failures"]["client-001"].startswith("round_start not delivered")


@pytest.mark.parametrize("resumable", [False, True])
def test_run_writes_metrics_summary_and_the_checkpoint(tmp_path, resumable: bool) -> None:
    s = _setup(rounds=2)
    writes: list[int] = []
    writer = CheckpointWriter(tmp_path / "checkpoint.pt", s.co.cfg, resumable=resumable,
                              extra=lambda: {"registered": {"client-000": {}}})
    write = writer.write
    writer.write = lambda co, t, records, elapsed_s: (writes.append(t), write(co, t, records, elapsed_s))
    s.driver.checkpoints = writer
    files = RunFiles(tmp_path)
    summary = s.driver.run(lambda records, wall_s: {"rounds": len(records), "wall_s": wall_s}, files=files)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and json.loads((tmp_path / "summary.json").read_text()) == summary
    ck = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    if resumable:  # after every round, with what resume needs
        assert writes == [1, 2] and ck["round"] == 2 and ck["resume"]["records"] == rows
        assert ck["resume"]["registered"] == {"client-000": {}} and "rng" in ck["resume"]
    else:  # simulate's: once, at the end, the keys create_model and export read
        assert writes == [2] and set(ck) == {"model", "arch", "coordinator"}
    assert torch.equal(ck["model"]["weight"], s.co.model.weight)


def test_the_message_scheduler_waits_for_updates_and_stops_on_request() -> None:
    cfg = RunConfig(clients=2, rounds=1, round_timeout=60.0)
    co = FakeCoordinator(cfg, ["a", "b"])
    cond, stop = threading.Condition(), threading.Event()
    sched = MessageScheduler(cond, stop, ready=lambda first: None, devices=lambda t: ["a", "b"], poll_s=0.01)
    clock = MonotonicClock()
    co.begin_round(1, clock.now())

    def later() -> None:
        with cond:
            co.round.accept_update("a", {})
            cond.notify_all()
        stop.set()

    threading.Timer(0.05, later).start()
    with cond:
        sched.advance(co, clock, lambda out: None)
    assert co.round.updates.keys() == {"a"} and co.round.failures == {"b": "coordinator stopped"}
