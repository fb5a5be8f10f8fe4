"""How an epoch is cut into batches (fedsga_edge/batches.py; docs/method.md, "Batches")."""

from __future__ import annotations

import numpy as np
import pytest

from fedsga_edge.batches import batch_sizes, cut_batches


@pytest.mark.parametrize("n", [1, 2, 15, 16, 17, 33, 130, 2250, 2500])
@pytest.mark.parametrize("b", [16, 64])
def test_balanced_batches_cover_the_epoch_once_and_none_is_under_half_a_batch(n: int, b: int) -> None:
    idx = np.random.default_rng(n).permutation(n)
    out = cut_batches(idx, b)
    assert np.array_equal(np.concatenate(out), idx)  # every sample once, in order
    sizes = [len(x) for x in out]
    assert len(sizes) == -(-n // b) and max(sizes) <= b and max(sizes) - min(sizes) <= 1
    if n >= b:
        assert min(sizes) >= b / 2  # the tail rule's last batch: 2 of 16 at n = 130, 4 of 64 at n = 2500


def test_the_tail_rule_is_the_one_runs_had_before_the_option() -> None:
    assert batch_sizes(130, 16, "tail") == [16] * 8 + [2]
    assert batch_sizes(129, 16, "tail") == [16] * 7 + [17]  # a last batch of one folded in
    assert batch_sizes(2500, 64, "tail") == [64] * 39 + [4]
    assert batch_sizes(130, 16) == [15] * 4 + [14] * 5


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match="batching must be one of balanced, tail"):
        batch_sizes(10, 4, "drop")


@pytest.mark.parametrize("n", [1, 63, 64, 65, 129, 130, 193])
def test_the_tail_rule_covers_the_epoch_once_with_no_batch_of_one(n: int) -> None:
    batches = cut_batches(np.arange(n), 64, "tail")
    assert np.array_equal(np.concatenate(batches), np.arange(n))  # none lost, none twice
    assert all(len(b) >= 2 for b in batches) or n == 1
    assert max(len(b) for b in batches) <= 65


def test_a_record_made_before_the_batching_option_reloads_with_the_rule_it_ran() -> None:
    """`trial --resume`, `calibrate-fleet` and the diagnostics rebuild an old run from its config.json: one
    without train.batching cut its epochs with the tail rule, and must not be re-run balanced."""
    from fedsga_edge.config import RunConfig

    old = RunConfig().to_dict()
    del old["train"]["batching"]
    old["client_sizes"] = [10, 20]  # written beside the config by the coordinator
    assert RunConfig.from_record(old).train.batching == "tail"
    new = RunConfig().to_dict() | {"method": "static"}
    assert RunConfig.from_record(new).train.batching == "balanced"
    with pytest.raises(ValueError, match="client_sizes"):
        RunConfig.from_record(old, drop_unknown=False)
