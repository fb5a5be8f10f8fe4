"""benchmarks/capacity.py: its table and saturation lines, and the server side's memory it reports."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent.parent / "benchmarks" / "capacity.py"


def _capacity():
    spec = importlib.util.spec_from_file_location("capacity_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_tensor_bytes_counts_each_storage_once() -> None:
    cap = _capacity()
    lin = torch.nn.Linear(4, 2)
    lin(torch.ones(1, 4)).sum().backward()
    params = 4 * 2 * 4 + 2 * 4
    assert cap.tensor_bytes(lin, set()) == 2 * params  # weights and their gradients
    assert cap.tensor_bytes({"a": lin, "b": [lin.weight]}, set()) == 2 * params


def test_per_client_copies_hold_a_copy_per_device(capsys, digits, monkeypatch) -> None:
    cap = _capacity()
    rows = []
    real = cap.measure
    monkeypatch.setattr(cap, "measure", lambda *a: rows.append(real(*a)) or rows[-1])
    monkeypatch.setattr("fedsga_edge.data.load_dataset", lambda *_a, **_k: digits)
    assert cap.main(["--devices", "2,4", "--transports", "loopback", "--rounds", "1", "--max-batches", "1"]) == 0
    out = capsys.readouterr().out
    assert "| loopback | per-client | 4 |" in out and "requests/s on one core" in out
    by = {(r["copies"], r["devices"]): r for r in rows}
    assert all(r["failures"] == 0 and r["requests"] == 2 * r["devices"] for r in rows)  # an activation and an update
    assert by["shared", 2]["server_mb"] == by["shared", 4]["server_mb"]  # one copy, whatever the fleet
    assert by["per-client", 4]["server_mb"] > by["per-client", 2]["server_mb"] > by["shared", 2]["server_mb"]
