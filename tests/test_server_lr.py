"""The server side's own learning rate (docs/method.md, "The server's learning rate"): it reaches
the server's optimizers, and only theirs."""

from __future__ import annotations

import math

import pytest
from _coordinator import bodies
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


@pytest.mark.parametrize("copies", ["shared", "per_client"])
def test_harmonizer_lr_trains_the_harmonizer_alone_at_its_rate_and_follows_the_schedule(digits, copies: str) -> None:
    """--harmonizer-lr: the harmonizer's MLP in a group of its own rate; G and the blocks keep --server-lr;
    the schedule scales both; unset, the server copy keeps one group (checkpoints of runs before it load)."""
    from fedsga_edge.config import FedSGAConfig

    plain = Simulation(tiny_config("fedsga", rounds=1, server_lr=0.05, server_copies=copies), digits)
    plain.coordinator.begin_round(1)
    assert len(plain.coordinator.server.copy_for("client-000").opt.param_groups) == 1
    sim = Simulation(tiny_config("fedsga", rounds=1, server_lr=0.05, server_copies=copies,
                                 fedsga=FedSGAConfig(harmonizer_lr=0.002)), digits)
    co = sim.coordinator
    co.begin_round(1)
    opt = co.server.copy_for("client-000").opt
    head = co.server.copy_for("client-000").head
    assert [g["lr"] for g in opt.param_groups] == [0.05, 0.002]
    assert {id(p) for p in opt.param_groups[1]["params"]} == {id(p) for p in head.harmonizer.parameters()}
    rest = {id(p) for p in opt.param_groups[0]["params"]}
    assert {id(p) for p in head.G.parameters()} <= rest and not rest & {id(p) for p in head.harmonizer.parameters()}
    co.server.copy_for("client-000").scale_lr(0.5)
    assert [g["lr"] for g in opt.param_groups] == [0.025, 0.001]
    if copies == "shared":  # the coordinator's alone: the devices' round start does not carry it
        run = Simulation(tiny_config("fedsga", rounds=1, fedsga=FedSGAConfig(harmonizer_lr=0.002)), digits)
        rec = next(run.rounds())
        assert rec["failures"] == {} and len(rec["splits"]) == run.cfg.clients


@pytest.mark.parametrize("bad", [0.0, -0.1, math.nan, math.inf])
def test_a_bad_server_lr_is_refused_by_name(bad: float) -> None:
    with pytest.raises(ValueError, match="--server-lr"):
        validate_config(tiny_config("static", server_lr=bad))


def test_a_config_written_before_server_lr_existed_takes_the_default() -> None:
    from fedsga_edge.config import RunConfig

    data = tiny_config("static").to_dict()
    del data["server_lr"]
    assert RunConfig.from_dict(data).server_lr is None


# -- the learning-rate schedule over the rounds (--lr-schedule) ------------------------------------------------

def test_cosine_schedule_factor_falls_from_one_and_constant_is_one() -> None:
    cos = tiny_config("static", rounds=4, lr_schedule="cosine")
    assert [cos.lr_scale(t) for t in (1, 2, 3, 4)] == pytest.approx([1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5,
                                                                     (1 + math.cos(3 * math.pi / 4)) / 2])
    assert all(tiny_config("static", rounds=4).lr_scale(t) == 1.0 for t in (1, 2, 3, 4))
    with pytest.raises(ValueError, match="--lr-schedule"):
        validate_config(tiny_config("static", lr_schedule="step"))


@pytest.mark.parametrize("copies", ["shared", "per_client"])
def test_the_rounds_rate_reaches_the_devices_round_start_and_every_server_copy(digits, copies: str) -> None:
    for t in (1, 3):
        sim = Simulation(tiny_config("static", rounds=4, lr_schedule="cosine", server_lr=0.03, server_copies=copies),
                         digits)
        co = sim.coordinator
        starts = bodies(co.begin_round(t))
        scale = sim.cfg.lr_scale(t)
        assert [b["train"]["lr"] for b in starts.values()] == pytest.approx([sim.cfg.train.lr * scale] * len(starts))
        assert co.server.copy_for("client-000").opt.param_groups[0]["lr"] == pytest.approx(0.03 * scale)
        assert co.server.shared.opt.param_groups[0]["lr"] == pytest.approx(0.03 * scale)
    assert sim.cfg.train.lr == 0.1  # the run's own setting is untouched
    constant = bodies(Simulation(tiny_config("static", rounds=4), digits).coordinator.begin_round(3))
    assert {b["train"]["lr"] for b in constant.values()} == {0.1}
