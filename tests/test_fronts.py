"""Private fronts (``--fronts private``, docs/method.md "Private fronts"): a device's blocks stay its own, the
server side is shared, and the test figure says which model it scores."""

from __future__ import annotations

import pytest
import torch
from _runs import loopback_field_run, tiny_config

from fedsga_edge.coordinator.fronts import TEST_MODEL
from fedsga_edge.simulation import Simulation


def _state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: v.detach().clone() for n, v in module.state_dict().items() if v.is_floating_point()}


def _differ(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[n], b[n]) for n in a)


def test_private_fronts_stay_each_devices_own_and_the_server_side_is_shared(digits) -> None:
    sim = Simulation(tiny_config("static", rounds=2, split=2, max_batches=2, fronts="private"), digits)
    co, model = sim.coordinator, sim.coordinator.model
    first = _state(model.blocks[0])  # a device's block at split 2: never the server's
    last = _state(model.blocks[-1])  # the server's only
    rec = next(sim.rounds())
    fronts = co.fronts.fronts
    assert sorted(fronts) == ["client-000", "client-001", "client-002"]
    name = next(n for n, v in fronts["client-000"].items() if model.unit_of(n) == 0 and v.is_floating_point())
    assert not torch.equal(fronts["client-000"][name], fronts["client-001"][name])  # trained apart, not averaged
    assert not _differ(first, _state(model.blocks[0]))  # the global copy of a device's block did not move
    assert _differ(last, _state(model.blocks[-1]))  # the shared server side trained
    # every front covers every block a device may run (the deepest split), whatever split it ran
    depth = model.depth_of(model.num_splits)
    assert {model.unit_of(n) for n in fronts["client-002"]} == set(range(depth))
    # the test figure scores each device's front with the shared server side, and says so
    assert rec["test_model"] == TEST_MODEL and len(rec["test_acc_devices"]) == 3
    # the next round sends each device its own front
    out = co.begin_round(2)
    sent = {cid: m.body["weights"] for cid, m in out}
    assert (sent["client-001"][name] == fronts["client-001"][name].numpy()).all()


def test_shared_fronts_average_the_devices_blocks_as_before(digits) -> None:
    sim = Simulation(tiny_config("static", rounds=1, split=2), digits)
    first = _state(sim.coordinator.model.blocks[0])
    rec = next(sim.rounds())
    assert sim.coordinator.fronts.fronts == {} and "test_model" not in rec
    assert _differ(first, _state(sim.coordinator.model.blocks[0]))


def test_a_device_that_deepens_runs_its_own_copy_of_the_blocks_it_had_handed_over(digits) -> None:
    """Its copy of a block it first left to the server starts as the global model's, and stays its own."""
    sim = Simulation(tiny_config("random", rounds=2, max_batches=1, fronts="private", seed=3), digits)
    recs = list(sim.rounds())
    co = sim.coordinator
    depth = co.model.depth_of(co.model.num_splits)
    splits = [r["splits"] for r in recs]
    assert len({k for s in splits for k in s.values()}) > 1  # the splits did change
    for cid, front in co.fronts.fronts.items():
        assert {co.model.unit_of(n) for n in front} == set(range(depth)), cid


def test_the_test_figure_scores_each_device_at_its_split_with_the_shared_server_side_past_it(digits) -> None:
    """A device at p_1 never trains its own copy of the blocks past p_1: the server's shared copy runs them, and
    the model scored for it is its own blocks below the split and the shared ones after."""
    sim = Simulation(tiny_config("static", rounds=1, split=1, max_batches=2, fronts="private"), digits)
    next(sim.rounds())
    co, model = sim.coordinator, sim.coordinator.model
    cut, depth = model.depth_of(1), model.depth_of(model.num_splits)
    assert cut < depth  # the front holds blocks this device never ran
    glob = model.state_dict()
    models = co.fronts.test_models(glob, lambda cid: 1.0)
    assert len(models) == 3
    for cid, (_, state) in zip(sorted(co.fronts.fronts), models):  # one per device, in device order
        front = co.fronts.fronts[cid]
        past = [n for n in front if cut <= model.unit_of(n) < depth and front[n].is_floating_point()]
        assert past and all(torch.equal(state[n], glob[n]) for n in past)  # the shared server side's copy
        assert any(not torch.equal(front[n], glob[n]) for n in past)  # not the device's untrained copy
        own = [n for n in front if model.unit_of(n) < cut and front[n].is_floating_point()]
        assert own and all(torch.equal(state[n], front[n]) for n in own)


def test_private_fronts_checkpoint_and_restore(digits) -> None:
    sim = Simulation(tiny_config("static", rounds=1, split=1, max_batches=1, fronts="private"), digits)
    next(sim.rounds())
    state = sim.coordinator.checkpoint_state()
    again = Simulation(tiny_config("static", rounds=1, split=1, max_batches=1, fronts="private"), digits)
    again.coordinator.restore(state)
    for cid, front in sim.coordinator.fronts.fronts.items():
        assert all(torch.equal(v, again.coordinator.fronts.fronts[cid][n]) for n, v in front.items())
    assert again.coordinator.fronts.runs == sim.coordinator.fronts.runs == dict.fromkeys(
        sim.coordinator.fronts.fronts, sim.coordinator.model.depth_of(1))
    # a checkpoint written before the splits were kept (the fronts alone) still restores them
    older = Simulation(tiny_config("static", rounds=1, split=1, max_batches=1, fronts="private"), digits)
    older.coordinator.fronts.load_state_dict(state["fronts"]["fronts"])
    assert sorted(older.coordinator.fronts.fronts) == sorted(sim.coordinator.fronts.fronts)
    assert older.coordinator.fronts.runs == {}


@pytest.mark.timeout(300)
def test_private_fronts_in_the_field(digits, tmp_path) -> None:
    """The coordinator service and two device agents: each device gets its own front back."""
    cfg = tiny_config("static", clients=2, rounds=2, max_batches=2, split=2, fronts="private", eval_holdout=0.2)
    cfg.round_timeout = 120.0
    with loopback_field_run(cfg, digits, tmp_path) as service:
        service.wait(240)
    recs = service.records
    assert all(r["failures"] == {} for r in recs) and "fed_acc" in recs[0]
    fronts = service.co.fronts.fronts
    name = next(n for n, v in fronts["client-000"].items() if v.is_floating_point())
    assert not torch.equal(fronts["client-000"][name], fronts["client-001"][name])


def test_private_fronts_are_refused_where_the_strategy_makes_each_devices_copy() -> None:
    from fedsga_edge.runbuild import validate_config

    validate_config(tiny_config("fedsga", fronts="private"))
    with pytest.raises(ValueError, match="--fronts private: --strategy fedmut"):
        validate_config(tiny_config("fedmut", fronts="private"))
    with pytest.raises(ValueError, match="--quarantine needs --fronts shared"):
        validate_config(tiny_config("static", fronts="private", quarantine=2.0))
