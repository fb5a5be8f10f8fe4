"""The report on fleet runs: the per-device round timeline and time to accuracy, from real
``simulate --fleet`` runs on fleets/trial-4.toml (2 fast, 2 slow devices) and from hand-made timing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _runs import tiny_config

from fedsga_edge.report import build_report, discover
from fedsga_edge.report import data as D
from fedsga_edge.simulation import run_simulation

ROOT = Path(__file__).resolve().parents[1]
FLEET = str(ROOT / "fleets" / "trial-4.toml")


@pytest.fixture(scope="module")
def fleet_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two methods on the 4-device fleet, 2 rounds of one batch each: seconds of host time."""
    root = tmp_path_factory.mktemp("fleet_runs")
    for strategy in ("static", "fedavg"):
        cfg = tiny_config(strategy, clients=4, rounds=2, max_batches=1, batch_size=16, fleet=FLEET)
        run_simulation(cfg, root / strategy)
    return root


def _rows(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def test_report_on_fleet_runs_has_a_timeline_and_time_to_accuracy(fleet_runs: Path, tmp_path: Path) -> None:
    rep = build_report([fleet_runs], [], tmp_path / "out")
    assert rep.errors == []
    assert {"accuracy", "time_to_accuracy", "timeline"} <= {p.stem for p in rep.pngs}
    rows = {name: _rows(fleet_runs / name) for name in ("static", "fedavg")}
    # time to accuracy: x = the cumulative fleet_s of metrics.jsonl at each round, per run
    curves = {c["method"]: c for c in rep.section("time_to_accuracy").data}
    assert set(curves) == {"static", "fedavg"}
    for method, c in curves.items():
        cum = [sum(r["fleet_s"] for r in rows[method][:t]) for t in (1, 2)]
        assert cum[0] > 0 and cum[1] > cum[0]
        assert c["rounds"] == [1, 2] and c["seconds"] == pytest.approx(cum, rel=1e-9)
        (seed,) = c["seeds"]
        assert seed["seconds"] == pytest.approx(cum, rel=1e-9)
        assert c["mean"] == pytest.approx([r["test_acc"] for r in rows[method]])
    # the table: seconds to the lowest final accuracy, for each method
    target, table = D.seconds_to_target(list(curves.values()))
    assert target == pytest.approx(min(r[-1]["test_acc"] for r in rows.values()))
    for t in table:
        run = rows[t["method"]]
        first = next(i for i, r in enumerate(run) if r["test_acc"] >= target - 1e-12)
        assert t["reached"] == 1 and t["rounds"] == first + 1
        assert t["seconds"] == pytest.approx(sum(r["fleet_s"] for r in run[:first + 1]))
    page = rep.html.read_text()
    assert f"seconds to {100 * target:.2f} %" in page
    # the timeline: first and last round of each run, a bar per device, the parts summing to the round
    tls = rep.section("timeline").data
    assert sorted((t["method"], t["round"]) for t in tls) == sorted((m, r) for m in ("static", "fedavg") for r in (1, 2))
    for t in tls:
        row = rows[t["method"]][t["round"] - 1]
        assert t["fleet_s"] == row["fleet_s"]
        assert [d["device"] for d in t["devices"]] == list(row["timing"]) and len(t["devices"]) == 4
        for d in t["devices"]:
            tm = row["timing"][d["device"]]
            assert d["class"] == tm["class"] and d["split"] == tm["split"]
            assert d["compute"] == tm["compute_s"] and d["wire"] == tm["wire_s"]
            assert d["wait_before"] + d["wait_after"] == pytest.approx(tm["wait_s"], abs=1e-9)
            # done_s may pass the round's end by the update's ack crossing back: then nothing is waited after it
            assert d["wait_after"] == pytest.approx(max(0.0, row["fleet_s"] - tm["done_s"]), abs=1e-5)
            assert d["compute"] + d["wire"] + d["wait_before"] + d["wait_after"] == pytest.approx(row["fleet_s"],
                                                                                                abs=1e-4)
        # the last device done is a slow one, and nobody waits after it
        last = max(t["devices"], key=lambda d: d["done"])
        assert t["last"] == last["device"] and last["class"] == "slow" and last["wait_after"] == pytest.approx(0, abs=1e-5)
        assert all(d["wait_after"] > 0 for d in t["devices"] if d["class"] == "fast")


def test_timeline_cuts_waiting_at_done_and_marks_the_missed(tmp_path: Path) -> None:
    row = {"round": 3, "fleet_s": 10.0, "timing": {
        "a": {"class": "fast", "split": 2, "compute_s": 1.0, "wire_s": 0.5, "wait_s": 8.5, "done_s": 4.0},
        "b": {"class": "slow", "split": 1, "compute_s": 6.0, "wire_s": 3.0, "wait_s": 1.0, "done_s": 10.0},
        "c": {"class": "slow", "split": None, "compute_s": 0.0, "wire_s": 0.0, "wait_s": 10.0, "done_s": None,
              "missed": True}}}
    a, b, c = D.round_timeline(row)
    assert (a["wait_before"], a["wait_after"]) == pytest.approx((2.5, 6.0))
    assert (b["wait_before"], b["wait_after"]) == pytest.approx((1.0, 0.0))
    assert c["missed"] and c["done"] is None and c["wait_after"] == 0.0 and c["wait_before"] == 10.0
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({**row, "round": 1, "test_acc": 0.5}) + "\n"
                                       + json.dumps({**row, "round": 2, "test_acc": 0.6}) + "\n")
    (t1, t2) = D.fleet_timelines(discover([run])[0])
    assert (t1["round"], t2["round"], t1["last"]) == (1, 2, "b")
    rep = build_report([run], [], tmp_path / "out", target_acc=0.55)
    assert rep.errors == [] and rep.section("timeline").png is not None
    target, (row,) = D.seconds_to_target(rep.section("time_to_accuracy").data, 0.55)
    assert target == 0.55 and (row["seconds"], row["rounds"], row["reached"]) == (20.0, 2, 1)  # round 2, 2 x 10 s
    assert "seconds to 55.00 %" in rep.html.read_text()
    from typer.testing import CliRunner

    from fedsga_edge.cli.main import app

    res = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "cli"), "--target-acc", "0.55"])
    assert res.exit_code == 0 and "timeline.png" in res.output, res.output
    assert "seconds to 55.00 %" in (tmp_path / "cli" / "report.html").read_text()
    res = CliRunner().invoke(app, ["report", str(run), "--out", str(tmp_path / "cli"), "--target-acc", "55"])
    assert res.exit_code == 2


