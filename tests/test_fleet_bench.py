"""benchmarks/fleet.py: the time-to-accuracy table on a fleet, and FedSGA's deadline-aware
split policy (``--deadline-aware``): never a split whose predicted round misses the deadline."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _bench import load_bench
from _runs import tiny_config, write_fleet

from fedsga_edge.config import FedSGAConfig, TrainConfig
from fedsga_edge.method.policy import deadline_split


# -- the rule -------------------------------------------------------------------------------------------------
def test_deadline_split_never_picks_a_split_that_misses() -> None:
    # a slow link: p_1's activations are the largest, so p_1 misses and deeper splits fit
    assert deadline_split(1, [6.0, 4.5, 4.3], 5.0) == 2  # nearest fitting split to the policy's choice
    assert deadline_split(3, [6.0, 4.5, 4.3], 5.0) == 3  # the policy's own choice when it fits
    # a slow CPU: the deep split misses
    assert deadline_split(3, [1.2, 1.9, 2.7], 2.5) == 2
    assert deadline_split(3, [1.2, 1.9, 2.7], 1.5) == 1
    # equally near on both sides: the shallower (fewer client FLOPs)
    assert deadline_split(2, [1.0, 9.0, 1.0], 5.0) == 1
    # a calibration round prefers splits >= p_ref, but not over the deadline
    assert deadline_split(1, [1.0, 2.0, 3.0], 2.5, floor=2) == 2
    assert deadline_split(2, [1.0, 3.0, 3.5], 2.5, floor=2) == 1
    # nothing fits: the fastest split
    assert deadline_split(1, [9.0, 7.0, 8.0], 5.0) == 2
    for times in ([6.0, 4.5, 4.3], [1.2, 1.9, 2.7], [4.0, 5.0, 6.0], [5.0, 5.0, 5.0]):
        for k in (1, 2, 3):
            for floor in (1, 2):
                got = deadline_split(k, times, 5.0, floor)
                assert times[got - 1] <= 5.0, (times, k, floor, got)


@pytest.mark.parametrize("args", [(0, [1.0, 2.0], 3.0), (1, [1.0, float("nan")], 3.0), (1, [1.0, -1.0], 3.0),
                                  (1, [1.0, 2.0], 0.0), (1, [], 3.0), (1, [1.0, "2"], 3.0)])
def test_deadline_split_refuses_malformed_predictions(args: tuple[Any, ...]) -> None:
    with pytest.raises(ValueError):
        deadline_split(*args)


# -- the option in a run --------------------------------------------------------------------------------------
# Two fast devices and two on a slow CPU (fast link): deeper splits cost them more compute. Predicted rounds of a
# slow device (width 0.125, 2 batches of 16): about 1.2 / 1.9 / 2.7 s at p_1 / p_2 / p_3 (with round 1's probe
# 1.5 / 2.2 / 3.0 s); a deadline of 2.5 s leaves p_3 out. rho = 1 makes the policy pick p_K every round.
FAST = {"count": 2, "gflops": 50.0, "uplink_mbps": 200.0, "downlink_mbps": 400.0, "rtt_ms": 2.0}
SLOW_CPU = {"count": 2, "gflops": 0.5, "uplink_mbps": 100.0, "downlink_mbps": 100.0, "rtt_ms": 5.0}
DEADLINE = 2.5


def _deadline_run(tmp_path: Path, aware: bool) -> tuple[Any, list[dict[str, Any]]]:
    from fedsga_edge.simulation import Simulation

    fleet = write_fleet(tmp_path / "fleet.toml", {"fast": FAST, "slow_cpu": SLOW_CPU})
    cfg = tiny_config("fedsga", clients=4, rounds=2, width=0.125, fleet=fleet, round_timeout=DEADLINE,
                      fedsga=FedSGAConfig(rho=1.0, deadline_aware=aware),
                      train=TrainConfig(local_epochs=1, batch_size=16, max_batches=2))
    sim = Simulation(cfg)
    return sim, list(sim.rounds())


def test_deadline_aware_never_trains_at_a_split_that_misses(tmp_path: Path) -> None:
    sim, records = _deadline_run(tmp_path / "aware", aware=True)
    slow = {cid for cid, cls in sim.fleet.assign(sim.client_ids).items() if cls.name == "slow_cpu"}
    moved = 0
    for rec in records:
        told = rec["deadline"]
        assert told["s"] == DEADLINE and set(told["split_s"]) == set(sim.client_ids)
        for cid, k in rec["splits"].items():
            assert told["split_s"][cid][k - 1] <= DEADLINE, (rec["round"], cid, k, told["split_s"][cid])
            moved += rec["clients"][cid]["k_policy"] != k
        assert not slow & set(rec["failures"]), rec["failures"]  # every slow device made the deadline
        for cid in slow:  # the prediction is the virtual clock's own model: it errs long, and not by much
            t = rec["timing"][cid]
            busy = t["compute_s"] + t["wire_s"]
            predicted = told["split_s"][cid][rec["splits"][cid] - 1]
            assert 0.9 * predicted <= busy <= predicted
    assert moved >= 2 * len(slow)  # the policy chose p_K; the deadline moved the slow devices every round

    # The same run without the option: the policy's p_K is predicted to miss on the slow CPUs, and it does.
    plain, plain_records = _deadline_run(tmp_path / "plain", aware=False)
    classes = plain.fleet.assign(plain.client_ids)
    for rec in plain_records:
        assert "deadline" not in rec
        calibrate = plain.strategy.calibrates(rec["round"])
        for cid in slow:
            predicted = plain.strategy.predict(classes[cid], cid, calibrate)
            assert predicted[2] > DEADLINE and cid in rec["failures"], (rec["round"], cid, predicted)


def test_a_devices_first_round_is_predicted_with_its_warm_up(tmp_path: Path) -> None:
    """A class's warmup_s (a fresh process's one-time work, paid on the virtual clock at the first step) is in the
    first round's prediction and only there, so the prediction still errs long by little in round 1."""
    from fedsga_edge.simulation import Simulation

    warm = 0.6
    fleet = write_fleet(tmp_path / "fleet.toml", {"fast": FAST, "slow_cpu": {**SLOW_CPU, "warmup_s": warm}})
    cfg = tiny_config("fedsga", clients=4, rounds=2, width=0.125, fleet=fleet, round_timeout=5.0,
                      fedsga=FedSGAConfig(rho=1.0, deadline_aware=True),
                      train=TrainConfig(local_epochs=1, batch_size=16, max_batches=2))
    sim = Simulation(cfg)
    classes = sim.fleet.assign(sim.client_ids)
    for rec in sim.rounds():
        calibrate = sim.strategy.calibrates(rec["round"])
        for cid, cls in classes.items():
            extra = cls.warmup_s if rec["round"] == 1 else 0.0
            # round 1 from the class; round 2 from what round 1 measured, its warm-up taken out (coordinator/planning.py)
            rate = cls if rec["round"] == 1 else sim.strategy.deadlines.rates.measured[cid]
            base = sim.strategy.predict(rate, cid, calibrate)
            assert rec["deadline"]["split_s"][cid] == pytest.approx([s + extra for s in base], rel=1e-9)
            if cls.name == "slow_cpu":
                t = rec["timing"][cid]
                predicted = rec["deadline"]["split_s"][cid][rec["splits"][cid] - 1]
                assert 0.9 * predicted <= t["compute_s"] + t["wire_s"] <= predicted, (rec["round"], t, predicted)


