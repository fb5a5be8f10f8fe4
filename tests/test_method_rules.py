"""Three rules of the method that a mutation used to survive: the headline split, Gamma used from the
round after its refit, and calibration rounds training at least to p_ref whatever the policy says."""

from __future__ import annotations

import numpy as np
import torch
from _runs import tiny_config

from fedsga_edge.config import FedSGAConfig
from fedsga_edge.coordinator.evaluation import headline_split
from fedsga_edge.simulation import Simulation


def test_the_headline_split_is_the_most_trained_ties_to_the_shallower_and_p_ref_before_any() -> None:
    assert headline_split({}, 3) == 2  # nothing trained yet: p_ref
    assert headline_split({0: 500}, 3) == 2  # whole-model rounds train no split
    assert headline_split({1: 10, 3: 30}, 3) == 3  # the most samples
    assert headline_split({1: 30, 3: 30}, 3) == 1  # a tie goes to the shallower
    assert headline_split({0: 1000, 3: 1}, 3) == 3  # whole-model samples do not count


def _state(sd: dict) -> dict[str, np.ndarray]:
    return {k: np.array(v.detach().cpu().numpy() if torch.is_tensor(v) else v) for k, v in sd.items()}  # copies


def test_gamma_refit_on_a_calibration_round_is_sent_from_the_next_round(digits) -> None:
    # rounds 1 and 2 calibrate (round 1's observations are all zero, so its refit can leave Gamma as it was)
    sim = Simulation(tiny_config("fedsga", clients=3, rounds=3, fedsga=FedSGAConfig(cal_every=2)), digits)
    co = sim.coordinator
    sent: dict[int, dict[str, np.ndarray]] = {}
    fitted: dict[int, dict[str, np.ndarray]] = {}
    begin, end = co.begin_round, co.end_round

    def begin_round(t, *a, **k):
        starts = begin(t, *a, **k)
        sent[t] = {k: np.array(v) for k, v in starts[0][1].body["estimator"].items()}  # as encoded then
        return starts

    def end_round(*a, **k):
        rec, out = end(*a, **k)
        fitted[rec["round"]] = _state(co.strategy.estimator.state_dict())
        return rec, out

    co.begin_round, co.end_round = begin_round, end_round
    initial = _state(co.strategy.estimator.state_dict())
    r1, r2, r3 = list(sim.rounds())
    assert "calibration" in r1 and "calibration" in r2 and "calibration" not in r3
    assert all(np.array_equal(sent[1][k], initial[k]) for k in initial)  # round 1 decides with the initial Gamma
    for t in (2, 3):  # every round decides with the Gamma of the end of the round before: not its own refit
        assert all(np.array_equal(sent[t][k], fitted[t - 1][k]) for k in initial), t
    assert any(not np.array_equal(fitted[2][k], sent[2][k]) for k in initial)  # round 2's refit changed Gamma


def test_calibration_rounds_train_at_least_to_p_ref_whatever_the_policy_says(digits) -> None:
    sim = Simulation(tiny_config("fedsga", clients=2, rounds=1, fedsga=FedSGAConfig(cal_every=5)), digits)
    with torch.no_grad():
        sim.coordinator.strategy.estimator.b2.fill_(30.0)  # r ~ 1: the policy sends every device to p_1
    (rec,) = list(sim.rounds())
    assert "calibration" in rec
    assert [c["k_policy"] for c in rec["clients"].values()] == [1, 1]  # what the policy said
    assert sorted(rec["splits"].values()) == [2, 2]  # what they trained: p_ref, so the probe compares their blocks
