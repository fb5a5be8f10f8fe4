"""Bounded influence of one device (docs/protocol.md, "Bounded influence"): finite but huge activations,
updates and probe observations are scaled down to what the fleet sends, and counted."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from _coordinator import only_reply
from _runs import tiny_config

from fedsga_edge.coordinator.influence import ActivationBound, clip_updates
from fedsga_edge.method.estimator import CalibrationBuffer, MonotoneEstimator, fit
from fedsga_edge.simulation import Simulation
from fedsga_edge.wire import Message


def test_activation_bound_is_the_other_devices_median_and_one_device_cannot_move_it() -> None:
    bound = ActivationBound(factor=5.0)
    z = torch.ones(4, 2, 2)  # per-sample norm 2
    assert bound.clip(1, z, "a")[1] is None  # nobody heard yet: nothing to compare with
    bound.accept("a", 1, z.flatten(1).norm(dim=1))
    assert bound.bound(1, "a") is None  # a device's own values never set its own bound
    bound.accept("b", 1, (2 * z).flatten(1).norm(dim=1))  # norm 4
    bound.accept("c", 1, (2 * z).flatten(1).norm(dim=1))  # norm 4
    bound.accept("evil", 1, (1e4 * z).flatten(1).norm(dim=1))  # norm 2e4
    assert bound.bound(1, "evil") == pytest.approx(5.0 * 4.0)  # from the others only
    big = torch.cat([z, 1e3 * z[:1]])  # 4 honest-sized samples... and one at norm 2000
    clipped, scale, n, sent = bound.clip(1, big, "evil")
    assert n == 1 and torch.equal(clipped[:4], z) and float(clipped[4].norm()) == pytest.approx(20.0)
    assert torch.allclose(clipped[4] / clipped[4].norm(), z[0] / z[0].norm())  # the direction is kept
    assert scale is not None and scale[4].item() == pytest.approx(20.0 / 2000.0) and scale[0].item() == 1.0
    assert float(sent[4]) == pytest.approx(2000.0)  # kept as sent: what is stored is not the bound's own output
    for _ in range(20):  # the attacker keeps at it: its own bound does not follow it
        bound.accept("evil", 1, (1e4 * z).flatten(1).norm(dim=1))
    assert bound.bound(1, "evil") == pytest.approx(20.0)
    assert ActivationBound(0.0).bound(1, "a") is None  # 0 = off


@pytest.mark.parametrize("fleet", [3, 5])
def test_a_device_sending_tiny_activations_does_not_drag_the_others_bound(fleet: int) -> None:
    bound = ActivationBound(factor=3.0)
    z = torch.ones(8, 4)  # per-sample norm 2
    honest = [f"h{i}" for i in range(fleet - 1)]
    for _ in range(5):  # persistently, from the first batch on
        bound.accept("evil", 1, (1e-3 * z).flatten(1).norm(dim=1))
        for h in honest:
            bound.accept(h, 1, z.flatten(1).norm(dim=1))
    for h in honest:
        assert bound.bound(1, h) == pytest.approx(6.0)  # the honest devices' 3 x 2, never evil's 0.006
        assert bound.clip(1, z, h)[2] == 0  # an honest batch is left alone
    assert bound.bound(1, "evil") == pytest.approx(6.0)


def test_in_a_fleet_of_two_each_device_is_bounded_by_the_other() -> None:
    bound = ActivationBound(factor=3.0)
    z = torch.ones(8, 4)
    bound.accept("a", 1, z.flatten(1).norm(dim=1))
    bound.accept("evil", 1, (1e4 * z).flatten(1).norm(dim=1))
    assert bound.bound(1, "evil") == pytest.approx(6.0) and bound.clip(1, 1e4 * z, "evil")[2] == 8


def test_clip_updates_scales_one_units_change_to_the_other_devices_median() -> None:
    ref = {0: {"w": torch.zeros(2), "n": torch.tensor(3)}}
    states = {d: {0: {"w": torch.tensor([v, 0.0]), "n": torch.tensor(5)}} for d, v in
              (("a", 1.0), ("b", 2.0), ("c", 3.0), ("evil", 1000.0))}
    assert clip_updates(ref, states, factor=2.0) == {"evil": 1}
    assert states["evil"][0]["w"].tolist() == pytest.approx([2.0 * 2.0, 0.0])  # upper median of 1, 2, 3: 2
    assert states["c"][0]["w"].tolist() == [3.0, 0.0] and states["evil"][0]["n"].item() == 5  # counters untouched
    two = {d: {0: {"w": torch.tensor([v, 0.0])}} for d, v in (("a", 1.0), ("evil", 1000.0))}
    assert clip_updates(ref, two, factor=2.0) == {} and two["evil"][0]["w"][0] == 1000.0  # no median of two


def test_a_tiny_update_does_not_drag_the_others_update_bound() -> None:
    ref = {0: {"w": torch.zeros(2)}}
    states = {d: {0: {"w": torch.tensor([v, 0.0])}} for d, v in (("a", 1.0), ("b", 1.2), ("evil", 1e-6))}
    assert clip_updates(ref, states, factor=2.0) == {}  # a's bound: 2 x the larger of b and evil


def test_a_hostile_activation_in_a_running_round_is_clipped_counted_and_its_gradient_scaled(digits) -> None:
    sim = Simulation(tiny_config("static", clients=3, rounds=1), digits)
    co = sim.coordinator
    co.begin_round(1)
    shape = co.model.interface_shape(co.model.depth_of(2))
    rng = np.random.default_rng(0)
    honest = [rng.standard_normal((8, *shape)).astype(np.float32) for _ in range(3)]
    for i, z in enumerate(honest[:2]):
        reply = only_reply(co.receive(Message("activation", "sim-0", 1, 1, f"client-00{i}",
                                              {"z": z, "y": np.arange(8, dtype=np.int64), "split": 2})))
        assert reply.kind == "gradient"
    typical = float(np.median(np.linalg.norm(honest[0].reshape(8, -1), axis=1)))
    evil = honest[2] * 100.0
    reply = only_reply(co.receive(Message("activation", "sim-0", 1, 1, "client-002",
                                          {"z": evil, "y": np.arange(8, dtype=np.int64), "split": 2})))
    assert reply.kind == "gradient" and np.isfinite(reply.body["dz"]).all()
    limit = co.bounds.bound(2, "client-002")
    assert limit is not None and limit < 10 * typical  # the bound is the fleet's, not the attacker's
    held = co.bounds.norms[2]["client-002"]
    assert min(held) > limit  # stored as sent: the attacker's values never become the bound's
    rec, _ = co.end_round()
    assert rec["clipped"]["activations"] == {"client-002": 8}


def test_estimator_inputs_are_bounded_and_old_pairs_age_out() -> None:
    buf = CalibrationBuffer(num_obs=3, capacity=8)
    for i in range(8):
        buf.append([0.5, 0.7 + 0.01 * i, 0.1], 0.5, i % 2)
    est = MonotoneEstimator()
    fit(est, buf, steps=1)
    honest_scale = est.obs_scale.clone()
    buf.append([1.0, 1e6, 1e6], 0.5, 1)  # one hostile pair (the probe's own range check allows 1e6)
    fit(est, buf, steps=1)
    assert float(est.obs_scale[1]) == pytest.approx(float(honest_scale[1]), rel=0.05)  # a median: one pair cannot move it
    assert len(buf) == 8  # the oldest pair went
    for _ in range(8):
        buf.append([0.5, 0.7, 0.1], 0.5, 1)
    assert float(buf.tensors()[0][:, 1].max()) == pytest.approx(0.7)  # the hostile pair aged out


def test_a_probe_observation_far_above_the_stored_pairs_is_clipped(digits) -> None:
    from fedsga_edge.coordinator.strategies.fedsga import _OBS_CLIP

    sim = Simulation(tiny_config("fedsga", clients=1, rounds=1), digits)
    strategy = sim.coordinator.strategy
    for _ in range(4):
        strategy.cal_buffer.append([0.5, 0.7, 0.2], 0.5, 1)
    o = strategy._bounded(np.array([0.9, 1e6, 1e6]))
    assert o.tolist() == pytest.approx([0.9, _OBS_CLIP * 0.7, _OBS_CLIP * 0.2])
