"""trial's live table of devices: built from coordinator.log's events and metrics.jsonl's
records as the coordinator writes them, printed by ``fedsga_edge.trial.follow`` while the coordinator runs."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from fedsga_edge.trial import follow
from fedsga_edge.devicetable import DeviceTable, JsonTail

EVENTS = [
    {"event": "hello_ack", "device": "client-000"},
    {"event": "hello_ack", "device": "client-001"},
    {"event": "registration_complete", "devices": 2},
    {"event": "round_begin", "round": 1, "devices": ["client-000", "client-001"]},
    {"event": "update", "round": 1, "device": "client-000", "split": 2},
]
RECORD = {"round": 1, "splits": {"client-000": 2}, "failures": {"client-001": "missed the round deadline"},
          "timing": {"client-000": {"class": "fast", "split": 2, "compute_s": 0.6, "wire_s": 0.5, "wait_s": 0.1,
                                    "bytes_up": 250_000, "bytes_down": 375_000, "done_s": 1.1, "steps": 3},
                     "client-001": {"class": "slow", "split": 1, "compute_s": 2.0, "wire_s": 4.0, "wait_s": 0.0,
                                    "bytes_up": 100_000, "bytes_down": 0, "done_s": None, "steps": 4}}}


def test_table_follows_events_and_records() -> None:
    t = DeviceTable({"client-001": "slow"})
    assert [t.event(e) for e in EVENTS] == [True, True, False, True, True]
    rows = {r[0]: r for r in t.rows()}
    assert (rows["client-000"][1], rows["client-001"][1]) == ("—", "slow")  # the fleet's, before any timing
    assert rows["client-000"][2:6] == ["yes", "1", "done", "2"]
    assert rows["client-001"][2:6] == ["yes", "1", "training", "—"]
    t.event({"event": "round_end", "round": 1, "failures": RECORD["failures"]})
    assert t.record(RECORD)
    rows = {r[0]: r for r in t.rows()}
    # last step: compute seconds over steps; link: bytes both ways over wire seconds
    assert rows["client-000"] == ["client-000", "fast", "yes", "1", "done", "2", "0.200", "10.00"]
    assert rows["client-001"][1] == "slow" and rows["client-001"][4].startswith("failed: missed")
    assert rows["client-001"][6:] == ["0.500", "0.20"]
    t.event({"event": "bye", "device": "client-001"})
    assert {r[0]: r for r in t.rows()}["client-001"][2:5] == ["no", "1", "left"]
    text = t.format()
    assert text.splitlines()[0].split() [:3] == ["device", "class", "online"] and len(text.splitlines()) == 3


def test_json_tail_waits_for_a_whole_line(tmp_path: Path) -> None:
    p = tmp_path / "x.jsonl"
    tail = JsonTail(p)
    assert tail.read() == []
    p.write_text('{"a": 1}\n{"b"')
    assert tail.read() == [{"a": 1}]
    with p.open("a") as f:
        f.write(': 2}\n')
    assert tail.read() == [{"b": 2}] and tail.read() == []


class _Coordinator:
    """Stands for the coordinator's process: running until ``stop`` is set."""

    def __init__(self) -> None:
        self.stop = threading.Event()

    def poll(self) -> int | None:
        return 0 if self.stop.is_set() else None


def test_follow_prints_the_table_while_the_coordinator_runs(tmp_path: Path, capsys) -> None:
    log, metrics = tmp_path / "coordinator.log", tmp_path / "metrics.jsonl"
    co = _Coordinator()
    seen: list[str] = []

    def coordinator() -> None:
        with log.open("a") as f:
            for e in EVENTS:
                f.write(json.dumps(e) + "\n")
        time.sleep(0.3)
        seen.append(capsys.readouterr().out)  # registered and training: printed before any round ends
        metrics.write_text(json.dumps(RECORD) + "\n")
        time.sleep(0.2)
        co.stop.set()

    th = threading.Thread(target=coordinator)
    th.start()
    follow(metrics, co, rounds=1, quiet=False, every=0.0, poll=0.05)
    th.join()
    during, after = seen[0], capsys.readouterr().out
    assert "client-001" in during and "training" in during
    assert "fast" in after and "0.200" in after and "failed: missed" in after
    co2 = _Coordinator()
    co2.stop.set()
    follow(metrics, co2, rounds=1, quiet=True)
    assert "client-000" not in capsys.readouterr().out  # --quiet: no table
