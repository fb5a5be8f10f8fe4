"""The server side's own learning rate (docs/method.md, "The server's learning rate"): it reaches the server's
optimizer, and only the server's."""

from __future__ import annotations

import math

import pytest
from _runs import tiny_config

from fedsga_edge.runbuild import validate_config
from fedsga_edge.simulation import Simulation


def _server_only_change(sim: Simulation) -> float:
    """How far one round moved the last block (it runs on the server only at split 2)."""
    before = {n: v.clone() for n, v in sim.model.blocks[-1].state_dict().items() if v.is_floating_point()}
    next(sim.rounds())
    after = sim.model.blocks[-1].state_dict()
    return max(float((after[n] - v).abs().max()) for n, v in before.items() if "running" not in n)


def test_server_lr_sets_the_server_optimizer_and_defaults_to_lr(digits) -> None:
    default = Simulation(tiny_config("static", rounds=1), digits)
    assert default.coordinator.shared.opt.param_groups[0]["lr"] == default.cfg.train.lr
    slow = Simulation(tiny_config("static", rounds=1, server_lr=1e-9), digits)
    assert slow.coordinator.shared.opt.param_groups[0]["lr"] == 1e-9
    assert _server_only_change(slow) < 1e-6 < 1e-3 < _server_only_change(default)


def test_per_client_copies_use_the_server_lr_too(digits) -> None:
    sim = Simulation(tiny_config("static", rounds=1, server_copies="per_client", server_lr=0.03), digits)
    sim.coordinator.begin_round(1)  # a device's copy is made from the round's starting weights
    assert sim.coordinator._side("client-000").opt.param_groups[0]["lr"] == 0.03


def test_the_devices_keep_their_own_lr(digits) -> None:
    """A tiny server lr leaves the device-side block (block 0 at split 2) training as before."""
    for lr in (None, 1e-9):
        sim = Simulation(tiny_config("static", rounds=1, server_lr=lr), digits)
        name, before = next((n, v.clone()) for n, v in sim.model.blocks[0].state_dict().items()
                            if v.is_floating_point() and "running" not in n)
        next(sim.rounds())
        assert float((sim.model.blocks[0].state_dict()[name] - before).abs().max()) > 1e-4


@pytest.mark.parametrize("bad", [0.0, -0.1, math.nan, math.inf])
def test_a_bad_server_lr_is_refused_by_name(bad: float) -> None:
    with pytest.raises(ValueError, match="--server-lr"):
        validate_config(tiny_config("static", server_lr=bad))


def test_a_config_written_before_server_lr_existed_takes_the_default() -> None:
    from fedsga_edge.config import RunConfig

    data = tiny_config("static").to_dict()
    del data["server_lr"]
    assert RunConfig.from_dict(data).server_lr is None
