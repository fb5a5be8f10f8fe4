"""Depth-wise, data-weighted aggregation (docs/method.md "Aggregation"): a hand-computed example and reference == fast."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsga_edge.method.aggregation import (
    Contribution,
    DeviceUpdate,
    aggregate_blocks,
    aggregate_round,
    round_contributions,
    group_by_unit,
    weighted_average,
    weighted_average_fast,
)


def _s(w: float, rm: float = 0.0, n: int = 0) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([w]), "bn.running_mean": torch.tensor([rm]), "bn.num_batches_tracked": torch.tensor(n)}


def test_hand_computed_depthwise_example() -> None:
    # Three blocks. Client A (|D|=100) ran blocks 0-1 locally; client B (|D|=300) ran block 0 only.
    # Block 0: A and B ran it          -> (100*1 + 300*2) / 400 = 1.75
    # Block 1: A ran it (100); B's data passed through the server's copy (300)
    #          -> (100*3 + 300*5) / 400 = 4.5
    # Block 2: only the server's copy, data of A and B (400) -> 7 (unchanged value of the server copy)
    globals_ = {0: _s(0.0), 1: _s(0.0), 2: _s(0.0)}
    a = Contribution({0: _s(1.0, 10.0, 4), 1: _s(3.0, 30.0, 4)}, 100)
    b = Contribution({0: _s(2.0, 20.0, 9)}, 300)
    server = Contribution({1: _s(5.0, 50.0, 12), 2: _s(7.0, 70.0, 12)}, 0)
    server_b1 = Contribution({1: server.states[1]}, 300)
    server_b2 = Contribution({2: server.states[2]}, 400)
    for fast in (False, True):
        new = aggregate_blocks(globals_, [a, b, server_b1, server_b2], fast=fast)
        assert new[0]["w"].item() == pytest.approx(1.75)
        assert new[1]["w"].item() == pytest.approx(4.5)
        assert new[2]["w"].item() == pytest.approx(7.0)
        # BatchNorm statistics are averaged the same way; counters take the maximum.
        assert new[0]["bn.running_mean"].item() == pytest.approx(17.5)
        assert new[1]["bn.running_mean"].item() == pytest.approx(45.0)
        assert new[0]["bn.num_batches_tracked"].item() == 9


def test_a_block_nobody_trained_keeps_its_value() -> None:
    new = aggregate_blocks({0: _s(1.0), 1: _s(42.0)}, [Contribution({0: _s(3.0)}, 5)])
    assert new[1]["w"].item() == 42.0 and new[0]["w"].item() == 3.0


def test_bad_weights_and_keys_are_rejected() -> None:
    with pytest.raises(ValueError, match="positive sum"):
        weighted_average([_s(1.0)], [0.0])
    with pytest.raises(ValueError, match="disagree on keys"):
        weighted_average([_s(1.0), {"w": torch.zeros(1)}], [1.0, 1.0])


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 5),
    weights=st.lists(st.floats(0.1, 1000.0), min_size=5, max_size=5),
    seed=st.integers(0, 10_000),
)
def test_reference_and_fast_agree(n: int, weights: list[float], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    states = [
        {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g).double(), "c": torch.randint(0, 9, (2,), generator=g)}
        for _ in range(n)
    ]
    ref = weighted_average(states, weights[:n])
    fast = weighted_average_fast(states, weights[:n])
    assert list(ref) == list(fast)
    for k in ref:
        assert ref[k].dtype == fast[k].dtype
        torch.testing.assert_close(ref[k], fast[k], rtol=1e-6, atol=1e-6)


# --- one round's updates -> contributions (what the coordinator does after each round) -----------
# Four blocks + head: units 0..3 are blocks, unit 4 the head. Every unit holds a float weight and a
# BatchNorm counter, so a state missing either is partial.


def _u(w: float, n: int = 0) -> dict[str, torch.Tensor]:
    return {"w": torch.tensor([w]), "bn.num_batches_tracked": torch.tensor(n)}


GLOBAL = {j: _u(0.0) for j in range(5)}
SERVER = {j: _u(10.0 + 2 * j, 50) for j in range(5)}  # w: 10, 12, 14, 16, 18


def _mixed_round() -> list[DeviceUpdate]:
    return [
        # A: depth 1 (stem only), 100 samples
        DeviceUpdate("A", depth=1, num_samples=100, states={0: _u(1.0, 7)}),
        # B: depth 3 of 4 blocks, 300 samples
        DeviceUpdate("B", depth=3, num_samples=300, states={0: _u(2.0, 9), 1: _u(4.0, 9), 2: _u(6.0, 9)}),
        # C: depth 1, 100 samples, sent a *partial* unit 0 (BN counter missing): must be dropped
        DeviceUpdate("C", depth=1, num_samples=100, states={0: {"w": torch.tensor([1000.0])}}),
    ]


@pytest.mark.parametrize("fast", [False, True])
def test_round_with_mixed_depths_hand_computed(fast: bool) -> None:
    new = aggregate_round(GLOBAL, _mixed_round(), SERVER, fast=fast)
    w = {j: new[j]["w"].item() for j in new}
    # unit 0: A (100) and B (300); C's partial state is dropped  -> (100*1 + 300*2) / 400 = 1.75
    #   (uniform device weights: 1.5; C accepted: a key mismatch or (1 + 600 + 100000) / 500)
    assert w[0] == pytest.approx(1.75)
    # unit 1: B (300) + server copy carrying A's and C's data (100 + 100 = 200)
    #   -> (300*4 + 200*12) / 500 = 7.2   (server weighted by device count 2: (1200 + 24) / 302 = 4.05)
    assert w[1] == pytest.approx(7.2)
    # unit 2: (300*6 + 200*14) / 500 = 9.2
    assert w[2] == pytest.approx(9.2)
    # units 3, 4: only the server's copy (A, B, C all passed through it) -> its own value
    assert w[3] == pytest.approx(16.0) and w[4] == pytest.approx(18.0)
    # counters take the maximum of the copies averaged
    assert new[0]["bn.num_batches_tracked"].item() == 9
    assert new[1]["bn.num_batches_tracked"].item() == 50


def test_round_contributions_weights() -> None:
    contribs = round_contributions(GLOBAL, _mixed_round(), SERVER)
    devices, server = contribs[:3], contribs[3:]
    assert [sorted(c.states) for c in devices] == [[0], [0, 1, 2], []]  # C's partial unit 0 is gone
    assert [c.weight for c in devices] == [100.0, 300.0, 100.0]
    # one server contribution per unit it trained, weighted by the data that went through it
    assert [(sorted(c.states), c.weight) for c in server] == [([1], 200.0), ([2], 200.0), ([3], 500.0), ([4], 500.0)]


def test_partial_unit_of_a_local_block_keeps_the_global_value() -> None:
    # Unit 1 was run on the device (depth 2) but arrived partial: nobody else trained it this
    # round, and the server's copy of it saw none of this data, so the global value stays.
    g = {0: _u(1.0), 1: _u(2.0), 2: _u(3.0)}  # two blocks + head
    upd = DeviceUpdate("A", depth=2, num_samples=40, states={0: _u(5.0), 1: {"w": torch.tensor([9.0])}})
    new = aggregate_round(g, [upd], {j: _u(100.0 + j) for j in g})
    assert [new[j]["w"].item() for j in g] == [5.0, 2.0, 102.0]
    assert aggregate_round(g, [], None) == {j: dict(v) for j, v in g.items()}  # no updates: unchanged


def test_wrong_shape_counts_as_partial() -> None:
    g = {0: _u(1.0), 1: _u(2.0)}
    bad = {"w": torch.tensor([7.0, 7.0]), "bn.num_batches_tracked": torch.tensor(1)}
    new = aggregate_round(g, [DeviceUpdate("A", 1, 10, {0: bad})], {1: _u(3.0)})
    assert new[0]["w"].item() == 1.0 and new[1]["w"].item() == 3.0


@pytest.mark.parametrize("head_depth", [2, 3])  # today's full device reports depth L and sends the head
def test_fedavg_devices_send_nothing_through_the_server(head_depth: int) -> None:
    g = {0: _u(0.0), 1: _u(0.0), 2: _u(0.0)}  # two blocks + head
    a = DeviceUpdate("A", depth=head_depth, num_samples=10, states={0: _u(1.0), 1: _u(2.0), 2: _u(3.0)})
    b = DeviceUpdate("B", depth=3, num_samples=30, states={0: _u(5.0), 1: _u(6.0), 2: _u(7.0)})
    assert len(round_contributions(g, [a, b], None)) == 2  # no server contribution at all
    new = aggregate_round(g, [a, b], None)
    assert [new[j]["w"].item() for j in g] == pytest.approx([4.0, 5.0, 6.0])  # (10 x + 30 y) / 40


def test_round_contributions_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="no server state"):
        round_contributions(GLOBAL, [DeviceUpdate("A", 1, 5, {0: _u(1.0)})], None)
    with pytest.raises(ValueError, match="exceeds"):
        round_contributions(GLOBAL, [DeviceUpdate("A", 6, 5, {})], SERVER)
    with pytest.raises(ValueError, match="units 0..L"):
        round_contributions({0: _u(0.0), 2: _u(0.0)}, [], None)
    with pytest.raises(ValueError, match=">= 0"):
        DeviceUpdate("A", 1, -5, {})


def test_units_come_from_the_given_map_not_from_names() -> None:
    """Grouping asks the model's map (``SplitModel.unit_of``); names that follow no convention group as told."""
    units = {"stem.conv.weight": 0, "deep.bn.running_mean": 3, "classifier.weight": 4}
    state = {name: torch.zeros(1) for name in units}
    assert {j: sorted(s) for j, s in group_by_unit(state, units.__getitem__).items()} == {
        0: ["stem.conv.weight"],
        3: ["deep.bn.running_mean"],
        4: ["classifier.weight"],
    }
    with pytest.raises(KeyError):
        group_by_unit({"blocks.0.w": torch.zeros(1)}, units.__getitem__)