def test_deadline_aware_needs_a_fleet_and_a_deadline(tmp_path: Path) -> None:
    from fedsga_edge.simulation import Simulation

    fleet = write_fleet(tmp_path / "fleet.toml", {"fast": FAST, "slow_cpu": SLOW_CPU})
    for kw in ({"fleet": fleet}, {"round_timeout": 2.0}):
        with pytest.raises(ValueError, match="--deadline-aware needs --fleet"):
            Simulation(tiny_config("fedsga", clients=4, fedsga=FedSGAConfig(deadline_aware=True), **kw))


# -- the benchmark --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench():
    return load_bench("fleet")


def test_split_methods_are_the_prefix_trainers_and_fedavg(bench) -> None:
    methods = bench.split_methods()
    assert {"fedavg", "static", "static-p1", "static-pK", "random", "resource", "fedsga"} <= set(methods)
    assert not {"fedprox", "fedbabu", "fedgh", "fedas", "fedmut", "fedsga-no-adapt", "fedsga-deadline"} & set(methods)


def test_table_from_a_fast_and_a_slowwrite_fleet(bench, tmp_path: Path, digits) -> None:
    link = {"gflops": 20.0, "rtt_ms": 2.0}
    fast = write_fleet(tmp_path / "fast.toml", {"lan": {"count": 10, "uplink_mbps": 500.0, "downlink_mbps": 500.0, **link}})
    slow = write_fleet(tmp_path / "slow.toml", {"lan": {"count": 5, "uplink_mbps": 500.0, "downlink_mbps": 500.0, **link},
                                           "weak": {"count": 5, "uplink_mbps": 2.0, "downlink_mbps": 4.0, **link}})
    common = ["--methods", "static", "--rounds", "2", "--max-batches", "1", "--deadline", "0", "--no-progress"]
    rows = {}
    for name, fleet in (("fast", fast), ("slow", slow)):
        res = bench.main(common + ["--fleet", fleet, "--out", str(tmp_path / name), "--target", "0.05"])
        assert res["ran"] == 1 and [r["method"] for r in res["rows"]] == ["static"]
        rows[name] = res["rows"][0]
        assert f"| {rows[name]['label']} |" in res["table"]
    assert rows["slow"]["round_s_median"] > 2 * rows["fast"]["round_s_median"]
    assert rows["slow"]["slowest_class"] == "weak"
    assert rows["slow"]["slowest_s_median"] > rows["fast"]["slowest_s_median"]
    assert rows["slow"]["bytes_per_round"] == pytest.approx(rows["fast"]["bytes_per_round"], rel=0.01)

    # the target columns against metrics.jsonl: cumulative fleet_s until the first round at or above the target
    out = tmp_path / "slow"
    metrics = [json.loads(line) for line in (out / "static/iid/seed0/metrics.jsonl").read_text().splitlines()]
    accs = [m.get("test_acc", m.get("test_acc_subset")) for m in metrics]
    assert all(a is not None for a in accs)
    for target in sorted(set(accs)) + [1.0]:
        again = bench.main(common + ["--fleet", slow, "--out", str(out), "--target", str(target), "--tables-only"])
        assert again["ran"] == 0 and again["skipped"] == 1  # finished runs are reused, not run again
        row = again["rows"][0]
        first = next((i for i, a in enumerate(accs) if a >= target), None)
        if first is None:
            assert row["reached"] == 0 and row["seconds_to_target"] is None and "not reached" in again["table"]
        else:
            assert row["rounds_to_target"] == metrics[first]["round"]
            assert row["seconds_to_target"] == pytest.approx(sum(m["fleet_s"] for m in metrics[: first + 1]))

    # a finished run made with other settings is refused, not mixed in
    with pytest.raises(SystemExit, match="other settings"):
        bench.main(common + ["--fleet", fast, "--out", str(out), "--tables-only"])


