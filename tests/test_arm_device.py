"""benchmarks/arm_device.py's verdict: two devices' runs match to float tolerance, and a real difference fails.

The check itself (an emulated arm64 system, minutes) runs in .ci/run; here only its comparison, on run folders
written by hand, so that a device that computes something else cannot pass it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def arm():
    spec = importlib.util.spec_from_file_location("arm_device", ROOT / "benchmarks" / "arm_device.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(path: Path, name: str, losses: list[float], weights: dict[str, torch.Tensor], acc: float = 0.5) -> dict:
    """A run as run_pair returns it: metrics.jsonl's rounds and checkpoint.pt's weights."""
    path.mkdir(parents=True)
    records = [{"round": t, "splits": {"client-000": 1}, "bytes_up": 100, "bytes_down": 50, "failures": {},
                "fed_count": 32, "train_loss": loss, "test_loss": loss + 0.5, "fed_loss": loss + 0.25,
                "test_acc": acc, "fed_acc": acc} for t, loss in enumerate(losses, 1)]
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    torch.save({"model": weights}, path / "checkpoint.pt")
    return {"name": name, "dir": path, "records": records}


def _weights(shift: float = 0.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"conv.weight": torch.randn(8, 3, 3, 3, generator=g) + shift, "bn.running_var": torch.ones(8),
            "bn.num_batches_tracked": torch.tensor(4)}


def test_runs_equal_to_float_rounding_match(arm, tmp_path) -> None:
    a = _run(tmp_path / "a", "aarch64", [2.5, 2.4], _weights(1e-6))
    b = _run(tmp_path / "b", "x86_64", [2.5 * (1 + 3e-4), 2.4], _weights())
    assert arm.compare(a, b) == []


def test_a_loss_a_weight_or_a_count_that_differs_fails(arm, tmp_path) -> None:
    ref = _run(tmp_path / "ref", "x86_64", [2.5, 2.4], _weights())
    loss = _run(tmp_path / "loss", "aarch64", [2.5, 2.45], _weights())  # round 2's loss 2 % off
    assert [m for m in arm.compare(loss, ref) if "train_loss" in m] == [
        "round 2: train_loss 2.45 vs 2.4 (rel tol 0.002)"]
    weights = _run(tmp_path / "w", "aarch64", [2.5, 2.4], _weights(0.05))  # every weight moved by 0.05
    assert any("final weights differ" in m for m in arm.compare(weights, ref))
    acc = _run(tmp_path / "acc", "aarch64", [2.5, 2.4], _weights(), acc=0.6)
    assert any("test_acc" in m for m in arm.compare(acc, ref))
    short = _run(tmp_path / "short", "aarch64", [2.5], _weights())
    assert arm.compare(short, ref) == ["aarch64 has 1 rounds, x86_64 2"]
    other = _run(tmp_path / "bytes", "aarch64", [2.5, 2.4], _weights())
    other["records"][0]["bytes_up"] = 101
    assert arm.compare(other, ref) == ["round 1: bytes_up 101 != 100"]
