"""Calibration supervision (docs/method.md, "Calibration"):

(a) pairs that say nothing about a device (its first observation) do not decide Gamma;
(b) the fit cannot saturate on a handful of pairs, and its Brier score on pairs it was not fitted on is
    recorded (``heldout_brier``);
(c) the probe batch comes from a slice of the device's data it never trains on.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from _runs import tiny_config

from fedsga_edge.config import FedSGAConfig, TrainConfig
from fedsga_edge.device.role import ClientData
from fedsga_edge.method import CalibrationBuffer, MonotoneEstimator, fit, informative
from fedsga_edge.simulation import Simulation


# -- (a) ----------------------------------------------------------------------------------------------
def test_a_first_observation_is_not_informative() -> None:
    assert not informative([0.0, 0.0, 0.0], 0.0)  # round 1: every device reports this point
    assert not informative([0.4, 0.0, 0.0], 0.0)  # a device joining later: a, but no previous state
    assert informative([0.0, 0.3, 0.0], 0.0) and informative([0.2, 0.0, 0.0], 0.5)


def test_round_one_pairs_are_not_stored_and_gamma_keeps_its_prior(digits) -> None:
    sim = Simulation(tiny_config("fedsga", clients=2, rounds=2, fedsga=FedSGAConfig(cal_every=1)), digits)
    strategy = sim.coordinator.strategy
    prior = {k: v.clone() for k, v in strategy.estimator.state_dict().items()}
    rounds = sim.rounds()
    r1 = next(rounds)
    assert all("s" in c for c in r1["clients"].values())  # the devices probed and got labels ...
    assert len(strategy.cal_buffer) == 0 and r1["calibration"]["pairs"] == 0  # ... that were not stored
    for k, v in strategy.estimator.state_dict().items():  # so Gamma is not fitted on them
        assert torch.equal(v, prior[k]), k
    r2 = next(rounds)  # the second observation has a previous state: its pairs are stored and fitted
    assert len(strategy.cal_buffer) == 2 and r2["calibration"]["pairs"] == 2
    assert any(not torch.equal(v, prior[k]) for k, v in strategy.estimator.state_dict().items())


# -- (b) ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("label", [0, 1])
def test_four_pairs_of_one_label_do_not_saturate_r(label: int) -> None:
    torch.manual_seed(0)
    est, buf = MonotoneEstimator(), CalibrationBuffer()
    for a, delta, q, r_prev in [(0.1, 0.5, 0.01, 0.5), (0.3, 0.2, 0.02, 0.4), (0.2, 0.9, 0.0, 0.6), (0.5, 0.1, 0.03, 0.5)]:
        buf.append([a, delta, q], r_prev, label)
    fit(est, buf)
    obs, r_prev, _ = buf.tensors()
    with torch.no_grad():
        r = est(obs, r_prev)
    # unregularised, 200 Adam steps gave r = 0.9996 (0.0003) for every device
    assert bool(((r > 0.1) & (r < 0.9)).all()), r
    assert bool((r > 0.5).all()) if label else bool((r < 0.5).all())  # it still learns the direction


def test_heldout_brier_scores_the_gamma_that_chose_the_splits_on_pairs_it_had_not_seen(digits) -> None:
    cfg = tiny_config("fedsga", clients=2, rounds=3, fedsga=FedSGAConfig(cal_every=1))
    r1, r2, r3 = list(Simulation(cfg, digits).rounds())
    assert r1["calibration"]["heldout_brier"] is None  # nothing stored yet
    assert r2["calibration"]["heldout_brier"] is None  # Gamma had never been fitted: no held-out score
    cal = r3["calibration"]
    assert cal["new_pairs"] == 2 and cal["pairs"] == 4
    # the devices' r at round 3's start came from round 2's Gamma, which had not seen round 3's labels
    expect = np.mean([(c["r"] - c["s"]) ** 2 for c in r3["clients"].values()])
    assert cal["heldout_brier"] == pytest.approx(expect, abs=1e-5)


# -- (c) ----------------------------------------------------------------------------------------------
def test_probe_slice_is_fixed_deterministic_and_apart_from_training() -> None:
    def held(seed: int) -> ClientData:
        d = ClientData(None, np.arange(100, 200), (0.0,) * 3, (1.0,) * 3)
        d.hold_out_probe(0.1, np.random.SeedSequence(seed))
        return d

    a, b, c = held(0), held(0), held(1)
    assert a.probe_indices is not None and len(a.probe_indices) == 10 and len(a.indices) == 90
    assert np.array_equal(a.probe_indices, b.probe_indices) and not np.array_equal(a.probe_indices, c.probe_indices)
    assert not set(a.probe_indices) & set(a.indices) and set(a.probe_indices) | set(a.indices) == set(range(100, 200))
    assert len(a) == 100  # the device still declares its whole partition
    a.hold_out_probe(0.1, np.random.SeedSequence(5))  # once: a second call moves nothing
    assert np.array_equal(a.probe_indices, b.probe_indices)


def _spy(client: Any) -> list[tuple[str, Any]]:
    """The device's input batches, each followed by what used it (a training forward or the probe)."""
    events: list[tuple[str, Any]] = []
    inputs, forward, probe = client._inputs, client.backend.forward, client.backend.probe

    def spy_inputs(idx: np.ndarray, augment: bool) -> Any:
        events.append(("batch", np.array(idx)))
        return inputs(idx, augment)

    def spy_forward(*a: Any, **k: Any) -> Any:
        events.append(("train", None))
        return forward(*a, **k)

    def spy_probe(*a: Any, **k: Any) -> Any:
        events.append(("probe", None))
        return probe(*a, **k)

    client._inputs, client.backend.forward, client.backend.probe = spy_inputs, spy_forward, spy_probe
    return events


