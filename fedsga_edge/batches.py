"""How a device cuts an epoch into batches: one rule for the device that trains and the coordinator that counts
what it trained (docs/method.md, "Batches"). Plain numpy, no torch.

``balanced`` (the default): ceil(n / batch_size) batches of nearly equal size, so none is under half a batch once
n >= batch_size. ``tail``: full batches and the remainder, a last batch of one folded into the one before (every
run before the option). The tail's small last batch is one SGD step on a few samples' batch statistics, per device
and epoch: on digits (batches of 16, 130 samples a device) a last batch of 2 took FedSGA from 95-98 % to 18-29 %
(benchmarks/RESULTS.md, "Batches of two").
"""

from __future__ import annotations

import numpy as np

__all__ = ["BATCHINGS", "batch_sizes", "cut_batches"]

BATCHINGS = ("balanced", "tail")


def batch_sizes(n: int, batch_size: int, batching: str = "balanced") -> list[int]:
    """The sizes of the batches ``n`` samples are cut into, in order."""
    if batching not in BATCHINGS:
        raise ValueError(f"batching must be one of {', '.join(BATCHINGS)} (got {batching!r})")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1 (got {batch_size})")
    if n <= 0:
        return []
    m = -(-n // batch_size)
    if batching == "balanced":
        small, extra = divmod(n, m)
        return [small + 1] * extra + [small] * (m - extra)
    sizes = [batch_size] * m
    sizes[-1] = n - batch_size * (m - 1)
    if m > 1 and sizes[-1] < 2:  # BatchNorm cannot train on one sample
        last = sizes.pop()
        sizes[-1] += last
    return sizes


def cut_batches(indices: np.ndarray, batch_size: int, batching: str = "balanced") -> list[np.ndarray]:
    """``indices`` in order, cut by ``batch_sizes``."""
    sizes = batch_sizes(len(indices), batch_size, batching)
    return np.split(np.asarray(indices), np.cumsum(sizes)[:-1]) if sizes else []
