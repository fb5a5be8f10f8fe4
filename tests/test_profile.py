"""Profiling: statistics, timing loop, and both runtimes on a real export."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _export_artifacts import cli_app, must_show_artifacts, train_artifacts
from fedsga_edge.device.profile import latency_stats, profile_artifacts, time_calls
from typer.testing import CliRunner

FIELDS = {
    "session_create_s",
    "latency_ms",
    "rss_peak_mb",
    "rss_delta_mb",
    "flops_per_sample",
    "macs_onnx",
    "activation_bytes_per_sample",
    "params",
    "batch",
    "split",
    "depth",
    "variant",
}


def test_latency_stats() -> None:
    s = latency_stats([0.001, 0.002, 0.003, 0.004], batch=8)
    assert s["min"] == pytest.approx(1.0) and s["max"] == pytest.approx(4.0)
    assert s["mean"] == pytest.approx(2.5) and s["p50"] == pytest.approx(2.5)
    assert s["cv"] == pytest.approx(np.std([1, 2, 3, 4]) / 2.5)
    assert s["throughput_sps"] == pytest.approx(8 / 0.0025)


def test_time_calls_counts_and_duration() -> None:
    calls = []
    assert len(time_calls(lambda: calls.append(1), warmup=2, iters=5, duration=None)) == 5
    assert len(calls) == 7
    assert len(time_calls(lambda: None, warmup=0, iters=None, duration=0.01)) >= 3


def test_onnxruntime_profile_every_variant_and_the_train_step() -> None:
    rep = profile_artifacts(
        must_show_artifacts(), batches=(1, 2), threads=1, warmup=1, iters=3, variants=("fp32", "int8")
    )
    assert {(r["split"], r["variant"], r["batch"]) for r in rep["results"]} == {
        (k, v, b) for k in (1, 2, 3) for v in ("fp32", "int8") for b in (1, 2)
    }
    for r in rep["results"]:
        assert FIELDS <= set(r)
        assert r["latency_ms"]["n"] == 3 and r["latency_ms"]["min"] > 0 and r["rss_peak_mb"] > 0
        assert "train_step_ms" not in r  # exported without --train
    assert rep["device"]["threads"] == 1 and rep["device"]["cores_logical"] >= 1
    train = profile_artifacts(train_artifacts(), batches=(2,), warmup=1, iters=3)
    assert train["results"][0]["train_step_ms"]["n"] == 3


def test_torch_profile_and_cli_json(tmp_path) -> None:
    out = tmp_path / "torch.json"
    args = [
        "profile",
        "--artifacts",
        str(must_show_artifacts()),
        "--runtime",
        "torch",
        "--batch",
        "2",
        "--threads",
        "1",
        "--warmup",
        "1",
        "--iters",
        "3",
        "--splits",
        "1,3",
        "--json",
        str(out),
    ]
    result = CliRunner().invoke(cli_app(), args)
    assert result.exit_code == 0, result.output
    rep = json.loads(out.read_text())
    assert rep["device"]["runtime"] == "torch" and [r["split"] for r in rep["results"]] == [1, 3]
    assert all(r["train_step_ms"]["n"] == 3 for r in rep["results"])  # torch always has a backward
    assert "samples/s" in result.output


def test_profile_cli_refuses_a_folder_without_manifest(tmp_path) -> None:
    result = CliRunner().invoke(cli_app(), ["profile", "--artifacts", str(tmp_path)])
    assert result.exit_code == 2 and "no manifest.json" in result.output
