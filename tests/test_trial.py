"""`fedsga-edge trial`: a real Mosquitto, the coordinator and device agents as separate OS processes."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MOSQUITTO = shutil.which("mosquitto") or ("/usr/sbin/mosquitto" if os.path.exists("/usr/sbin/mosquitto") else None)
TINY = ["--dataset", "digits", "--model", "resnet18_cifar", "--width", "0.25", "--seed", "0", "--local-epochs", "1",
        "--max-batches", "2", "--batch-size", "32", "--round-timeout", "300"]


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedsga_edge.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ | {"COLUMNS": "200"})


@pytest.mark.skipif(MOSQUITTO is None, reason="no mosquitto binary (apt-get install mosquitto)")
def test_trial_runs_every_device_in_every_round(tmp_path) -> None:
    out = tmp_path / "run"
    res = _cli("trial", "--clients", "3", "--rounds", "2", "--strategy", "fedsga", "--out", str(out), "--quiet", *TINY)
    assert res.returncode == 0, res.stderr[-3000:] + (out / "logs" / "coordinator.out").read_text()[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r["splits"]) == {"client-000", "client-001", "client-002"} and r["failures"] == {}
    assert "L1" in rows[0]["clients"]["client-000"]  # round 1 calibrates over the wire too
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["failures"] == 0 and 0 <= summary["final_acc"] <= 1
    for name in ("broker.out", "coordinator.out", "device-000.out", "device-002.out"):
        assert (out / "logs" / name).is_file()
    assert (out / "devices" / "client-001").is_dir()  # each agent kept its private state
    log = [json.loads(line) for line in (out / "coordinator.log").read_text().splitlines()]
    assert any(e["event"] == "round_end" for e in log)  # machine-readable JSON lines


@pytest.mark.skipif(MOSQUITTO is None, reason="no mosquitto binary (apt-get install mosquitto)")
def test_one_device_trial_matches_simulate(tmp_path) -> None:
    """One device: the same computation in one process and over MQTT between three processes."""
    trial, sim = tmp_path / "trial", tmp_path / "sim"
    flags = ["--clients", "1", "--rounds", "1", "--strategy", "static", *TINY]
    res = _cli("trial", "--out", str(trial), "--quiet", *flags)
    assert res.returncode == 0, res.stderr[-3000:]
    res = _cli("simulate", "--out", str(sim), "--quiet", "--threads", "1", *flags)
    assert res.returncode == 0, res.stderr[-3000:]
    a = json.loads((trial / "metrics.jsonl").read_text().splitlines()[0])
    b = json.loads((sim / "metrics.jsonl").read_text().splitlines()[0])
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    assert a["test_acc"] == pytest.approx(b["test_acc"], abs=1e-9)
    assert a["splits"] == b["splits"]


def test_trial_without_a_broker_says_how_to_get_one(tmp_path) -> None:
    res = _cli("trial", "--clients", "1", "--rounds", "1", "--broker", "mqtt://127.0.0.1:1", "--out",
               str(tmp_path / "run"), "--quiet", *TINY, timeout=300)
    assert res.returncode == 1 and "coordinator exited" in res.stderr
    coordinator_log = (tmp_path / "run" / "logs" / "coordinator.out").read_text()
    assert "cannot use broker mqtt://127.0.0.1:1" in coordinator_log and "Traceback" not in coordinator_log
