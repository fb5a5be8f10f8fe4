"""The per-client server copies on two ranks (coordinator/sharding.py) train what one process trains."""

from __future__ import annotations

import pytest
import torch

from fedsga_edge.config import RunConfig, TrainConfig
from fedsga_edge.coordinator import get_strategy
from fedsga_edge.coordinator.influence import change_norms, clip_updates
from fedsga_edge.coordinator.sharding import check_sharding, deal, expected_work
from fedsga_edge.serverranks import ServerRanks
from fedsga_edge.simulation import Simulation


def _cfg(**kw) -> RunConfig:
    base = dict(strategy="static", dataset="digits", clients=3, rounds=2, model="resnet18_cifar", width=0.125,
                seed=0, device="cpu", eval_every=2, server_copies="per_client",
                train=TrainConfig(local_epochs=1, batch_size=32, max_batches=1))
    return RunConfig(**(base | kw))


def _run(cfg: RunConfig, ranks: ServerRanks | None,
         states: list[dict[str, torch.Tensor]] | None = None) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The run's round records and final weights (``states``, if given, gets the weights after every round)."""
    sim = Simulation(cfg)
    if ranks is not None:
        ranks.shard(sim.coordinator)
    records = []
    for r in sim.rounds():
        records.append({k: v for k, v in r.items() if k not in ("wall_s", "round_s")})
        if states is not None:
            states.append({n: v.clone() for n, v in sim.model.state_dict().items()})
    return records, {n: v.clone() for n, v in sim.model.state_dict().items()}


def test_two_ranks_train_what_one_process_trains():
    torch.set_num_threads(1)  # the other rank's thread count: the same float sums on both sides
    at_one: list[dict[str, torch.Tensor]] = []
    at_two: list[dict[str, torch.Tensor]] = []
    one = _run(_cfg(), None, at_one)
    with ServerRanks(_cfg(), 2, threads=1) as ranks:
        two = _run(_cfg(), ranks, at_two)
        assert set(ranks.server.owners.values()) == {0, 1}
    for a, b in zip(one[0], two[0], strict=True):
        assert a["splits"] == b["splits"] and a["failures"] == b["failures"] == {}
        assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
        assert a.get("test_acc") == pytest.approx(b.get("test_acc"))
    # Round 1's average is one process's to float rounding: the ranks add their float64 sums in another order,
    # which moves some entries by one float32 ulp (about one run in six measured here), never more.
    for n, v in at_one[0].items():
        torch.testing.assert_close(at_two[0][n], v, rtol=2e-7, atol=1e-9, msg=n)
    # Round 2 starts from those weights: a one-ulp move can flip a ReLU near zero at batch 32, and that flip
    # changes a gradient by a step, not by an ulp (the largest measured: 3.5e-5 in a device's first conv, one run
    # in ten). A wrong copy, device or weight in the average moves weights by the size of an update (1e-3 and up).
    for n, v in one[1].items():
        torch.testing.assert_close(two[1][n], v, rtol=1e-4, atol=2e-4, msg=n)


def _leaving_out(sim: Simulation, device: str) -> None:
    """Every round, ``device``'s server copy is left out just before the copies are averaged (as an anomaly
    score would leave it out, coordinator/anomaly.py)."""
    server = sim.coordinator.server
    end = server.end_round

    def end_round(snapshot):
        server.leave_out({device})
        end(snapshot)

    server.end_round = end_round


def test_a_copy_left_out_on_another_rank_leaves_the_average_as_on_one_rank():
    torch.set_num_threads(1)
    with ServerRanks(_cfg(), 2, threads=1) as ranks:
        sim = Simulation(_cfg())
        ranks.shard(sim.coordinator)
        device = next(d for d, r in ranks.server.owners.items() if r == 1)
        _leaving_out(sim, device)
        for _ in sim.rounds():
            pass
        two = {n: v.clone() for n, v in sim.model.state_dict().items()}
    one_sim = Simulation(_cfg())
    _leaving_out(one_sim, device)
    for _ in one_sim.rounds():
        pass
    kept = _run(_cfg(), None)[1]
    left = one_sim.model.state_dict()
    for n, v in left.items():  # two rounds: the tolerance of test_two_ranks_train_what_one_process_trains
        torch.testing.assert_close(two[n], v, rtol=1e-4, atol=2e-4, msg=n)
    # the copy left out moves the average by far more than that tolerance (both one-process runs: deterministic)
    assert max((kept[n].double() - v.double()).abs().max().item() for n, v in left.items()) > 1e-2  # 0.019


def test_a_message_travels_as_a_header_and_its_tensors():
    """Tensors anywhere in a message leave the header as slots, in order, and come back in their places."""
    import pickle

    from fedsga_edge.coordinator.sharding import _pack, _slots, _unpack

    msg = {"op": "step", "id": 3, "z": torch.randn(2, 3), "y": torch.tensor([1, 0]),
           "snapshot": {"w": torch.ones(4), "n": torch.tensor(7)}, "pair": (torch.zeros(0), 1.5)}
    tensors: list[torch.Tensor] = []
    header = pickle.loads(pickle.dumps(_pack(msg, tensors)))
    slots = _slots(header)
    assert [sl.index for sl in slots] == list(range(5)) and len(tensors) == 5
    assert all(sl.shape == tuple(t.shape) and sl.dtype == t.dtype for sl, t in zip(slots, tensors))
    back = _unpack(header, [t.clone() for t in tensors])
    assert back["op"] == "step" and back["id"] == 3 and back["pair"][1] == 1.5 and back["pair"][0].numel() == 0
    for k in ("z", "y"):
        assert torch.equal(back[k], msg[k])
    assert torch.equal(back["snapshot"]["n"], msg["snapshot"]["n"])