def test_a_wire_format_sweep_gives_the_planner_the_best_split_and_format_pair(bench, tmp_path: Path, digits) -> None:
    """--wire-formats runs the fixed splits with the whole fleet at each format; planner-auto, which sets its own
    formats, runs once; its reference is the fastest (split, format) pair of the seed."""
    slow = write_fleet(tmp_path / "slow.toml", {"weak": {"count": 10, "gflops": 50.0, "uplink_mbps": 2.0,
                                                        "downlink_mbps": 4.0, "rtt_ms": 2.0}})
    res = bench.main(["--methods", "static,planner-auto", "--wire-formats", "fp32,int4", "--rounds", "1",
                      "--max-batches", "1", "--deadline", "0", "--server-copies", "per-client", "--no-progress",
                      "--fleet", slow, "--out", str(tmp_path / "out"), "--target", "0.01"])
    assert res["ran"] == 3
    out = tmp_path / "out"
    assert {p.parent.relative_to(out).as_posix() for p in out.rglob("summary.json")} == {
        "static/iid/seed0/fp32", "static/iid/seed0/int4", "planner-auto/iid/seed0"}
    secs = {(r["method"], r["wire_format"]): r["seconds_to_target"] for r in res["rows"]}
    assert secs[("static", "int4")] < secs[("static", "fp32")]  # a quarter of the bytes on a 2 Mbit/s link
    assert "| Static at p_ref (SplitFed), int4 (whole fleet) |" in res["table"]
    [paired] = res["paired"]
    assert paired["method"] == "planner-auto" and paired["best_fixed"] == "static int4"
    assert paired["best_fixed_s"] == pytest.approx(secs[("static", "int4")])
    assert paired["splitfed_final_acc"] is not None  # static at p_ref, fp32: SplitFed's accuracy beside it

    # records made in another checkout of the repository name its files by other absolute paths: still the same
    acc = bench.acc
    mine = str(acc.REPO / "fleets" / "mixed-bench.toml")
    assert acc._same_repo_file("/elsewhere/fedsga-edge/fleets/mixed-bench.toml", mine)
    assert not acc._same_repo_file("/elsewhere/fedsga-edge/fleets/mixed.toml", mine)
    assert not acc._same_repo_file("/elsewhere/x.toml", "/tmp/x.toml")  # outside the repository: exact paths only
