"""The server side's own learning rate (docs/method.md, "The server's learning rate"): it reaches
the server's optimizers, and only theirs."""

from __future__ import annotations

import math

import pytest
from _runs import tiny_config

from fedsga_edge.runbuild import validate_config
from fedsga_edge.simulation import Simulation


def _one_round_moves(sim: Simulation) -> tuple[float, float]:
    """How far one round moved block 0 (the devices' at split 2) and the last block (the server's only)."""
    def weights(block: int) -> dict:
        return {n: v.clone() for n, v in sim.model.blocks[block].state_dict().items()
                if v.is_floating_point() and "running" not in n}

    before = (weights(0), weights(-1))
    next(sim.rounds())
    after = (weights(0), weights(-1))
    return tuple(max(float((a[n] - b[n]).abs().max()) for n in b) for b, a in zip(before, after))  # type: ignore[return-value]


def test_server_lr_sets_the_server_optimizer_only_and_defaults_to_lr(digits) -> None:
    default = Simulation(tiny_config("static", rounds=1), digits)
    assert default.coordinator.server.shared.opt.param_groups[0]["lr"] == default.cfg.train.lr
    slow = Simulation(tiny_config("static", rounds=1, server_lr=1e-9), digits)
    assert slow.coordinator.server.shared.opt.param_groups[0]["lr"] == 1e-9
    device_default, server_default = _one_round_moves(default)
    device_slow, server_slow = _one_round_moves(slow)
    assert server_slow < 1e-6 < 1e-3 < server_default  # the server's block barely moves at 1e-9
    assert device_slow > 1e-3 and device_default > 1e-3  # the devices' block trains at --lr either way


def test_per_client_copies_use_the_server_lr_too(digits) -> None:
    sim = Simulation(tiny_config("static", rounds=1, server_copies="per_client", server_lr=0.03), digits)
    sim.coordinator.begin_round(1)  # a device's copy is made from the round's starting weights
    assert sim.coordinator.server.copy_for("client-000").opt.param_groups[0]["lr"] == 0.03


@pytest.mark.parametrize("bad", [0.0, -0.1, math.nan, math.inf])
def test_a_bad_server_lr_is_refused_by_name(bad: float) -> None:
    with pytest.raises(ValueError, match="--server-lr"):
        validate_config(tiny_config("static", server_lr=bad))


def test_a_config_written_before_server_lr_existed_takes_the_default() -> None:
    from fedsga_edge.config import RunConfig

    data = tiny_config("static").to_dict()
    del data["server_lr"]
    assert RunConfig.from_dict(data).server_lr is None
