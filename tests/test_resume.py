"""Coordinator ``--resume RUN``: a killed coordinator continues from its last checkpoint (docs/protocol.md, "Faults").

In process over the loopback: a run stopped after round 1 and resumed computes round 2 exactly as
an uninterrupted run does (bit for bit), metrics.jsonl keeps each round once, and a checkpoint
made with other settings is refused by name. With real processes: kill -9 the coordinator of a
one-device run after round 1, restart it with ``--resume``, and the run's three rounds equal
``simulate``'s (one device: no arrival order to differ).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _bench import load_bench

from fedsga_edge.config import RunConfig, TrainConfig
from fedsga_edge.runbuild import coordinator_service, device_agent
from fedsga_edge.transport import LoopbackTransport

WAIT = 180.0


def tiny(**kw) -> RunConfig:
    base = dict(dataset="digits", clients=1, rounds=2, model="resnet18_cifar", width=0.25, seed=0, device="cpu",
                strategy="fedsga", round_timeout=120.0, train=TrainConfig(local_epochs=1, batch_size=32, max_batches=2))
    return RunConfig(**(base | kw))


def _run(cfg: RunConfig, digits, run_dir: Path, state_dir: Path, *, resume: bool = False):
    """One coordinator service and ``cfg.clients`` agents over a fresh loopback, to the end of ``cfg.rounds``."""
    transport = LoopbackTransport()
    agents = [device_agent(cfg, i, transport, state_dir / str(i), bundle=digits) for i in range(cfg.clients)]
    for agent in agents:
        agent.start(register=False)  # serving before the coordinator: a resumed one starts its round at once
    service = coordinator_service(cfg, transport, run_dir, bundle=digits, register_timeout=60, resume=resume)
    service.start()
    if not resume:  # a resumed coordinator knows its devices from devices.json: no hello needed
        for agent in agents:
            agent.register(timeout=30)
    service.wait(WAIT)
    for agent in agents:
        assert agent.finished.wait(10)
        agent.stop()
    return service


def test_a_resumed_run_equals_the_uninterrupted_one_bit_for_bit(digits, tmp_path) -> None:
    straight = _run(tiny(), digits, tmp_path / "straight", tmp_path / "s0")
    run = tmp_path / "run"
    _run(tiny(rounds=1), digits, run, tmp_path / "d0")  # "killed" after round 1: a new process takes over
    first = (run / "metrics.jsonl").read_text()
    with (run / "metrics.jsonl").open("a") as f:
        f.write('{"round": 2, "train_lo')  # torn by the kill: the checkpoint, not this file, says what is done

    with pytest.raises(ValueError, match=r"train\.lr: 0\.1 -> 0\.05"):
        coordinator_service(tiny(train=TrainConfig(local_epochs=1, batch_size=32, max_batches=2, lr=0.05)),
                            LoopbackTransport(), run, bundle=digits, resume=True)

    ck = torch.load(run / "checkpoint.pt", weights_only=True)  # as an older version wrote it: settings added
    for key in ("wire_format", "server_bn"):                   # since then are missing and take their defaults
        del ck["resume"]["config"][key]
    torch.save(ck, run / "checkpoint.pt")

    resumed = _run(tiny(), digits, run, tmp_path / "d0", resume=True)  # rounds 1 -> 2 is a change resume allows
    assert resumed.resumed_from == 1
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["round"] for line in lines] == [1, 2] and lines[0] + "\n" == first
    a, b = straight.records[1], json.loads(lines[1])
    for key in ("train_loss", "test_acc", "test_loss", "test_acc_by_split", "splits", "clients", "client_flops_per_sample"):
        assert a[key] == b[key], key  # exactly: every piece of state came back
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["final_acc"] == a["test_acc"]
    events = [json.loads(line) for line in (run / "coordinator.log").read_text().splitlines()]
    resume = next(e for e in events if e["event"] == "resume")
    assert resume["from_round"] == 1 and resume["dropped_metrics_lines"] == 1 and resume["registered"] == ["client-000"]


def test_a_resumed_run_keeps_the_servers_batchnorm_context(digits, tmp_path) -> None:
    """--server-bn-context rows outlive the round, so the checkpoint carries them (docs/method.md).
    (Two agents in threads arrive in no fixed order, so this compares the state, not the next round.)"""
    cfg = tiny(rounds=1, clients=2, strategy="static", server_bn_context=1)
    _run(cfg, digits, tmp_path / "run", tmp_path / "d0")
    saved = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=True)["resume"]["bn_context"]
    assert sorted(saved[cfg.split]) == ["client-000", "client-001"]  # n + 1 rows kept at the split
    resumed = coordinator_service(tiny(clients=2, strategy="static", server_bn_context=1), LoopbackTransport(),
                                  tmp_path / "run", bundle=digits, resume=True)
    back = resumed.co.server.rows
    assert back.keys() == saved.keys() and all(
        back[k].keys() == rows.keys() and all(torch.equal(back[k][d], z) for d, z in rows.items())
        for k, rows in saved.items())


def test_resume_needs_a_resumable_checkpoint(digits, tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoint.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="cannot resume from"):
        coordinator_service(tiny(), LoopbackTransport(), run, bundle=digits, resume=True)


@pytest.fixture(scope="module")
def faults():
    return load_bench("faults", needs_mosquitto=True)


@pytest.mark.full("kill -9 of a coordinator process and its resume beside simulate (about 30 s on the shared 2 cores)")
@pytest.mark.slow
@pytest.mark.integration
def test_kill_9_the_coordinator_and_resume_matches_simulate(faults, tmp_path) -> None:
    from typer.testing import CliRunner

    from fedsga_edge.cli.main import app

    settings = faults.Settings(clients=1, rounds=3, round_timeout=120.0, request_timeout=10.0)
    row = faults.run_scenario("coordinator_killed", tmp_path / "faults", settings)
    assert row["outcome"] == "ok", json.dumps(row["checks"], indent=1)
    field = faults.read_jsonl(tmp_path / "faults" / "coordinator_killed" / "run" / "metrics.jsonl")

    sim = tmp_path / "sim"
    res = CliRunner().invoke(app, ["simulate", *settings.run_flags(), "--out", str(sim), "--quiet", "--threads", "1"])
    assert res.exit_code == 0, res.output
    ref = faults.read_jsonl(sim / "metrics.jsonl")
    assert [r["round"] for r in field] == [r["round"] for r in ref] == [1, 2, 3]
    for a, b in zip(field, ref):
        assert a["splits"] == b["splits"] and a["test_acc"] == b["test_acc"], a["round"]
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6), a["round"]
