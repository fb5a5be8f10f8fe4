"""The device checks its coordinator: forged orders on a device's down topic.

Real coordinator services and device agents over the loopback transport (as tests/test_field.py), plus
an intruder that publishes what an open broker or a device login would let it: a round_start for round
2^64-1, a bye, settings that would make a fresh device allocate and save 10^6 prompts, and a round cut
off before the coordinator's ack. Each must leave the device running real rounds and its state dir clean.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fedsga_edge.device.agent import STATE_FILE, DeviceAgent
from fedsga_edge.device.guard import MAX_ROUNDS_AHEAD, RoundGuard
from fedsga_edge.device.role import check_round_start

from fedsga_edge.config import FedSGAConfig, RunConfig, TrainConfig
from fedsga_edge.runbuild import build_client, coordinator_service, default_run_id, device_agent, plan_run
from fedsga_edge.transport import LoopbackTransport, Peer, TransportError
from fedsga_edge.wire import Message, RemoteProtocolError, encode

WAIT = 180.0


def tiny(strategy: str = "static", **kw: Any) -> RunConfig:
    base = dict(dataset="digits", clients=2, rounds=2, model="resnet18_cifar", width=0.25, seed=0, device="cpu",
                round_timeout=20.0, train=TrainConfig(local_epochs=1, batch_size=32, max_batches=2))
    return RunConfig(strategy=strategy, **(base | kw))


class ObservingLoopback(LoopbackTransport):
    """The loopback plus what MQTT has: the sender the transport saw (here ``src``), on the handler's thread."""

    def __init__(self) -> None:
        super().__init__()
        self._seen = threading.local()

    def observed_sender(self) -> str | None:
        return getattr(self._seen, "src", None)

    def _route(self, src: str, dst: str, payload: bytes):  # type: ignore[no-untyped-def]
        handler = super()._route(src, dst, payload)

        def observed(data: bytes) -> bytes | None:
            before = getattr(self._seen, "src", None)
            self._seen.src = src
            try:
                return handler(data)
            finally:
                self._seen.src = before

        return observed


def forge(transport: LoopbackTransport, cfg: RunConfig, dst: str, kind: str, round: int, body: dict[str, Any], *,
          src: str = "coordinator", claim: str = "coordinator") -> None:
    """Publish one message on ``dst``'s down topic as ``src`` (a login), claiming to be ``claim``."""
    msg = Message(kind, default_run_id(cfg), round, 900_000_001, claim, body)
    transport.send(src, dst, encode(msg))


def round_start_body(**fedsga: Any) -> dict[str, Any]:
    """A well-formed round_start (static split 1, no weights: the device fetches them)."""
    body: dict[str, Any] = {"split": 1, "full": False, "weights": {},
                            "train": vars(TrainConfig(local_epochs=1, batch_size=32, max_batches=2))}
    body["fedsga"] = vars(FedSGAConfig(**fedsga)) if fedsga else None
    return body


def events(state_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (state_dir / "agent.log").read_text().splitlines()]


def _run(cfg: RunConfig, digits, tmp_path: Path, transport: LoopbackTransport, before_second) -> tuple[Any, list]:
    """Service + device 0; ``before_second(agent0)`` runs before device 1 registers, so before round 1."""
    service = coordinator_service(cfg, transport, tmp_path / "run", bundle=digits, register_timeout=60)
    service.start()
    plan = plan_run(cfg, digits, seed_globals=False)
    first = device_agent(cfg, 0, transport, tmp_path / "state-0", plan=plan)
    first.start(timeout=30)
    before_second(first)
    second = device_agent(cfg, 1, transport, tmp_path / "state-1", plan=plan)
    second.start(timeout=30)
    service.wait(WAIT)
    return service, [first, second]


def test_a_forged_far_future_round_start_is_ignored_and_the_next_real_round_runs(digits, tmp_path) -> None:
    """Round 2^64-1 used to become the device's newest round: every real round after it was skipped."""
    cfg = tiny()
    transport = LoopbackTransport()
    far = 2**64 - 1

    def intrude(agent: DeviceAgent) -> None:
        forge(transport, cfg, agent.cid, "round_start", far, round_start_body())

    service, agents = _run(cfg, digits, tmp_path, transport, intrude)
    assert [r["failures"] for r in service.records] == [{}, {}]
    assert all(set(r["splits"]) == {"client-000", "client-001"} for r in service.records)
    h = agents[0].health()
    assert h["rounds_done"] == 2 and h["confirmed_round"] == 2 and h["refused"] == {"round_start_refused": 1}
    log = events(tmp_path / "state-0")
    refused = [e for e in log if e["event"] == "round_start_refused"]
    assert len(refused) == 1 and refused[0]["round"] == far and f"more than {MAX_ROUNDS_AHEAD} rounds" in \
        refused[0]["reason"]
    assert not any(e["event"] == "round_begin" and e["round"] == far for e in log)
    for a in agents:
        assert a.finished.wait(10)  # the real coordinator's bye still ends the run
        a.stop()


