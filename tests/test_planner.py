"""The planner strategy: each device's fastest split from its measured compute speed and link
rate, re-planned every round; on the virtual clock (``simulate --fleet``) and digits, a few seconds a run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from _runs import tiny_config, write_fleet

from fedsga_edge.config import TrainConfig

# resnet18_cifar at width 0.125 (K = 3): per sample p_1 trains 15 MFLOP and sends 8192 values each way, p_3 40 MFLOP
# and 2048 values. On a 0.5 GFLOP/s CPU, p_1 is the faster split over a fast link and p_3 over a slow one.
FAST = {"count": 2, "gflops": 50.0, "uplink_mbps": 200.0, "downlink_mbps": 400.0, "rtt_ms": 2.0}
SLOW_CPU = {"count": 2, "gflops": 0.5, "uplink_mbps": 100.0, "downlink_mbps": 100.0, "rtt_ms": 2.0}


def _config(strategy: str, fleet: str, rounds: int, **kw: Any) -> Any:
    return tiny_config(strategy, clients=4, rounds=rounds, width=0.125, fleet=fleet, server_copies="per_client",
                       train=TrainConfig(local_epochs=1, batch_size=16, max_batches=2), **kw)


def test_a_device_whose_link_slows_mid_run_moves_its_split_within_two_rounds(tmp_path: Path) -> None:
    from fedsga_edge.simulation import Simulation

    sim = Simulation(_config("planner", write_fleet(tmp_path / "f.toml", {"fast": FAST, "slow_cpu": SLOW_CPU}), 5))
    classes = sim.scheduler.classes
    slow = [c for c in sim.client_ids if classes[c].name == "slow_cpu"]
    records = [sim.run_round(t) for t in (1, 2)]
    for rec in records:  # over its fast link the slow CPU cuts shallow; every split came from a prediction
        assert all(rec["splits"][c] == 1 for c in slow), rec["splits"]
        assert all(p["predicted_s"] is not None for p in rec["plan"].values())
    # round 2 is planned from round 1's measured rates, not the class's: its prediction meets the clock
    for c in slow:
        t = records[1]["timing"][c]
        assert records[1]["plan"][c]["predicted_s"]["1"] == pytest.approx(t["compute_s"] + t["wire_s"], rel=0.1)
    moved = slow[0]
    classes[moved] = dataclasses.replace(classes[moved], uplink_mbps=0.5, downlink_mbps=0.5)  # its link, switched
    later = [sim.run_round(t) for t in (3, 4, 5)]
    assert later[0]["splits"][moved] == 1  # planned before the slow round was measured
    assert later[1]["splits"][moved] == 3 and later[2]["splits"][moved] == 3  # moved within two rounds
    assert all(r["splits"][slow[1]] == 1 for r in later)  # the other slow CPU kept its fast link and its split
    # at its deeper split the device's round is shorter than it was at p_1 on the slow link
    busy = [r["timing"][moved]["compute_s"] + r["timing"][moved]["wire_s"] for r in later]
    assert busy[1] < 0.6 * busy[0]


def test_with_per_client_server_copies_the_planner_trains_as_splitfed_does(tmp_path: Path) -> None:
    """On a fleet where every device's fastest split is the same, the planner's run is SplitFed's at that split,
    loss for loss (with a server copy per device the split is a cost choice only)."""
    from fedsga_edge.simulation import Simulation

    fleet = write_fleet(tmp_path / "f.toml", {"slow_cpu": {**SLOW_CPU, "count": 4}})
    plan = Simulation(_config("planner", fleet, 2))
    planned = list(plan.rounds())
    assert {k for r in planned for k in r["splits"].values()} == {1}
    static = list(Simulation(_config("static", fleet, 2, split=1)).rounds())
    for a, b in zip(planned, static):
        assert a["train_loss"] == b["train_loss"] and a["test_loss"] == b["test_loss"]
        assert a["test_acc"] == b["test_acc"]


def test_a_memory_budget_rules_out_the_splits_it_cannot_fit(tmp_path: Path) -> None:
    from fedsga_edge.coordinator.strategies.planner import Planner
    from fedsga_edge.simulation import Simulation
    from fedsga_edge.latency import ProfileError, hello_profile, hello_profile_problem

    report = {"model": {"arch": "resnet18_cifar"},
              "results": [{"split": k, "batch": 8, "variant": "fp32", "train_step_ms": {"p50": 8.0 * s},
                           "rss_peak_mb": mb} for k, s, mb in ((1, 1.0, 90.0), (2, 3.0, 150.0), (3, 9.0, 400.0))]}
    hello = hello_profile(report, "resnet18_cifar", 3, memory_mb=200.0)
    assert hello["peak_mb"] == {"1": 90.0, "2": 150.0, "3": 400.0} and hello["memory_mb"] == 200.0
    assert hello_profile_problem(hello, "resnet18_cifar", 3) is None
    assert "memory_mb" in hello_profile_problem({**hello, "memory_mb": -1}, "resnet18_cifar", 3)
    with pytest.raises(ProfileError, match="no split fits"):
        hello_profile(report, "resnet18_cifar", 3, memory_mb=50.0)
    with pytest.raises(ProfileError, match="peak memory"):
        hello_profile({**report, "results": [{k: v for k, v in r.items() if k != "rss_peak_mb"}
                                             for r in report["results"]]}, "resnet18_cifar", 3, memory_mb=500.0)

    cfg = tiny_config("planner", clients=1, width=0.125, split=3)
    planner = Planner(cfg, 3, ["client-000"], {})
    planner.device_registered("client-000", {"profile": hello})
    assert planner.assign(1, ["client-000"]) == {"client-000": 2}  # nothing known, its --split (p_3) does not fit

    # over slow links p_3 is the fastest split; the device whose budget p_3's peak exceeds trains at p_2
    slow_link = {**FAST, "count": 4, "uplink_mbps": 1.0, "downlink_mbps": 1.0}
    sim = Simulation(_config("planner", write_fleet(tmp_path / "f.toml", {"slow_link": slow_link}), 2))
    sim.strategy.device_registered("client-000", {"profile": hello})
    for rec in sim.rounds():
        assert rec["splits"] == {"client-000": 2, "client-001": 3, "client-002": 3, "client-003": 3}
        assert set(rec["plan"]["client-000"]["predicted_s"]) == {"1", "2"}


def test_deadline_aware_fedsga_predicts_from_what_the_devices_measured(tmp_path: Path) -> None:
    """FedSGA's --deadline-aware predicts with the planner's measured rates: a device whose link slows is predicted
    slower from the round after, and its prediction then meets the virtual clock."""
    from fedsga_edge.config import FedSGAConfig
    from fedsga_edge.simulation import Simulation

    cfg = _config("fedsga", write_fleet(tmp_path / "f.toml", {"fast": {**FAST, "count": 4}}), 3, round_timeout=60.0,
                  fedsga=FedSGAConfig(rho=1.0, deadline_aware=True))
    sim = Simulation(cfg)
    recs = [sim.run_round(1)]
    moved, kept = "client-000", "client-001"
    classes = sim.scheduler.classes
    classes[moved] = dataclasses.replace(classes[moved], uplink_mbps=2.0, downlink_mbps=2.0)
    recs += [sim.run_round(t) for t in (2, 3)]
    told = [r["deadline"]["split_s"] for r in recs]
    assert told[2][moved][0] > 5 * told[1][moved][0]  # measured in round 2, predicted in round 3
    assert told[2][kept][0] == pytest.approx(told[1][kept][0], rel=0.2)
    t = recs[2]["timing"][moved]
    predicted = told[2][moved][recs[2]["splits"][moved] - 1]
    assert 0.8 * predicted <= t["compute_s"] + t["wire_s"] <= 1.2 * predicted


def test_a_memory_budget_without_a_profile_is_refused_before_anything_connects(tmp_path: Path) -> None:
    from fedsga_edge.fieldroles import FieldError, run_device

    with pytest.raises(FieldError, match="--memory-mb needs --latency-profile"):
        run_device(tiny_config("planner"), 0, "mqtt://127.0.0.1:1", tmp_path, backend="torch", artifacts=None,
                   max_packet=1 << 16, threads=1, request_timeout=1.0, data=None, fleet_link="off",
                   latency_profile=None, memory_mb=100.0)
