"""The coordinator and device roles joined by the loopback transport, end to end on real digits."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from _runs import tiny_config
import torch

from fedsga_edge.config import FedSGAConfig, TrainConfig
from fedsga_edge.method.policy import split_index
from fedsga_edge.coordinator.clock import VirtualClock
from fedsga_edge.simulation import Simulation, run_simulation
from fedsga_edge.transport import Peer
from fedsga_edge.wire import decode

REQUIRED = {"round", "test_acc", "test_loss", "train_loss", "wall_s", "bytes_up", "bytes_down", "client_flops_per_sample", "splits"}


tiny = tiny_config


def test_static_run_writes_config_metrics_and_summary(tmp_path, digits) -> None:
    summary = run_simulation(tiny(), tmp_path, bundle=digits)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for r in rows:
        assert REQUIRED <= set(r)
        assert set(r["splits"].values()) == {2}
        assert r["bytes_up"] > 0 and r["bytes_down"] > 0
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["strategy"] == "static" and config["candidate_depths"] == [2, 3, 4]
    saved = json.loads((tmp_path / "summary.json").read_text())
    for key in ("final_acc", "best_acc", "client_flops_per_sample", "client_params", "bytes_total", "wall_s"):
        assert key in saved
    assert saved["bytes_total"] == sum(r["bytes_up"] + r["bytes_down"] for r in rows) == summary["bytes_total"]
    # The checkpoint loads back into a fresh model through the public loader.
    from fedsga_edge.models import create_model, load_weights

    fresh = create_model("resnet18_cifar", width=0.25, num_classes=10)
    assert load_weights(fresh, tmp_path / "checkpoint.pt") == []


def test_vit_fedsga_round_with_prompt_tokens(digits) -> None:
    cfg = tiny("fedsga", model="vit_tiny_c32", width=None, clients=2, rounds=1,
               train=TrainConfig(local_epochs=1, batch_size=16, max_batches=1))
    rec = next(Simulation(cfg, digits).rounds())
    assert rec["failures"] == {} and rec.get("remote_errors") is None
    assert all(1 <= k <= 3 for k in rec["splits"].values())


def test_same_seed_same_run(digits) -> None:
    a = [r for r in Simulation(tiny(), digits).rounds()]
    b = [r for r in Simulation(tiny(), digits).rounds()]
    for ra, rb in zip(a, b):
        assert ra["test_acc"] == rb["test_acc"] and ra["train_loss"] == rb["train_loss"]
        assert ra["bytes_up"] == rb["bytes_up"]


def test_the_deadline_falls_on_the_simulations_virtual_clock(digits) -> None:
    """One virtual second per device step and a 2.5 s deadline: each of three devices sends one
    activation, then all miss the deadline, every run alike (a real clock would drop them anywhere)."""
    runs = []
    for _ in range(2):
        sim = Simulation(tiny(rounds=1, round_timeout=2.5), digits, clock=VirtualClock(per_step=1.0))
        rec = next(sim.rounds())
        assert rec["failures"] == {c: "missed the round deadline" for c in sim.client_ids} and rec["splits"] == {}
        assert rec["round_s"] == 3.0 and not any(c.busy for c in sim.clients)
        runs.append(rec["bytes_up"])
    per_activation = 32 * int(np.prod(sim.model.interface_shape(sim.model.depth_of(2)))) * 4
    assert runs[0] == runs[1] and 3 * per_activation < runs[0] < 4 * per_activation


def test_bytes_counted_are_the_wire_bytes(digits) -> None:
    sim = Simulation(tiny(rounds=1), digits)
    rec = next(sim.rounds())
    stats = sim.transport.stats
    assert rec["bytes_up"] == sum(stats.bytes_sent(src=c) for c in sim.client_ids)
    # Upload is dominated by activations: batches * batch * activation elements * 4 bytes.
    per_sample = int(np.prod(sim.model.interface_shape(sim.model.depth_of(2)))) * 4
    assert rec["bytes_up"] > 3 * 3 * 32 * per_sample


@pytest.mark.parametrize("split", [2, 3])
def test_fully_ablated_fedsga_is_splitfed(digits, split: int) -> None:
    """FedSGA minus adaptation, estimator and harmonizer at --split must train exactly like static there
    (p_ref, and p_K: the fedsga-no-estimator-pK diagnostic's depth)."""
    off = FedSGAConfig(adapt=False, estimator=False, harmonizer=False)
    a = list(Simulation(tiny("fedsga", fedsga=off, split=split), digits).rounds())
    b = list(Simulation(tiny("static", split=split), digits).rounds())
    assert all(set(r["splits"].values()) == {split} for r in a)
    assert [r["test_acc"] for r in a] == [r["test_acc"] for r in b]
    assert [r["train_loss"] for r in a] == pytest.approx([r["train_loss"] for r in b], rel=1e-6)


def test_fedsga_records_observations_and_calibration(digits) -> None:
    rows = list(Simulation(tiny("fedsga", rounds=2, fedsga=FedSGAConfig(cal_every=2)), digits).rounds())
    for r in rows:
        assert set(r["clients"]) == set(r["splits"])
        for c in r["clients"].values():
            assert {"a", "delta", "q", "r"} <= set(c) and 0.0 < c["r"] < 1.0  # a sigmoid: never exactly 0 or 1 here
            assert c["k_policy"] == split_index(c["r"], 3, 0.1)  # Eq. 8 from the r the device reported
        assert "calibration" in r and r["calibration_flops"]["client"] > 0 and r["calibration_flops"]["server"] > 0
        assert all({"L1", "Lref", "s"} <= set(c) for c in r["clients"].values())
    # 3 clients x 1 calibration round: round 1's pairs (every device's first observation) are not stored
    assert rows[0]["calibration"]["pairs"] == 0 and rows[1]["calibration"]["pairs"] == 3


@pytest.mark.parametrize("strategy", ["fedavg", "fedprox", "random", "resource"])
def test_other_strategies_run(strategy: str, digits) -> None:
    rows = list(Simulation(tiny(strategy, rounds=1), digits).rounds())
    splits = set(rows[0]["splits"].values())
    if strategy in ("fedavg", "fedprox"):
        assert splits == {0} and rows[0]["bytes_up"] > 0  # whole model up, no activations
    else:
        assert splits <= {1, 2, 3}


def test_fedavg_with_one_client_adopts_its_weights(digits) -> None:
    sim = Simulation(tiny("fedavg", clients=1, rounds=1), digits)
    next(sim.rounds())
    client = sim.clients[0].model
    for (name, g), c in zip(sim.model.state_dict().items(), client.state_dict().values()):
        assert np.allclose(g.numpy(), c.numpy()), name


def test_coordinator_survives_malformed_messages(digits) -> None:
    sim = Simulation(tiny(rounds=1), digits)
    rogue = Peer(sim.transport, "rogue", "sim-0")
    # Undecodable bytes: an error reply, the coordinator keeps serving.
    reply = decode(sim.transport.request("rogue", "coordinator", b"\x93not msgpack at all"))
    assert reply.kind == "error"
    # A well-formed activation of the wrong shape: the device's error, answered, not raised.
    bad = {"z": np.zeros((2, 3, 4), np.float32), "y": np.zeros(2, np.int64), "split": 2}
    assert rogue.call("coordinator", "activation", 1, bad).kind == "error"
    assert rogue.call("coordinator", "activation", 1, bad | {"split": 9}).kind == "error"
    assert rogue.call("coordinator", "hello", 1, {}).kind == "error"
    assert rogue.call("coordinator", "fetch", 1, {"blocks": [[1]]}).kind == "error"
    probe = {"z1": np.zeros(2, np.float32), "zref": np.zeros(2, np.float32), "y": np.zeros(2, np.int64), "o": [0.0], "r_prev": 0.0}
    assert rogue.call("coordinator", "probe", 1, probe).kind == "error"
    rec = next(sim.rounds())  # and the round still runs normally
    assert rec["failures"] == {} and rec["test_acc"] > 0


def test_a_failing_device_does_not_stop_the_round(digits) -> None:
    sim = Simulation(tiny(rounds=1), digits)
    sim.transport.unregister("client-001")
    rec = next(sim.rounds())
    assert set(rec["splits"]) == {"client-000", "client-002"}
    assert "client-001" in rec["failures"]


def test_cli_bad_flag_is_a_message_not_a_traceback(tmp_path) -> None:
    cmd = [sys.executable, "-m", "fedsga_edge.cli.main", "simulate", "--strategy", "bogus", "--out", str(tmp_path)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=os.environ | {"COLUMNS": "250"})
    assert res.returncode == 2
    assert "--strategy must be one of" in res.stderr and "Traceback" not in res.stderr
    res = subprocess.run(cmd[:4] + ["--split", "7", "--rounds", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=300, env=os.environ | {"COLUMNS": "250"})
    assert res.returncode == 2 and "--split must be in 1..3" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.slow
@pytest.mark.full("the README's simulate example, 118 CPU-s (180 s in the suite); the README's main job, the "
                  "trial, runs in the default suite (tests/test_trial.py), and simulate's files in "
                  "test_static_run_writes_config_metrics_and_summary")
def test_quickstart_digits_static_reaches_85_percent(tmp_path) -> None:
    """The README's in-process run: the quick start trial's settings (3 clients, 2
    rounds), paper defaults otherwise. (The README's main job, the trial, is tests/test_trial.py's.)"""
    cmd = [sys.executable, "-m", "fedsga_edge.cli.main", "simulate", "--dataset", "digits", "--clients", "3",
           "--rounds", "2", "--model", "resnet18_cifar", "--width", "0.25", "--strategy", "static",
           "--seed", "0", "--out", str(tmp_path), "--quiet"]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["final_acc"] >= 0.85


def test_one_client_split_step_equals_local_step(digits) -> None:
    """With one client, a SplitFed step (client + server SGD, then aggregation) is the same computation as
    one local SGD step on the whole model. Only one step: at lr 0.1 an untrained BatchNorm net amplifies
    float-rounding differences (1e-7 after one step) to visible ones within three."""
    one = TrainConfig(local_epochs=1, batch_size=32, max_batches=1)
    split = Simulation(tiny("static", clients=1, rounds=1, split=1, train=one), digits)
    local = Simulation(tiny("fedavg", clients=1, rounds=1, train=one), digits)
    a, b = next(split.rounds()), next(local.rounds())
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-6)
    sa, sb = split.model.state_dict(), local.model.state_dict()
    for name in sa:
        assert torch.allclose(sa[name].double(), sb[name].double(), atol=1e-5), name


def test_resource_strategy_reads_a_measured_profile(tmp_path) -> None:
    from fedsga_edge.coordinator import resource_splits

    rows = [{"split": k, "variant": "fp32", "batch": b, "latency_ms": {"p50": ms * b}}
            for k, ms in ((1, 1.0), (2, 2.0), (3, 4.0)) for b in (1, 32)]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"results": rows}))
    splits, speed = resource_splits([f"c{i}" for i in range(50)], {1: 1, 2: 1, 3: 1}, seed=0, sigma=1.0, profile=path)
    for c, k in splits.items():  # budget = p_ref (2 ms) on a median device: deepest split that fits
        fits = [j for j, ms in ((1, 1.0), (2, 2.0), (3, 4.0)) if ms / speed[c] <= 2.0 * (1 + 1e-9)]
        assert k == (max(fits) if fits else 1)
    assert set(splits.values()) == {1, 2, 3}
    path.write_text(json.dumps({"results": rows[:2]}))
    with pytest.raises(ValueError, match=r"split\(s\) \[2, 3\]"):
        resource_splits(["c0"], {1: 1, 2: 1, 3: 1}, profile=path)


