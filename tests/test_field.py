"""The field drivers: CoordinatorService and DeviceAgents in real time over a threaded transport.

Everything runs over the loopback transport, with each agent training on its own worker thread,
so the coordinator sees the devices' requests truly interleaved, as it will over MQTT. Configs are
tiny (digits, ResNet-18 at width 0.25, two batches per round) and every wait has a timeout.
The last tests check how ``fedsga-edge device | coordinator`` layer their settings: flag, then
``FEDSGA_EDGE_<NAME>``, then a TOML file, then the default (parsed by click, nothing run).
"""

from __future__ import annotations

import json
import threading

import numpy as np
from _runs import assert_test_accuracy
import pytest
import torch

from fedsga_edge.config import RunConfig, TrainConfig
from fedsga_edge.runbuild import build_client, coordinator_service, device_agent, plan_run
from fedsga_edge.simulation import Simulation
from fedsga_edge.transport import LoopbackTransport, Peer
from fedsga_edge.device.agent import STATE_FILE, DeviceAgent
from fedsga_edge.wire import Message, decode, encode

WAIT = 180.0  # seconds any one run may take before the test fails instead of hanging


def tiny(strategy: str = "static", **kw) -> RunConfig:
    base = dict(dataset="digits", clients=3, rounds=2, model="resnet18_cifar", width=0.25, seed=0, device="cpu",
                round_timeout=120.0, train=TrainConfig(local_epochs=1, batch_size=32, max_batches=2))
    return RunConfig(strategy=strategy, **(base | kw))


def _start(cfg: RunConfig, digits, tmp_path, agents: int | None = None, **service_kwargs):
    transport = LoopbackTransport()
    service = coordinator_service(cfg, transport, tmp_path / "run", bundle=digits, register_timeout=60,
                                  **service_kwargs)
    service.start()
    started = []
    for i in range(cfg.clients if agents is None else agents):
        agent = device_agent(cfg, i, transport, tmp_path / f"state-{i}", bundle=digits)
        agent.start(timeout=30)
        started.append(agent)
    return transport, service, started


def test_both_sides_derive_the_simulations_partitions(digits) -> None:
    cfg = tiny(partition="dirichlet", alpha=0.5, train_subset=900)
    sim = Simulation(cfg, digits)
    coordinator_side = plan_run(tiny(partition="dirichlet", alpha=0.5, train_subset=900), digits)
    device_side = plan_run(tiny(partition="dirichlet", alpha=0.5, train_subset=900), digits, seed_globals=False)
    for plan in (coordinator_side, device_side):
        assert plan.client_ids == sim.client_ids
        assert all(np.array_equal(a, b) for a, b in zip(plan.parts, sim.parts))
    client = build_client(device_side, 2, peer=None)
    assert np.array_equal(client.data.indices, sim.parts[2]) and client.cid == "client-002"
    assert coordinator_side.sizes == sim.coordinator.clients


def test_one_device_service_round_equals_the_simulation_bit_for_bit(digits, tmp_path) -> None:
    """With one device there is no interleaving to differ, so real time must change no number."""
    cfg = dict(clients=1, rounds=1, schedule="sequential")
    rec = next(Simulation(tiny("fedsga", **cfg), digits).rounds())
    _, service, agents = _start(tiny("fedsga", **cfg), digits, tmp_path)
    service.wait(WAIT)
    for a in agents:
        a.stop()
    got = service.records[0]
    for key in ("train_loss", "test_acc", "test_loss", "test_acc_by_split", "splits", "bytes_up", "bytes_down",
                "client_flops_per_sample", "failures"):
        assert got[key] == rec[key], key
    assert got["clients"]["client-000"]["r"] == rec["clients"]["client-000"]["r"]


