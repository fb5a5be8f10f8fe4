"""A uniformly random split per device and round: the adaptive baseline with no information."""

from __future__ import annotations

import numpy as np

from fedsga_edge.config import RunConfig

from ..strategy import Strategy, register_strategy


@register_strategy
class RandomSplit(Strategy):
    name = "random"
    help = "a uniformly random split per device and round (seeded)"
    label = "Random split"
    adaptive = True

    def __init__(self, cfg: RunConfig, num_splits: int, clients: list[str], train_flops: dict[int, int]) -> None:
        super().__init__(cfg, num_splits, clients, train_flops)
        self.rng = np.random.default_rng([cfg.seed, 7])

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: int(self.rng.integers(1, self.K + 1)) for c in clients}