def test_device_answers_a_malformed_round_start_with_an_error(digits) -> None:
    sim = Simulation(tiny(rounds=1), digits)
    rogue = Peer(sim.transport, "rogue", "sim-0")
    bad_lr = rogue.call("client-000", "round_start", 1, {"train": {"lr": "fast"}, "weights": {}, "split": 1})
    assert bad_lr.kind == "error" and "TrainConfig.lr" in bad_lr.body["reason"]
    assert rogue.call("client-000", "round_start", 1, {"weights": {}}).kind == "error"
    assert rogue.call("client-000", "gradient", 1, {"dz": np.zeros(1, np.float32), "loss": 0.0}).kind == "error"
    assert decode(sim.transport.request("rogue", "client-000", b"\x00garbage")).kind == "error"
    rec = next(sim.rounds())  # the device still trains normally afterwards
    assert rec["failures"] == {}


def test_per_client_server_copies_with_one_client_is_the_shared_copy(digits) -> None:
    a = list(Simulation(tiny(clients=1, rounds=2), digits).rounds())
    b = list(Simulation(tiny(clients=1, rounds=2, server_copies="per_client"), digits).rounds())
    assert [r["test_acc"] for r in a] == [r["test_acc"] for r in b]
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]


def test_per_client_server_copies_average_the_server_side(digits) -> None:
    """Two clients: the server side after the round is the data-weighted mean of what each trained."""
    sim = Simulation(tiny(clients=2, rounds=1, server_copies="per_client", fedsga=FedSGAConfig()), digits)
    co = sim.coordinator
    seen = []
    on_update = co._handlers["update"]

    def spy(msg):
        seen.append((float(co.clients[msg.sender]), co.server.copy_for(msg.sender).model.blocks[4].layer[0].conv1.weight.detach().clone()))
        return on_update(msg)

    co._handlers["update"] = spy
    next(sim.rounds())
    (n1, w1), (n2, w2) = seen
    # blocks[4] runs only on the server at split 2, so the global value is exactly the weighted mean.
    assert torch.allclose(co.model.blocks[4].layer[0].conv1.weight, (n1 * w1 + n2 * w2) / (n1 + n2), atol=1e-6)
    assert not torch.allclose(w1, w2)


def test_calibration_round_downloads_each_block_once(digits) -> None:
    sim = Simulation(tiny("fedsga", clients=1, rounds=1), digits)
    fetched: list[list[int]] = []
    call = sim.clients[0].peer.call

    def spy(dst, kind, rnd, body):
        if kind == "fetch":
            fetched.append(list(body["blocks"]))
        return call(dst, kind, rnd, body)

    sim.clients[0].peer.call = spy
    rec = next(sim.rounds())
    blocks = [j for f in fetched for j in f]
    assert len(blocks) == len(set(blocks)), fetched
    assert "L1" in rec["clients"]["client-000"]  # round 1 calibrates
