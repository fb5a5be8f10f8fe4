"""Faults in a field run with real processes: a device killed mid-round, then a broker restart.

One run (Mosquitto, coordinator and two device agents as OS processes, benchmarks/faults.py's
harness) takes both faults in turn, so the processes start once: device 1 is SIGKILLed in round 2
the moment the server answers one of its activations, and restarted on its state dir; after
round 3 Mosquitto stops and starts again on its port. What must hold is docs/protocol.md,
"Faults": round 2 closes at its deadline without the dead device and without its update, the
device rejoins from its saved state, everyone reconnects, and every round is recorded once.
"""

from __future__ import annotations

import json

import pytest
from _bench import load_bench

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def faults():
    return load_bench("faults", needs_mosquitto=True)


@pytest.mark.full("a device killed and a broker restarted mid-run over real Mosquitto: 61 s of the suite's busiest "
                  "worker; the recovery paths are also covered by tests/test_field.py's faster tests")
def test_a_device_killed_mid_round_rejoins_and_the_run_survives_a_broker_restart(faults, tmp_path) -> None:
    s = faults.Settings(clients=2, rounds=5, round_timeout=25.0, request_timeout=8.0)
    h = faults.Harness(tmp_path / "run", s)
    try:
        h.start_all()
        killed = faults.kill_device_mid_round(h, 1, 2)
        faults.restart_broker_after(h, 3)  # round 4 may lose requests in flight; round 5 must have everyone
        h.finish()
    except faults.ScenarioFailed as exc:
        h.check("scenario ran to the end", False, str(exc))
    finally:
        h.close()
    h.common_checks()
    faults.check_device_killed(h, 1, 2, later=[3, 5])
    faults.check_every_device_in(h, 5)
    failed = [c for c in h.checks if not c["ok"]]
    assert not failed, json.dumps(failed, indent=1, default=str) + f"\nlogs: {h.folder / 'logs'}"
    assert killed["victim_gradients_before_kill"] >= 1
    report = h.report()
    assert report["rounds"] == 5 and report["peak_rss_mb"]["device"] > 0