@pytest.mark.parametrize("strategy", ["static", "fedbabu"])
def test_a_field_run_ends_with_the_devices_evaluation_of_the_final_model(digits, tmp_path, strategy) -> None:
    """After the last round the service runs the final evaluation over the transport: every device scores the
    model the run ended with on its held-out slice (a split device through the coordinator's suffix, FedBABU's
    whole-model device with its fine-tuned head too), recorded as the last round's ``fed_final`` against that
    round, in metrics.jsonl and the summary; it trains nothing, so the agents count one round done."""
    cfg = tiny(strategy, clients=2, rounds=1, eval_holdout=0.25)
    _, service, agents = _start(cfg, digits, tmp_path)
    summary = service.wait(WAIT)
    rec = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    final = rec["fed_final"]
    assert rec["fed_model_round"] == 0 and final["fed_model_round"] == 1 and not final["failures"]
    assert set(final["fed_by_device"]) == {"client-000", "client-001"} and 0 <= final["fed_acc"] <= 1
    assert ("fed_acc_finetuned" in final) == (strategy == "fedbabu")
    assert summary["fed_model_round"] == 1 and summary["final_fed_acc"] == final["fed_acc"]
    for a in agents:
        assert a.finished.wait(10) and a.health()["rounds_done"] == 1 and a.health()["last_error"] is None
        a.stop()


def test_three_agents_two_rounds_then_a_restart_keeps_private_state(digits, tmp_path) -> None:
    cfg = tiny("fedsga")
    transport, service, agents = _start(cfg, digits, tmp_path)
    summary = service.wait(WAIT)
    ids = {"client-000", "client-001", "client-002"}
    assert len(service.records) == 2
    for rec in service.records:
        assert set(rec["splits"]) == ids and rec["failures"] == {}
        assert rec["bytes_up"] > 0 and rec["bytes_down"] > 0
        assert_test_accuracy(rec, len(digits.test))
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    config = json.loads((run / "config.json").read_text())
    assert config["strategy"] == "fedsga" and config["client_sizes"] == service.co.clients
    saved = json.loads((run / "summary.json").read_text())
    assert saved["rounds"] == 2 and saved["final_acc"] == summary["final_acc"] == rows[-1]["test_acc"]
    assert set(saved["devices"]) == ids and saved["failures"] == 0
    ckpt = torch.load(run / "checkpoint.pt", map_location="cpu", weights_only=True)
    assert ckpt["round"] == 2 and ckpt["arch"] == "resnet18_cifar"
    assert ckpt["coordinator"].keys() == service.co.state_dict().keys()  # whatever the coordinator's state holds
    events = [json.loads(line) for line in (run / "coordinator.log").read_text().splitlines()]
    assert all({"ts", "level", "event"} <= set(e) for e in events)
    names = [e["event"] for e in events]
    assert names.count("hello_ack") == 3 and names.count("round_end") == 2 and names.count("update") == 6
    for a in agents:
        assert a.finished.wait(10)  # the service said bye
        h = a.health()
        assert h["rounds_done"] == 2 and h["state_rounds"] == 2 and not h["busy"] and h["last_error"] is None

    before = agents[0].client.state
    assert before.prompts is not None and before.m_last is not None and 0 < before.r_prev <= 1
    rng_state = agents[0].client.rng.bit_generator.state
    for a in agents:
        a.stop()
    again = device_agent(cfg, 0, transport, tmp_path / "state-0", bundle=digits)  # a fresh process would do the same
    after = again.client.state
    assert again.restored and again.health()["rounds_done"] == 2
    assert np.array_equal(after.prompts, before.prompts) and after.r_prev == before.r_prev
    assert np.array_equal(after.m_last, before.m_last) and np.array_equal(after.m_prev, before.m_prev)
    assert np.array_equal(after.H_prev, before.H_prev) and after.rounds == 2
    assert again.client.rng.bit_generator.state == rng_state  # no replay of round 1's batch order
    again.log.close()
    with pytest.raises(ValueError, match="use another --state-dir"):  # another device's state is refused
        device_agent(cfg, 1, transport, tmp_path / "state-0", bundle=digits)


def test_a_service_stopped_before_any_device_came_writes_an_empty_run(digits, tmp_path) -> None:
    service = coordinator_service(tiny("static"), LoopbackTransport(), tmp_path / "run", bundle=digits,
                                  register_timeout=60)
    service.stop()  # before anyone said hello: no round runs, the run files still say so
    summary = service.run()
    service.close()
    run = tmp_path / "run"
    text = (run / "summary.json").read_text()
    assert "NaN" not in text and json.loads(text) == summary
    assert summary["rounds"] == 0 and summary["final_acc"] is None and summary["client_flops_per_sample"] is None
    assert (run / "metrics.jsonl").read_text() == "" and not (run / "checkpoint.pt").exists()


