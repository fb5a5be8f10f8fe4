"""The server copy's BatchNorm running statistics average the round's batches (docs/method.md)."""

from __future__ import annotations

import torch
from _runs import tiny_config

from fedsga_edge.simulation import Simulation
from fedsga_edge.tensors import round_average_bn


def test_round_average_bn_is_the_plain_mean_of_the_batch_means() -> None:
    bn = torch.nn.BatchNorm1d(2)
    bn.running_mean.fill_(5.0)
    round_average_bn(bn)
    bn.train()
    means = [-3.0, 1.0, 8.0]  # with momentum 0.1 the result would lean to the last batches
    for m in means:
        bn(torch.randn(64, 2) * 0.01 + m)
    assert torch.allclose(bn.running_mean, torch.full((2,), sum(means) / 3), atol=0.01)
    assert int(bn.num_batches_tracked) == 3


def test_a_round_restarts_the_server_statistics_and_counts_its_batches(digits) -> None:
    # The last block only runs on the server: after one round its counter is the round's server steps
    # (3 devices x 3 batches), and the statistics are no longer the initial zeros / ones.
    sim = Simulation(tiny_config("static", rounds=1, server_bn="round"), digits)
    next(sim.rounds())
    bn = next(m for m in sim.model.blocks[-1].modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert int(bn.num_batches_tracked) == 9
    assert float(bn.running_var.mean()) != 1.0
    ema = Simulation(tiny_config("static", rounds=1), digits)  # the default
    next(ema.rounds())
    bn_ema = next(m for m in ema.model.blocks[-1].modules() if isinstance(m, torch.nn.BatchNorm2d))
    assert bn_ema.momentum == 0.1 and not torch.allclose(bn_ema.running_mean, bn.running_mean)