def test_a_forged_bye_from_a_device_login_is_ignored_and_logged(digits, tmp_path) -> None:
    """On a transport that observes senders (MQTT: the topic), a bye claiming the coordinator but sent by
    device 1's login, and one that names device 1, are both refused; the run's own bye still ends it."""
    cfg = tiny(rounds=1)
    transport = ObservingLoopback()
    far = 2**64 - 1

    def intrude(agent: DeviceAgent) -> None:
        forge(transport, cfg, agent.cid, "bye", 1, {"reason": "forged"}, src="client-001")
        forge(transport, cfg, agent.cid, "bye", 1, {"reason": "forged"}, src="client-001", claim="client-001")
        forge(transport, cfg, agent.cid, "bye", far, {"reason": "forged"})  # the topic, but too far
        assert not agent.finished.is_set()
        assert agent.health()["refused"] == {"order_refused": 1, "bye_refused": 1}
        log = events(agent.state_dir)
        assert [e["sender"] for e in log if e["event"] == "message_rejected"] == ["client-001"]  # the Peer's check
        assert [e["sender"] for e in log if e["event"] == "order_refused"] == ["client-001"]  # the agent's
        assert [e["round"] for e in log if e["event"] == "bye_refused"] == [far]

    service, agents = _run(cfg, digits, tmp_path, transport, intrude)
    assert service.records[0]["failures"] == {}
    for a in agents:
        assert a.finished.wait(10) and a.health()["rounds_done"] == 1
        a.stop()


def test_a_forged_order_naming_another_sender_is_logged_on_any_transport(digits, tmp_path) -> None:
    """The loopback observes no sender: the claimed one must still be the coordinator, and a refusal is logged."""
    cfg = tiny(rounds=1)
    transport = LoopbackTransport()
    agent = device_agent(cfg, 0, transport, tmp_path / "state-0", bundle=digits)
    agent.start(register=False)
    forge(transport, cfg, agent.cid, "bye", 0, {}, src="client-001", claim="client-001")
    assert not agent.finished.is_set()
    assert [e["event"] for e in events(tmp_path / "state-0")].count("order_refused") == 1
    agent.stop()


def test_prompts_beyond_the_bound_are_refused_clearly_and_nothing_is_saved(digits, tmp_path) -> None:
    """fedsga.prompts = 10^6 sent to a fresh device used to be saved by its next real round (61 MiB)."""
    with pytest.raises(RemoteProtocolError, match=r"malformed round_start: ValueError: .*--prompts must lie in "
                                                  r"\[0, 256\]"):
        check_round_start(round_start_body(prompts=10**6))
    cfg = tiny("fedsga", rounds=1)
    transport = LoopbackTransport()

    def intrude(agent: DeviceAgent) -> None:
        forge(transport, cfg, agent.cid, "round_start", 1, round_start_body(prompts=10**6))
        assert not (agent.state_dir / STATE_FILE).exists() and agent.client.state.prompts is None

    service, agents = _run(cfg, digits, tmp_path, transport, intrude)
    assert service.records[0]["failures"] == {}
    refused = [e for e in events(tmp_path / "state-0") if e["event"] == "round_start_refused"]
    assert len(refused) == 1 and "--prompts must lie in [0, 256]" in refused[0]["reason"]
    path = tmp_path / "state-0" / STATE_FILE
    assert path.stat().st_size < 1 << 20
    with np.load(path) as npz:
        assert npz["prompts"].shape[0] == cfg.fedsga.prompts
    for a in agents:
        a.stop()


