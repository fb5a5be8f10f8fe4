"""--label-memory (beyond the paper; docs/method.md, "Label memory"): the server keeps each device's margin
log(Lref / L1) from its last calibration probe, sends it back in that device's round start, and Gamma takes
it as a fourth input, non-decreasing in it. The pair is stored with the server's copy of the margin."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from _runs import tiny_config

from fedsga_edge.config import FedSGAConfig
from fedsga_edge.device.role import check_round_start
from fedsga_edge.method import MonotoneEstimator
from fedsga_edge.method.heads import estimate
from fedsga_edge.simulation import Simulation
from fedsga_edge.tensors import to_numpy_state
from fedsga_edge.wire import RemoteProtocolError


@pytest.mark.parametrize("seed", range(5))
def test_gamma_is_non_decreasing_in_the_margin_and_the_device_computes_the_same_r(seed: int) -> None:
    torch.manual_seed(seed)
    gamma = MonotoneEstimator(num_obs=3, margin=True)
    assert gamma.num_obs == 4 and gamma.obs_sign.tolist() == [1.0, -1.0, -1.0, 1.0]
    with torch.no_grad():
        gamma.b2.fill_(0.3)
        gamma.w2_raw.normal_(0.0, 1.0)  # far from the prior: the direction must hold for any weights
        gamma.obs_scale.copy_(torch.tensor([1.0, 0.5, 2.0, 0.2]))
    margins = torch.linspace(-3.0, 3.0, 61)
    obs = torch.tensor([[0.2, 0.4, 0.1, 0.0]]).repeat(len(margins), 1)
    obs[:, 3] = margins
    with torch.no_grad():
        r = gamma(obs, torch.full((len(margins),), 0.5))
    assert bool((r[1:] >= r[:-1] - 1e-7).all()) and float(r[-1] - r[0]) > 1e-4
    state = to_numpy_state(gamma.state_dict())  # the device's numpy Gamma follows the state dict
    for i in (0, 30, 60):
        assert estimate(state, obs[i].tolist(), 0.5) == pytest.approx(float(r[i]), abs=1e-6)


def _margin(c: dict[str, Any]) -> float:
    return max(-10.0, min(10.0, math.log(c["Lref"] / c["L1"])))


def test_each_device_gets_back_its_own_last_margin_and_its_pair_is_stored_with_it(digits, tmp_path) -> None:
    cfg = tiny_config("fedsga", clients=3, rounds=3, fedsga=FedSGAConfig(cal_every=1, label_memory=True))
    sim = Simulation(cfg, digits)
    strategy = sim.coordinator.strategy
    assert strategy.estimator.num_obs == 4 and strategy.cal_buffer.num_obs == 4
    recs = []
    for rec in sim.rounds():
        recs.append(rec)
        if len(recs) == 2:  # round 2's pairs (round 1's are not informative) carry round 1's margins
            obs, _, _ = strategy.cal_buffer.tensors()
            sent = sorted(_margin(recs[0]["clients"][c]) for c in recs[0]["clients"])
            assert sorted(obs[:, 3].tolist()) == pytest.approx(sent, abs=1e-6)
    assert all(c["margin"] == 0.0 for c in recs[0]["clients"].values())  # no probe before round 1
    for before, after in zip(recs, recs[1:]):
        for cid, c in after["clients"].items():
            assert c["margin"] == pytest.approx(_margin(before["clients"][cid]), abs=1e-9)
    assert len({round(c["margin"], 9) for c in recs[1]["clients"].values()}) > 1  # per device, not one value
    saved = tmp_path / "strategy.pt"  # the margins survive a checkpoint (loaded as the resume loads it)
    torch.save(strategy.state_dict(), saved)
    again = Simulation(cfg, digits).coordinator.strategy
    again.load_state_dict(torch.load(saved, weights_only=True))
    assert again._margins == strategy._margins and len(again._margins) == 3


def test_a_device_cannot_choose_the_margin_its_pair_is_stored_with(digits) -> None:
    cfg = tiny_config("fedsga", clients=2, rounds=2, fedsga=FedSGAConfig(cal_every=1, label_memory=True))
    sim = Simulation(cfg, digits)
    co = sim.coordinator
    strategy, honest = co.strategy, co._handlers["probe"]
    lied = []

    def lying(msg: Any) -> Any:  # a hostile device reports a margin of its own choosing
        msg.body["o"] = list(msg.body["o"][:-1]) + [7.5]
        lied.append(msg.sender)
        return honest(msg)

    co._handlers["probe"] = lying
    r1, r2 = list(sim.rounds())
    assert len(lied) == 4
    obs, _, _ = strategy.cal_buffer.tensors()
    assert len(obs) == 2 and 7.5 not in obs[:, 3].tolist()
    assert sorted(obs[:, 3].tolist()) == pytest.approx(sorted(_margin(c) for c in r1["clients"].values()), abs=1e-6)


def test_without_the_option_nothing_changes_on_the_wire(digits) -> None:
    sim = Simulation(tiny_config("fedsga", clients=2, rounds=1, fedsga=FedSGAConfig(cal_every=1)), digits)
    co = sim.coordinator
    assert co.strategy.estimator.num_obs == 3
    fields = co.strategy.configure_round(1, ["client-000"])["client-000"].fields
    assert "margin" not in fields and "deadline" not in fields
    assert "label_memory" not in fields["fedsga"]
    (rec,) = list(sim.rounds())
    assert all("margin" not in c for c in rec["clients"].values())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), True, "0.5", 1e9])
def test_a_round_start_with_a_bad_margin_is_refused(bad: Any) -> None:
    body = {"train": {"local_epochs": 1}, "weights": {}, "split": 1, "fedsga": {"cal_every": 1}, "margin": bad}
    with pytest.raises(RemoteProtocolError, match="margin"):
        check_round_start(body)
    check_round_start(body | {"margin": -0.25})  # a finite one is accepted