class _FreezesMidRound(DeviceAgent):
    """Stalls after its first request of a round until stopped: a device that dies mid-round."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.stepped = threading.Event()

    def _step(self) -> bool:
        more = super()._step()
        self.stepped.set()
        self._stop.wait(WAIT)
        return more


def test_a_device_stopped_mid_round_fails_at_the_deadline_and_the_run_goes_on(digits, tmp_path) -> None:
    cfg = tiny("static", round_timeout=10.0)
    transport = LoopbackTransport()
    service = coordinator_service(cfg, transport, tmp_path / "run", bundle=digits, register_timeout=60)
    service.start()
    plan = plan_run(cfg, digits, seed_globals=False)
    agents = [device_agent(cfg, i, transport, tmp_path / f"state-{i}", plan=plan) for i in range(2)]
    peer = Peer(transport, "client-002", "sim-0")
    victim = _FreezesMidRound(build_client(plan, 2, peer), peer, tmp_path / "state-2")
    for a in [*agents, victim]:
        a.start(timeout=30)
    assert victim.stepped.wait(WAIT)
    assert victim.health()["busy"]
    victim.stop()
    service.wait(WAIT)
    r1, r2 = service.records
    assert set(r1["splits"]) == set(r2["splits"]) == {"client-000", "client-001"}
    assert r1["failures"] == {"client-002": "missed the round deadline"}
    assert r2["failures"]["client-002"].startswith("round_start not delivered")  # gone from the transport
    assert r1["round_s"] >= 10.0 and r2["round_s"] < 10.0
    assert not (tmp_path / "state-2" / STATE_FILE).exists()  # it never finished a round: nothing to keep
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["failures"] == 2
    for a in agents:
        assert a.health()["rounds_done"] == 2
        a.stop()


def test_hello_is_checked_and_an_agent_retries_until_the_coordinator_is_up(digits, tmp_path) -> None:
    cfg = tiny("static", rounds=1)
    transport = LoopbackTransport()
    early = device_agent(cfg, 1, transport, tmp_path / "state-1", bundle=digits, retry_s=0.1)
    early.start(register=False)
    acked: list[dict] = []
    hello = threading.Thread(target=lambda: acked.append(early.register(timeout=60)))
    hello.start()  # the coordinator is not serving yet: the first hellos fail and are retried
    service = coordinator_service(cfg, transport, tmp_path / "run", bundle=digits, min_devices=1)
    hello.join(WAIT)
    assert acked and acked[0]["registered"] == 1 and early.registered
    n = service.co.clients["client-000"]
    good = {"backend": "torch", "num_samples": n, "capabilities": {}}
    refused = [
        Peer(transport, "intruder", "sim-0").call("coordinator", "hello", 0, good),  # no partition for it
        Peer(transport, "client-000", "sim-0").call("coordinator", "hello", 0, good | {"num_samples": n + 1}),
        Peer(transport, "client-000", "sim-0").call("coordinator", "hello", 0, {"num_samples": "many"}),
        decode(transport.request("client-000", "coordinator", encode(Message("hello", "x", 0, 1, "client-000", good)))),
        decode(transport.request("client-000", "coordinator", b"\x93garbage")),
    ]
    assert [m.kind for m in refused] == ["error"] * 5
    assert "unknown device" in refused[0].body["reason"] and "does not match" in refused[1].body["reason"]
    assert set(service.registered) == {"client-001"}
    assert Peer(transport, "client-000", "sim-0").call("coordinator", "hello", 0, good).kind == "ack"
    events = [json.loads(line)["event"] for line in (tmp_path / "run" / "coordinator.log").read_text().splitlines()]
    # the intruder is refused on its envelope, before its body is decoded (message_rejected); the two
    # hellos of a real device with a wrong body by the service (hello_refused)
    assert events.count("hello_refused") == 2 and events.count("hello_ack") == 2
    assert events.count("message_rejected") == 3  # the intruder, the other run, the garbage
    early.stop()
    service.close()


# -- configuration layers of `fedsga-edge device | coordinator`: flag > FEDSGA_EDGE_* > TOML > default ----------

def _parsed(command: str, args: list[str]):
    """What click resolves for ``command`` (every layer applied), without running it."""
    import typer.main

    from fedsga_edge.cli.main import app

    return typer.main.get_command(app).commands[command].make_context(command, list(args))


def test_flags_beat_environment_beat_the_toml_file_beat_defaults(tmp_path, monkeypatch) -> None:
    toml = tmp_path / "device.toml"
    toml.write_text('broker = "mqtt://from-file:1883"\nindex = 2\nstate_dir = "/from/file"\nrounds = 7\nseed = 3\n'
                    'model_arg = ["depth=1"]\nno_adapt = true\nwidth = 1\n')
    monkeypatch.setenv("FEDSGA_EDGE_CONFIG", str(toml))
    monkeypatch.setenv("FEDSGA_EDGE_SEED", "5")
    monkeypatch.setenv("FEDSGA_EDGE_STATE_DIR", "/from/env")
    ctx = _parsed("device", ["--index", "1", "--state-dir", "/from/flag"])
    p = ctx.params
    assert p["index"] == 1 and str(p["state_dir"]) == "/from/flag"  # flag over environment over file
    assert p["seed"] == 5  # environment over file
    assert p["broker"] == "mqtt://from-file:1883" and p["rounds"] == 7 and p["no_adapt"] is True  # file over default
    assert p["model_arg"] == ["depth=1"] and p["width"] == 1.0
    assert p["clients"] == 20 and p["backend"] == "torch"  # defaults
    monkeypatch.delenv("FEDSGA_EDGE_CONFIG")
    other = tmp_path / "other.toml"
    other.write_text('run_dir = "/runs/a"\nregister_timeout = 12.5\n')
    monkeypatch.setenv("FEDSGA_EDGE_BROKER", "mqtt://from-env:1883")
    c = _parsed("coordinator", ["--config-file", str(other)]).params
    assert c["broker"] == "mqtt://from-env:1883" and str(c["run_dir"]) == "/runs/a" and c["register_timeout"] == 12.5


def _cli(args: list[str], **env: str):
    from typer.testing import CliRunner

    from fedsga_edge.cli.main import app

    return CliRunner().invoke(app, args, env={"COLUMNS": "300", **env})


def test_a_bad_config_file_is_refused_naming_the_key_and_the_file(tmp_path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('broker = "mqtt://127.0.0.1:1"\nstate-dir = "/x"\n')
    res = _cli(["device", "--config-file", str(bad), "--index", "0"])
    assert res.exit_code == 2 and "unknown key 'state-dir'" in res.output and "did you mean 'state_dir'" in res.output
    assert str(bad) in res.output
    bad.write_text('rounds = "many"\n')
    res = _cli(["coordinator", "--config-file", str(bad)])
    assert res.exit_code == 2 and "key 'rounds' must be an integer, not a string 'many'" in res.output
    bad.write_text('index = 0\n')  # a device's key, not the coordinator's
    res = _cli(["coordinator"], FEDSGA_EDGE_CONFIG=str(bad))
    assert res.exit_code == 2 and "unknown key 'index'" in res.output
    bad.write_text('rounds = \n')
    res = _cli(["device", "--config-file", str(bad)])
    assert res.exit_code == 2 and "is not valid TOML" in res.output


def test_run_flags_next_to_a_run_config_are_refused(tmp_path) -> None:
    cfg = tmp_path / "run_config.json"
    cfg.write_text(json.dumps(tiny().to_dict()))
    res = _cli(["device", "--broker", "mqtt://127.0.0.1:1", "--index", "0", "--state-dir", str(tmp_path / "s"),
                "--config", str(cfg), "--rounds", "3"], FEDSGA_EDGE_SEED="4")
    assert res.exit_code == 2 and "--rounds (command line)" in res.output and "FEDSGA_EDGE_SEED (environment)" in res.output