class _LosesTheFirstAck(Peer):
    """A device whose link drops while round 1's update is on its way: the round is abandoned before the ack."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.state_path: Path | None = None
        self.saved_before_round_2: bool | None = None

    def call(self, dst: str, kind: str, round: int, body: dict[str, Any] | None = None, **kw: Any) -> Message:
        if kind == "update" and round == 1:
            raise TransportError("link lost before the ack")
        if round == 2 and self.saved_before_round_2 is None and self.state_path is not None:
            self.saved_before_round_2 = self.state_path.exists()
        return super().call(dst, kind, round, body, **kw)


def test_a_round_abandoned_before_the_ack_saves_nothing(digits, tmp_path) -> None:
    """A fresh device has no state file to roll back to: it must still drop what the lost round changed
    (prompts, r, batch order), so the state saved after round 2 holds one round of local training."""
    cfg = tiny("fedsga", clients=1)
    transport = LoopbackTransport()
    service = coordinator_service(cfg, transport, tmp_path / "run", bundle=digits, register_timeout=60)
    service.start()
    plan = plan_run(cfg, digits, seed_globals=False)
    peer = _LosesTheFirstAck(transport, plan.client_ids[0], default_run_id(cfg))
    agent = DeviceAgent(build_client(plan, 0, peer), peer, tmp_path / "state-0")
    peer.state_path = agent.state_path
    agent.start(timeout=30)
    service.wait(WAIT)
    agent.stop()
    r1, r2 = service.records
    assert set(r1["failures"]) == {"client-000"} and r2["failures"] == {}
    assert peer.saved_before_round_2 is False
    assert agent.rounds_done == 1 and agent.client.state.rounds == 1
    again = device_agent(cfg, 0, transport, tmp_path / "state-0", plan=plan)
    assert again.restored and again.client.state.rounds == 1 and again.health()["rounds_done"] == 1
    again.log.close()


def test_a_device_that_lagged_past_the_bound_asks_the_coordinator_and_takes_the_next_round(digits, tmp_path) -> None:
    """An honest device can lag more than the bound (no answer for 100 rounds): the refused round_start makes
    it ask the coordinator's round (hello); once the ack names that round, the next round_start is taken."""
    cfg = tiny()
    transport = LoopbackTransport()
    coordinator = Peer(transport, "coordinator", default_run_id(cfg))
    at, hellos = {"round": 0}, []

    def answer(msg: Message) -> Message:
        hellos.append(msg.round)
        return coordinator.reply(msg, "ack", {"rounds": 500, "round": at["round"], "round_timeout": 20.0,
                                              "registered": 1})

    coordinator.register(answer)
    agent = device_agent(cfg, 0, transport, tmp_path / "state-0", bundle=digits)
    agent.peer.register(agent._handle)  # serving, but no worker: queued rounds stay queued
    agent.register(timeout=10)
    at["round"] = 150
    forge(transport, cfg, agent.cid, "round_start", 150, round_start_body())
    assert agent._queue.empty() and agent.refused == {"round_start_refused": 1} and agent._verify == 150
    agent._verify_round()  # what the worker does next
    assert agent.health()["confirmed_round"] == 150 and len(hellos) == 2
    forge(transport, cfg, agent.cid, "round_start", 151, round_start_body())
    assert agent._queue.qsize() == 1
    forge(transport, cfg, agent.cid, "round_start", 2**64 - 1, round_start_body())  # within 30 s: no second hello
    assert agent._verify is None and agent.refused == {"round_start_refused": 2}
    assert [e["event"] for e in events(tmp_path / "state-0")].count("round_start_confirmed") == 1
    agent.stop()


def test_over_mqtt_a_forged_round_start_and_bye_on_a_down_topic_are_refused_and_logged(digits, tmp_path) -> None:
    """A real broker (open, as an intruder with a device login would find one without the ACL): frames
    published straight on ``down/client-000`` reach the agent's checks, which refuse and log them."""
    pytest.importorskip("paho.mqtt", reason="paho-mqtt is an optional dependency (fedsga-edge[device])")
    import paho.mqtt.client as paho
    from fedsga_edge.broker.launch import mosquitto_path, start_mosquitto
    from paho.mqtt.enums import CallbackAPIVersion

    from fedsga_edge.transport.mqtt import MqttTransport
    from fedsga_edge.transport.mqtt.frames import pack_frame

    if mosquitto_path() is None:
        pytest.skip("no mosquitto binary (apt-get install mosquitto)")
    cfg = tiny()
    run = default_run_id(cfg)
    (tmp_path / "broker").mkdir()
    broker = start_mosquitto(tmp_path / "broker", timeout=5.0)
    transport = MqttTransport("127.0.0.1", broker.port, run=run, client_id="client-000", connect_timeout=5.0)
    try:
        agent = device_agent(cfg, 0, transport, tmp_path / "state-0", bundle=digits)
        agent.peer.register(agent._handle)  # serving, no worker: nothing here should run
        raw = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="client-001")
        raw.connect("127.0.0.1", broker.port)
        raw.loop_start()
        topic = f"fedsga/{run}/down/client-000"
        forged = [Message("round_start", run, 2**64 - 1, 1, "coordinator", round_start_body()),
                  Message("bye", run, 1, 2, "client-001", {"reason": "forged"})]
        for i, msg in enumerate(forged):
            raw.publish(topic, pack_frame("send", f"f{i}", p=encode(msg)), qos=1).wait_for_publish(2)
        raw.disconnect()
        raw.loop_stop()
        deadline = time.monotonic() + 10
        while agent.peer.errors < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert agent.peer.errors == 2 and agent._queue.empty() and not agent.finished.is_set()
        log = {e["event"]: e for e in events(tmp_path / "state-0")}
        assert log["round_start_refused"]["round"] == 2**64 - 1
        assert "claims sender 'client-001'" in log["message_rejected"]["reason"]
        agent.stop()
    finally:
        transport.close()
        broker.stop()


def test_the_round_guard_bounds_rounds_ahead_of_the_newest_confirmed() -> None:
    guard = RoundGuard()
    assert guard.too_far(MAX_ROUNDS_AHEAD) is None and guard.too_far(MAX_ROUNDS_AHEAD + 1)
    guard.confirm(7)
    guard.confirm(3)  # confirmations never move it back
    assert guard.confirmed == 7 and guard.too_far(7 + MAX_ROUNDS_AHEAD) is None
    assert "more than" in (guard.too_far(2**64 - 1, "bye") or "")
