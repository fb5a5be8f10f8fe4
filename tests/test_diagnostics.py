"""The diagnostics behind RESULTS.md re-run a finished run exactly (same seed, same model)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from _runs import tiny_config

from fedsga_edge.simulation import run_simulation

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "diagnostics" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prefix_mismatch_reproduces_the_run_and_swaps_in_each_devices_prefix(tmp_path, digits) -> None:
    cfg = tiny_config("static", rounds=2, partition="dirichlet", alpha=0.3)
    summary = run_simulation(cfg, tmp_path / "run", bundle=digits)
    rows = _load("prefix_mismatch").main([str(tmp_path / "run"), "--every", "1", "--test-subset", "100000"])
    assert [r["round"] for r in rows] == [1, 2]
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    # the whole test set: the re-run's global model is the run's, and swapping prefixes in restored it
    assert rows[-1]["global_acc"] == last["test_acc"] == summary["final_acc"]
    assert len(rows[-1]["own_prefix_acc"]) == cfg.clients
    assert any(a != round(rows[-1]["global_acc"], 4) for a in rows[-1]["own_prefix_acc"].values())