def test_runs_without_timing_show_no_timeline(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"round": 1, "test_acc": 0.3, "round_s": 2.0}\n')
    rep = build_report([run], [], tmp_path / "out")
    assert rep.errors == []
    for key in ("timeline", "time_to_accuracy"):
        sec = rep.section(key)
        assert sec.png is None and sec.data == [] and "--fleet" in sec.note and sec.extra_html == ""


def test_a_plain_field_runs_timing_shows_in_the_timeline_from_its_round_s(tmp_path: Path) -> None:
    """A trial without --fleet records ``timing`` and its ``round_s`` (no ``fleet_s``): the timeline shows it."""
    row = {"round_s": 6.0, "timing": {
        "client-000": {"class": None, "split": 2, "compute_s": 2.0, "wire_s": 1.0, "wait_s": 3.0, "done_s": 3.0,
                       "bytes_up": 1000, "bytes_down": 500, "link_mbps": 0.012},
        "client-001": {"class": None, "split": 1, "compute_s": 4.0, "wire_s": 2.0, "wait_s": 0.0, "done_s": 6.0,
                       "bytes_up": 2000, "bytes_down": 500, "link_mbps": 0.01}}}
    run = tmp_path / "plain"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({**row, "round": 1, "test_acc": 0.5}) + "\n")
    (t1,) = D.fleet_timelines(discover([run])[0])
    assert (t1["round"], t1["fleet_s"], t1["last"]) == (1, 6.0, "client-001")
    assert t1["devices"][0]["wait_after"] == pytest.approx(3.0)
    rep = build_report([run], [], tmp_path / "out")
    assert rep.section("timeline").png is not None