def test_robust_rules_leave_one_hostile_copy_out_and_keep_the_counters_rule() -> None:
    from fedsga_edge.method.aggregation import robust_average

    ref = {"w": torch.zeros(2), "n": torch.tensor(0)}
    copies = [{"w": torch.tensor([v, -v]), "n": torch.tensor(i)} for i, v in enumerate([1.0, 2.0, 3.0, -400.0])]
    ones = [1.0] * 4
    assert robust_average(copies, ones, "mean")["w"].tolist() == pytest.approx([-98.5, 98.5])
    assert robust_average(copies, ones, "median")["w"].tolist() == pytest.approx([1.5, -1.5])
    assert robust_average(copies, ones, "trimmed_mean", 0.25)["w"].tolist() == pytest.approx([1.5, -1.5])
    assert robust_average(copies, ones, "trimmed_mean", 0.0)["w"].tolist() == pytest.approx([-98.5, 98.5])
    bounded = robust_average(copies, ones, "norm_bounded", ref=ref)["w"]  # each change cut to the median, 2.5 * sqrt 2
    assert bounded.tolist() == pytest.approx([(1 + 2 + 2.5 - 2.5) / 4, -(1 + 2 + 2.5 - 2.5) / 4])
    assert all(robust_average(copies, ones, r, ref=ref)["n"].item() == 3 for r in ("median", "trimmed_mean"))


