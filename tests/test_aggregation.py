"""Depth-wise, data-weighted aggregation (DESIGN §1.8): a hand-computed example and reference == fast."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsga_edge.method.aggregation import Contribution, aggregate_blocks, weighted_average, weighted_average_fast


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