def test_rank_zero_holds_its_own_steps_until_another_rank_has_work():
    """Rank 0's own activations wait for the next one sent elsewhere, or for the scheduler's wait; a bad one is
    refused without costing the others their step; a round closed first drops them."""
    from fedsga_edge.coordinator.server_side import Activation
    from fedsga_edge.coordinator.sharding import ShardedServer
    from fedsga_edge.runbuild import build_coordinator, plan_run
    from fedsga_edge.wire import Message

    torch.manual_seed(0)
    co = build_coordinator(plan_run(_cfg())).coordinator
    old = co.server
    side = ShardedServer(old.model, old.head, co.cfg, old.weight, owners={d: 0 for d in co.clients}, world=1)
    snapshot = {n: v.detach().clone() for n, v in co.model.state_dict().items()}
    shape = co.model.interface_shape(co.model.depth_of(1))
    a, b, c = list(co.clients)

    def act(d: str, z: torch.Tensor) -> Activation:
        return Activation(Message("activation", "r", 1, 1, d, {}), 1, z, torch.tensor([0, 1]), None, 0, None, None)

    side.begin_round(snapshot)
    assert side.submit(act(a, torch.randn(2, *shape)), co.strategy) == []
    assert side.submit(act(b, torch.full((2, *shape), float("nan"))), co.strategy) == []
    assert side.wait_held()
    out = {r.act.msg.sender: r for r in side.release({a, b}, False, co.strategy)}
    assert out[a].grad is not None and out[a].refused is None
    assert out[b].refused is not None and out[b].refused.startswith("bad activation")
    assert not side.wait_held()
    side.submit(act(c, torch.randn(2, *shape)), co.strategy)
    [dropped] = side.release(set(), True, co.strategy)
    assert dropped.act.msg.sender == c and "round closed" in dropped.dropped


def test_devices_are_dealt_by_expected_work():
    """Equal devices go round-robin; uneven ones (a Dirichlet split) come out even by work, not by count."""
    assert deal({f"d{i}": 10.0 for i in range(5)}, 2) == {"d0": 0, "d1": 1, "d2": 0, "d3": 1, "d4": 0}
    samples = {"a": 199, "b": 86, "c": 556, "d": 214, "e": 138, "f": 244}
    ranks = deal(expected_work(samples, _cfg(train=TrainConfig(batch_size=32, max_batches=0))), 2)
    loads = [sum(n for d, n in samples.items() if ranks[d] == r) for r in (0, 1)]
    assert sorted(loads) == [694, 743]  # round-robin by count: 893 and 544
    capped = expected_work(samples, _cfg(train=TrainConfig(batch_size=32, max_batches=3)))
    assert capped == {d: float(min(n, 96)) for d, n in samples.items()}
    assert deal(capped, 2) == {"a": 0, "b": 1, "c": 1, "d": 0, "e": 1, "f": 0}


@pytest.mark.parametrize("kw, strategy, why", [
    ({"server_copies": "shared"}, "static", "arrival order"),
    ({"aggregation": "median"}, "static", "--aggregation median"),
    ({}, "fedsga", "its own server-side"),
])
def test_what_cannot_shard_is_refused_by_name(kw, strategy, why):
    with pytest.raises(ValueError, match=why):
        check_sharding(_cfg(strategy=strategy, **kw), get_strategy(strategy))


def test_update_bounds_across_processes_are_one_process_bounds():
    """Each half clipped against the other half's change norms is the whole fleet clipped at once."""
    g = torch.Generator().manual_seed(0)
    ref = {0: {"w": torch.zeros(5)}, 1: {"v": torch.zeros(3)}}
    updates = {f"d{i}": {0: {"w": torch.randn(5, generator=g) * (10 if i == 2 else 1)},
                         1: {"v": torch.randn(3, generator=g)}} for i in range(6)}
    copy = lambda part: {d: {u: {n: t.clone() for n, t in st.items()} for u, st in s.items()}
                         for d, s in updates.items() if d in part}
    whole = copy(set(updates))
    clipped = clip_updates(ref, whole, 2.0)
    assert clipped == {"d2": 1}
    halves = [copy({"d0", "d2", "d4"}), copy({"d1", "d3", "d5"})]
    norms = [change_norms(ref, h) for h in halves]  # gathered before any rank clips
    for mine, other in ((halves[0], norms[1]), (halves[1], norms[0])):
        clip_updates(ref, mine, 2.0, elsewhere=other)
    for d, states in whole.items():
        part = halves[0] if d in halves[0] else halves[1]
        for u, st in states.items():
            assert torch.equal(st[next(iter(st))], part[d][u][next(iter(st))])
