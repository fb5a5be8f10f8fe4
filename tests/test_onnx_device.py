"""The torch-free device (ONNX backend): it trains like the torch device, and runs with torch unimportable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from _export_artifacts import device_artifacts
from _runs import tiny_config
from test_device_runtime import BLOCK_TORCH

from fedsga_edge.device.runtime import ArtifactError
from fedsga_edge.simulation import Simulation

ROOT = Path(__file__).resolve().parents[1]


def _rel_norm(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """||a - b|| / ||a|| over every floating tensor of two state dicts."""
    va = torch.cat([v.flatten().double() for v in a.values() if v.is_floating_point()])
    vb = torch.cat([b[k].flatten().double() for k, v in a.items() if v.is_floating_point()])
    return float((va - vb).norm() / va.norm())


def _same_prompts(sim: Simulation) -> None:
    """The backends draw fresh prompts from different generators (torch's, numpy's): give both the same."""
    for i, c in enumerate(sim.clients):
        c.state.prompts = np.random.default_rng(i).standard_normal((4, 16)).astype(np.float32)


def _pair(digits, strategy: str, rounds: int, **kw) -> tuple[Simulation, list, Simulation, list]:
    """The same run with torch devices and with ONNX devices. One local step per round: float32
    rounding differs between the two, and more steps let ReLU/BatchNorm amplify it (exactness is
    what is tested here; that the ONNX step is SGD is tests/test_device_runtime.py's)."""
    cfg = lambda: tiny_config(strategy, clients=2, rounds=rounds, max_batches=1, **kw)  # noqa: E731
    ref = Simulation(cfg(), digits)
    _same_prompts(ref)
    sim = Simulation(cfg(), digits, backend="onnx", artifacts=device_artifacts())
    assert all(c.backend.name == "onnx" for c in sim.clients)
    _same_prompts(sim)
    return ref, list(ref.rounds()), sim, list(sim.rounds())


def test_static_round_on_onnx_devices_matches_torch_devices(digits) -> None:
    ref, rec_t, sim, rec_o = _pair(digits, "static", 1, split=2)
    assert rec_o[0]["splits"] == rec_t[0]["splits"] and not rec_o[0].get("failures")
    assert rec_o[0]["train_loss"] == pytest.approx(rec_t[0]["train_loss"], rel=1e-4)
    # the aggregated global model: device blocks trained by onnxruntime + numpy SGD vs by autograd
    assert _rel_norm(ref.model.state_dict(), sim.model.state_dict()) < 1e-3


def test_fedsga_rounds_with_calibration_on_onnx_devices(digits) -> None:
    """FedSGA's device side (observation, Gamma, split, prompts, descriptor, probe) on the ONNX backend."""
    ref, rec_t, sim, rec_o = _pair(digits, "fedsga", 2)  # round 1 calibrates, round 2 observes
    for rt, ro in zip(rec_t, rec_o):
        assert ro["splits"] == rt["splits"] and not ro.get("failures")
        assert ro["train_loss"] == pytest.approx(rt["train_loss"], rel=1e-2)
        for cid, d in ro["clients"].items():
            keys = ("L1", "Lref") if "L1" in d else ("a", "delta", "r")
            for key in keys:
                assert d[key] == pytest.approx(rt["clients"][cid][key], rel=5e-2, abs=1e-3), (rt["round"], cid, key)
            assert 0 <= d["descriptor_entropy"] <= np.log(4) + 1e-9
    assert "L1" in rec_o[0]["clients"]["client-000"] and "a" in rec_o[1]["clients"]["client-000"]
    assert _rel_norm(ref.model.state_dict(), sim.model.state_dict()) < 1e-2
    for c in sim.clients:  # private state lives in numpy on the device
        assert c.state.prompts.shape == (4, 16) and c.state.m_last is not None and c.state.H_prev is not None


def test_full_model_rounds_are_refused_with_a_reason(digits) -> None:
    sim = Simulation(tiny_config("fedavg", clients=1, rounds=1, max_batches=1), digits, backend="onnx",
                     artifacts=device_artifacts())
    rec = next(sim.rounds())
    assert "client-000" in rec["failures"] and "--backend torch" in rec["failures"]["client-000"]


def test_an_export_of_some_splits_keeps_the_models_candidates(digits) -> None:
    """K is the model's candidate count (p_ref the middle one), however many splits were exported; a split
    asked for but not exported is refused by name."""
    from fedsga_edge.device.onnx_backend import BackendError

    art = device_artifacts()
    exported = sorted(p["split"] for p in json.loads((art / "manifest.json").read_text())["prefixes"])
    be = Simulation(tiny_config("fedsga", clients=1, max_batches=1), digits, backend="onnx",
                    artifacts=art).clients[0].backend
    assert be.splits == exported and be.num_splits == 3
    if 3 not in exported:
        with pytest.raises(BackendError, match="split 3 not in the artifacts"):
            be.depth_of(3)


def test_artifacts_of_another_model_are_refused_at_start(digits) -> None:
    with pytest.raises(ArtifactError, match="width 0.25 != 0.5"):
        Simulation(tiny_config("static", clients=1, width=0.5), digits, backend="onnx", artifacts=device_artifacts())


# A device with only the `device` extra: any torch import raises; the CLI's `device` command runs.
DEVICE_CLI = BLOCK_TORCH + textwrap.dedent(
    """
    from fedsga_edge.cli.main import app
    try:
        app(sys.argv[1:])
    finally:
        assert not any(m == "torch" or m.startswith("torch.") for m in sys.modules)
    """
)


RUN_FLAGS = ["--dataset", "digits", "--clients", "2", "--rounds", "2", "--model", "resnet18_cifar", "--width", "0.25",
             "--strategy", "fedsga", "--local-epochs", "1", "--batch-size", "32", "--max-batches", "2", "--seed", "0",
             "--round-timeout", "120"]


@pytest.mark.integration
def test_a_device_process_without_torch_takes_part_in_a_field_run(tmp_path) -> None:
    """Real processes over a real Mosquitto: a coordinator, one torch device, one device with torch unimportable."""
    from fedsga_edge.broker.launch import start_embedded

    art = device_artifacts()
    running = start_embedded(tmp_path)
    url = running.url
    script = tmp_path / "no_torch_device.py"
    script.write_text(DEVICE_CLI)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cli = [sys.executable, "-m", "fedsga_edge.cli.main"]
    procs = []
    try:
        run = tmp_path / "run"
        coord = subprocess.Popen([*cli, "coordinator", "--broker", url, "--run-dir", str(run), *RUN_FLAGS,
                                  "--threads", "1"], stdout=open(tmp_path / "coord.log", "w"), stderr=subprocess.STDOUT,
                                 env=env)
        procs.append(coord)
        procs.append(subprocess.Popen([*cli, "device", "--broker", url, "--index", "0", "--state-dir",
                                       str(tmp_path / "d0"), "--threads", "1", *RUN_FLAGS],
                                      stdout=open(tmp_path / "d0.log", "w"), stderr=subprocess.STDOUT, env=env))
        procs.append(subprocess.Popen([sys.executable, str(script), "device", "--broker", url, "--index", "1",
                                       "--state-dir", str(tmp_path / "d1"), "--backend", "onnx", "--artifacts", str(art),
                                       "--threads", "1", *RUN_FLAGS],
                                      stdout=open(tmp_path / "d1.log", "w"), stderr=subprocess.STDOUT, env=env))
        coord.wait(timeout=400)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        running.stop()
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("coord", "d0", "d1")}
    assert coord.returncode == 0, logs
    assert procs[2].returncode == 0, logs["d1"]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(recs) == 2 and all(set(r["splits"]) == {"client-000", "client-001"} for r in recs), recs
    assert not any(r.get("failures") for r in recs)
    assert (tmp_path / "d1" / "state.npz").exists()  # its private state persisted, without torch
