"""Calibrating a fleet file's host figures from a trial (fedsga_edge/fleetcalib.py; docs/fleet.md)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from fedsga_edge.fleet import FleetError, load_fleet, parse_fleet
from fedsga_edge.fleetcalib import calibrate, calibrated_toml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

RAW = {"host": {"gflops": 10.0},
       "classes": {"fast": {"count": 2, "speed_factor": 1.0, "uplink_mbps": 100.0, "downlink_mbps": 100.0,
                            "rtt_ms": 2.0, "warmup_s": 1.0},
                   "board": {"count": 1, "gflops": 2.0, "uplink_mbps": 2.0, "downlink_mbps": 2.0, "rtt_ms": 20.0}}}
FLOPS = 5e9  # every device-round's FLOPs
DEVICES = {"client-000": "fast", "client-001": "fast", "client-002": "board"}


def _tm(cls: str, compute: float, cpu: float | None = None) -> dict:
    tm = {"class": cls, "split": 2, "compute_s": compute, "wire_s": 0.1, "wait_s": 0.0, "bytes_up": 1,
          "bytes_down": 1, "done_s": compute + 0.1}
    if cpu is not None:
        tm["cpu_s"] = cpu
    return tm


def _sim() -> list[dict]:
    """What simulate charges at the file's figures: FLOPs over the class's speed, plus warmup_s in round 1."""
    fleet = parse_fleet(RAW)
    speed = {c.name: c for c in fleet.classes}
    return [{"round": r, "timing": {d: _tm(c, FLOPS / (speed[c].gflops * 1e9) + (speed[c].warmup_s if r == 1 else 0))
                                    for d, c in DEVICES.items()}} for r in (1, 2, 3)]


def _trial(host: float, warm: dict[str, float], quota: dict[str, float]) -> list[dict]:
    """A host at ``host`` GFLOP/s per CPU second; each class computes at its quota of a core; round 1 adds warm-up."""
    recs = []
    for r in (1, 2, 3):
        timing = {}
        for d, c in DEVICES.items():
            cpu = FLOPS / (host * 1e9)
            timing[d] = _tm(c, cpu / quota[c] + (warm[c] if r == 1 else 0.0), cpu)
        recs.append({"round": r, "timing": timing})
    return recs


def test_the_host_rate_comes_from_flops_over_cpu_seconds_and_warmups_from_first_rounds() -> None:
    fleet = parse_fleet(RAW)
    # The real host is twice the file's; the board class (absolute 2 GFLOP/s) ran under a 2/20 quota.
    cal = calibrate(fleet, _trial(20.0, {"fast": 3.0, "board": 7.0}, {"fast": 1.0, "board": 0.1}), _sim())
    assert cal.host_gflops == pytest.approx(20.0)
    assert cal.device_rounds == 6  # rounds 2 and 3 of three devices; first rounds carry the warm-up
    assert cal.warmup_s["fast"] == pytest.approx(3.0)
    assert cal.warmup_s["board"] == pytest.approx(7.0)  # at the board's own (absolute) speed, not the host's
    assert cal.first_rounds == {"fast": 2, "board": 1}


def test_the_calibrated_file_loads_back_with_the_measured_figures(tmp_path: Path) -> None:
    (tmp_path / "p.json").write_text("{}")
    raw = {**RAW, "classes": {**RAW["classes"], "pi": {"count": 1, "profile": "p.json", "uplink_mbps": 1.0,
                                                        "downlink_mbps": 1.0, "rtt_ms": 0.0}}}
    cal = calibrate(parse_fleet(RAW), _trial(20.0, {"fast": 3.0, "board": 7.0}, {"fast": 1.0, "board": 0.1}), _sim())
    text = calibrated_toml(raw, cal, "calibrated\nby a test", tmp_path)
    assert text.startswith("# calibrated\n# by a test\n")
    data = tomllib.loads(text)
    assert data["host"] == {"gflops": 20.0}
    assert data["classes"]["fast"]["warmup_s"] == 3.0 and data["classes"]["board"]["warmup_s"] == 7.0
    assert data["classes"]["pi"]["profile"] == str((tmp_path / "p.json").resolve())  # found from anywhere
    assert data["classes"]["fast"]["speed_factor"] == 1.0 and data["classes"]["board"]["gflops"] == 2.0
    # Without the profile class, the written file is a fleet file load_fleet takes, with the new figures.
    out = tmp_path / "elsewhere" / "f.toml"
    out.parent.mkdir()
    out.write_text(calibrated_toml(RAW, cal, "calibrated", tmp_path), encoding="utf-8")
    fleet = load_fleet(out)
    assert fleet.host_gflops == 20.0 and [c.gflops for c in fleet.classes] == [20.0, 2.0]
    assert [c.warmup_s for c in fleet.classes] == [3.0, 7.0]


def test_records_without_cpu_seconds_cannot_calibrate() -> None:
    trial = _trial(20.0, {"fast": 0.0, "board": 0.0}, {"fast": 1.0, "board": 0.1})
    for rec in trial:
        for tm in rec["timing"].values():
            del tm["cpu_s"]  # an emulated trial or a simulation: nothing measured the host
    with pytest.raises(FleetError, match="cpu_s"):
        calibrate(parse_fleet(RAW), trial, _sim())