def test_the_probe_batch_is_disjoint_from_every_training_batch(digits) -> None:
    """A calibration round's probe batch comes from a slice that round never trains on."""
    # every batch of every epoch (no cap), two epochs, two calibration rounds; 480 of digits' images (~4
    # batches a device an epoch) keep it seconds: the full set took 84 s in the suite and proves no more
    cfg = tiny_config("fedsga", clients=4, rounds=2, fedsga=FedSGAConfig(cal_every=1), train_subset=480,
                      train=TrainConfig(local_epochs=2, batch_size=32, max_batches=0))
    sim = Simulation(cfg, digits)
    logs = [_spy(c) for c in sim.clients]
    for _ in sim.rounds():
        pass
    for client, events in zip(sim.clients, logs):
        ends = [i for i, (kind, _) in enumerate(events) if kind == "probe"]
        assert len(ends) == 2, client.cid  # one probe per calibration round
        for start, end in zip([0, *ends], ends):  # one round's events, up to its probe
            round_events = events[start:end + 1]
            trained = {int(i) for (kind, idx), (nxt, _) in zip(round_events, round_events[1:])
                       if kind == "batch" and nxt == "train" for i in idx}
            (probed,) = [idx for (kind, idx), (nxt, _) in zip(round_events, round_events[1:])
                         if kind == "batch" and nxt == "probe"]
            assert len(probed) >= 2 and trained and not set(probed.tolist()) & trained, client.cid


def test_the_probe_slice_is_held_out_on_calibration_rounds_only(digits) -> None:
    """Round 2 does not calibrate (--cal-every 3): it trains on every sample, the slice of round 1 included."""
    cfg = tiny_config("fedsga", clients=2, rounds=2, fedsga=FedSGAConfig(cal_every=3), train_subset=240,
                      train=TrainConfig(local_epochs=1, batch_size=32, max_batches=0))
    sim = Simulation(cfg, digits)
    logs = [_spy(c) for c in sim.clients]
    everyone = [set(c.data.indices.tolist()) for c in sim.clients]
    for _ in sim.rounds():
        pass
    for client, events, all_idx in zip(sim.clients, logs, everyone):
        end = next(i for i, (kind, _) in enumerate(events) if kind == "probe")
        later = events[end + 1:]
        trained = {int(i) for (kind, idx), (nxt, _) in zip(later, later[1:]) if kind == "batch" and nxt == "train"
                   for i in idx}
        assert trained == all_idx, client.cid
        assert client.data.probe_indices is None and set(client.data.indices.tolist()) == all_idx


def test_no_probe_slice_without_calibration(digits) -> None:
    for fed in (FedSGAConfig(estimator=False), FedSGAConfig(probe_holdout=0.0)):
        sim = Simulation(tiny_config("fedsga", clients=2, rounds=1, fedsga=fed), digits)
        sizes = [len(c.data.indices) for c in sim.clients]
        next(sim.rounds())
        assert all(c.data.probe_indices is None for c in sim.clients)
        assert [len(c.data.indices) for c in sim.clients] == sizes


def test_the_label_runs_the_server_blocks_after_the_round_like_the_devices_blocks(digits, monkeypatch) -> None:
    """Both probe paths equally fresh: the label is made once the round's blocks are aggregated (the server's
    blocks p_1..p_ref have had this round, as the device's have), not against the round-start blocks."""
    from fedsga_edge.coordinator.strategies import fedsga

    sim = Simulation(tiny_config("fedsga", clients=2, rounds=1, max_batches=2), digits)
    co = sim.coordinator
    seen: list[dict[str, torch.Tensor]] = []
    label = fedsga.label_probe

    def spy(st: Any, probe: dict[str, Any]) -> dict[str, Any]:
        seen.append({n: v.clone() for n, v in co.model.state_dict().items()})
        return label(st, probe)

    monkeypatch.setattr(fedsga, "label_probe", spy)
    rec = next(sim.rounds())
    assert len(seen) == 2 and all("L1" in c and "s" in c for c in rec["clients"].values())
    final = co.model.state_dict()
    for state in seen:
        assert all(torch.equal(v, final[n]) for n, v in state.items())
