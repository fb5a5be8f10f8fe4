"""A device's batches: every sample exactly once, a lone last sample joined to the batch before."""

from __future__ import annotations

import numpy as np
import pytest

from device.evaluate import eval_batches


@pytest.mark.parametrize("n", [1, 63, 64, 65, 129, 130, 193])
def test_every_sample_once_and_no_batch_of_one(n):
    batches = eval_batches(np.arange(n), 64)
    flat = np.concatenate(batches)
    assert np.array_equal(flat, np.arange(n))  # each sample once, in order: none lost, none twice
    assert all(len(b) >= 2 for b in batches) or n == 1
    assert max(len(b) for b in batches) <= 65
