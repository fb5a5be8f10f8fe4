"""FedSGA's client compute beyond training (docs/method.md, "Costs"): the round-start
observation forward is counted per round in ``observation_flops``, beside ``calibration_flops``."""

from __future__ import annotations

import pytest
from _runs import tiny_config

from fedsga_edge.config import FedSGAConfig
from fedsga_edge.coordinator.limits import check_report
from fedsga_edge.method.policy import reference_index
from fedsga_edge.simulation import Simulation
from fedsga_edge.wire import RemoteProtocolError


def test_observation_and_probe_flops_count_what_each_device_ran(digits) -> None:
    sim = Simulation(tiny_config("fedsga", clients=3, rounds=2, batch_size=16, fedsga=FedSGAConfig(cal_every=2)),
                     digits)
    costs, K = sim.coordinator.costs, sim.coordinator.strategy.K
    r1, r2 = list(sim.rounds())
    for rec in (r1, r2):  # one observation batch of 16 per device and round, to p_1
        assert rec["observation_flops"] == {"client": 3 * 16 * costs.prefix_fwd(1)}
    # the probe: one batch of the slice held out on the calibration round (released after it), to p_ref
    frac = sim.cfg.fedsga.probe_holdout
    probes = [min(16, max(2, int(round(frac * len(c.data.indices)))), len(c.data.indices) - 2) for c in sim.clients]
    assert all(c.data.probe_indices is None for c in sim.clients)  # back in training after the round
    assert r2["calibration_flops"]["client"] == sum(probes) * costs.prefix_fwd(reference_index(K)) > 0


@pytest.mark.parametrize("bad", [-1, 1.5, True, "16"])
def test_obs_samples_is_checked_like_the_other_counts(bad) -> None:
    check_report({"train_loss": 1.0, "obs_samples": 16})
    with pytest.raises(RemoteProtocolError, match="obs_samples"):
        check_report({"train_loss": 1.0, "obs_samples": bad})
