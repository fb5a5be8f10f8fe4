"""The field roles with every message sealed (fedsga_edge/transport/sealed.py) over loopback: a sealed round
gives the simulation's numbers, and afterwards a forged ``bye`` (plain, or sealed with another key) and the
coordinator's own ``round_start`` replayed are not acted on by the agent."""

from __future__ import annotations

import pytest

from fedsga_edge.config import RunConfig, TrainConfig
from fedsga_edge.runbuild import coordinator_service, device_agent
from fedsga_edge.simulation import Simulation
from fedsga_edge.transport import LoopbackTransport
from fedsga_edge.transport.sealed import SealedTransport
from fedsga_edge.wire import Message, decode, encode
from fedsga_edge.wire.auth import Keyring, make_key

WAIT = 180.0


def tiny(**kw) -> RunConfig:
    base = dict(dataset="digits", clients=1, rounds=1, model="resnet18_cifar", width=0.25, seed=0, device="cpu",
                round_timeout=120.0, schedule="sequential", strategy="fedsga",
                train=TrainConfig(local_epochs=1, batch_size=32, max_batches=2))
    return RunConfig(**(base | kw))


@pytest.mark.parametrize("encrypt", [False, True])
def test_a_sealed_round_equals_the_simulation_and_forged_orders_change_nothing(digits, tmp_path, encrypt) -> None:
    rec = next(Simulation(tiny(), digits).rounds())
    key = make_key()
    t = LoopbackTransport()
    run = "sim-0"
    coord_t = SealedTransport(t, Keyring("coordinator", {"client-000": key}, encrypt=encrypt), run)
    dev_t = SealedTransport(t, Keyring("client-000", {"coordinator": key}, encrypt=encrypt), run)
    service = coordinator_service(tiny(), coord_t, tmp_path / "run", bundle=digits, register_timeout=60, run_id=run)
    service.start()
    agent = device_agent(tiny(), 0, dev_t, tmp_path / "state", bundle=digits, run_id=run)
    heard: list[bytes] = []
    agent.start(register=False)
    inner = t._handlers["client-000"]  # a tap on the wire: what the coordinator sent, as a broker would see it
    t._handlers["client-000"] = lambda data: heard.append(bytes(data)) or inner(data)
    agent.register(timeout=30)
    service.wait(WAIT)
    got = service.records[0]
    for k in ("train_loss", "test_acc", "test_loss", "splits", "failures"):
        assert got[k] == rec[k], k
    assert heard and all(h[:1] == b"\xc1" for h in heard)  # only sealed frames crossed the transport
    if not encrypt:
        assert any(b"round_start" in h for h in heard) and any(b"bye" in h for h in heard)
    assert agent.rounds_done == 1 and agent.finished.is_set()  # the coordinator's own bye ended the run
    agent.finished.clear()
    genuine = list(heard)
    bye = encode(Message("bye", run, 1, 10_000, "coordinator", {"reason": "forged"}))
    forger = Keyring("coordinator", {"client-000": make_key()}, encrypt=encrypt)
    for payload in (bye, forger.seal("client-000", bye)):
        assert decode(t.request("coordinator", "client-000", payload)).kind == "error"
    for payload in genuine:  # the coordinator's round_start and bye, replayed as they were
        t.send("coordinator", "client-000", payload)
    agent.stop()
    assert not agent.finished.is_set() and agent.rounds_done == 1, agent.health()
    assert sum(dev_t.refused.values()) == 2