def test_multi_krum_leaves_the_copies_far_from_their_neighbours_out_whole() -> None:
    from fedsga_edge.method.aggregation import krum_keep, robust_average

    honest = [{"w": torch.tensor([1.0 + 0.1 * i, -1.0]), "n": torch.tensor(i)} for i in range(4)]
    evil = {"w": torch.tensor([1.2, 3.0]), "n": torch.tensor(9)}  # each coordinate inside a trimmed mean's reach
    copies = honest[:2] + [evil] + honest[2:]
    assert krum_keep(copies, 0.2) == [0, 1, 3, 4]  # f = 1 of 5: the farthest copy leaves
    kept = robust_average(copies, [1.0, 1.0, 1.0, 1.0, 4.0], "krum", 0.2)
    assert kept["w"].tolist() == pytest.approx([(1.0 + 1.1 + 1.2 + 4 * 1.3) / 7, -1.0])  # the rest, by weight
    assert kept["n"].item() == 3  # counters: the maximum over the kept copies
    ten = [{"w": torch.tensor([float(i % 3), 0.0])} for i in range(8)] + [{"w": torch.tensor([0.0, 50.0 + i])}
                                                                            for i in range(2)]
    assert krum_keep(ten, 0.2) == list(range(8))  # f = 2 of 10
    assert krum_keep(copies[:3], 0.2) == [0, 1, 2]  # fewer than f + 3: no neighbours to score by, all kept


def test_robust_rules_are_weighted_so_the_servers_copy_counts_for_its_devices() -> None:
    from fedsga_edge.method.aggregation import robust_average

    copies = [{"w": torch.tensor([v])} for v in (0.0, 10.0, 11.0)]
    assert robust_average(copies, [5.0, 1.0, 1.0], "median")["w"].item() == 0.0  # 5 of 7 samples say 0
    assert robust_average(copies[:2], [1.0, 1.0], "median")["w"].item() == 5.0  # two equal weights: their mean
    # trim 0.2 of 10: cuts 2 units of weight from each end
    assert robust_average(copies, [8.0, 1.0, 1.0], "trimmed_mean", 0.2)["w"].item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="not one of"):
        robust_average(copies, [1.0] * 3, "bulyan")
    with pytest.raises(ValueError, match="reference"):
        robust_average(copies, [1.0] * 3, "norm_bounded")
