"""The coordinator on a GPU: its server side and the estimator's calibration with ``--device cuda``.

Skipped where torch sees no CUDA device; benchmarks/gpu_check.sh runs it first on a GPU machine, then the
``--preset gpu`` benchmark."""

from __future__ import annotations

import math

import pytest
import torch
from _runs import tiny_config

from fedsga_edge.config import FedSGAConfig
from fedsga_edge.simulation import Simulation

NO_GPU = "no CUDA device (torch.cuda.is_available() is False)"


def _rounds(device: str, digits) -> tuple[Simulation, list[dict]]:
    """Three FedSGA rounds, each one calibrating: round 1's pairs say nothing (every device starts at the same
    point), round 2 stores pairs and refits Gamma, round 3's splits come from the refit Gamma."""
    cfg = tiny_config("fedsga", device=device, max_batches=2, rounds=3, fedsga=FedSGAConfig(cal_every=1))
    sim = Simulation(cfg, digits)
    return sim, list(sim.rounds())


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_fedsga_server_side_and_estimator_on_cuda_match_the_cpu_run(digits, monkeypatch) -> None:
    """FedSGA with the coordinator on cuda: the server's blocks, its head, phi_s and the prototypes live on the GPU,
    the probes run there and Gamma is refit on their pairs (Gamma itself, 8 hidden units, stays on the CPU, where
    the devices' copies run too), and the figures agree with the same run on the CPU to float tolerance (cuDNN's
    kernels differ from the CPU's, so not bit for bit; TF32 off)."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # float32 convolutions, as on the CPU
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    gpu, on_gpu = _rounds("cuda", digits)
    co = gpu.coordinator
    assert co.device.type == "cuda"
    assert all(p.is_cuda for p in co.model.parameters())
    strategy = co.strategy
    for name in ("head", "phi_s", "prototypes"):
        assert all(t.is_cuda for t in getattr(strategy, name).state_dict().values()), name
    assert [r["round"] for r in on_gpu] == [1, 2, 3]
    cal = on_gpu[1]["calibration"]
    assert cal["new_pairs"] > 0 and math.isfinite(cal["brier"]) and math.isfinite(cal["bce"]), cal
    r = [c["r"] for c in on_gpu[2]["clients"].values()]
    assert len(r) == 3 and all(0.0 <= x <= 1.0 for x in r)  # round 3's splits came from the refit estimator
    assert all(math.isfinite(x["train_loss"]) and 0.0 <= x["test_acc"] <= 1.0 for x in on_gpu)
    # Round 1 against the CPU (later rounds' calibration labels compare two losses and may flip on rounding)
    _, on_cpu = _rounds("cpu", digits)
    g, c = on_gpu[0], on_cpu[0]
    assert g["splits"] == c["splits"]
    assert g["train_loss"] == pytest.approx(c["train_loss"], rel=1e-3)
    assert g["test_loss"] == pytest.approx(c["test_loss"], rel=1e-3)


def test_device_cuda_is_refused_with_a_reason_where_there_is_none(monkeypatch) -> None:
    """The other side of the same flag: asked for cuda without one, the run stops with a sentence, not a trace."""
    from fedsga_edge.runbuild import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda")
