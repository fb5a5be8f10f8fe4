"""The server copy's BatchNorm running statistics average the round's batches (docs/method.md)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _coordinator import only_reply
from _runs import tiny_config

from fedsga_edge.runbuild import validate_config
from fedsga_edge.simulation import Simulation
from fedsga_edge.tensors import round_average_bn
from fedsga_edge.wire import Message


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


# -- --server-bn-context (docs/method.md, "Server-side BatchNorm statistics") ---------------------------
def _activation(co, sender: str, seq: int, z: np.ndarray, y: np.ndarray) -> Message:
    return Message("activation", "sim-0", co.round.t, seq, sender, {"z": z, "y": y, "split": 2})


def _dz_by_hand(co, z: np.ndarray, y: np.ndarray, context: list[torch.Tensor]) -> torch.Tensor:
    """What the reply's gradient must be: the batch with the context rows, loss on the batch's rows only."""
    model = copy.deepcopy(co.model)
    model.train()
    x = torch.from_numpy(z).requires_grad_(True)
    logits = model.head(model.suffix(torch.cat([x, *context]), model.depth_of(2)))[: len(y)]
    F.cross_entropy(logits, torch.from_numpy(y)).backward()
    return x.grad


def test_bn_context_puts_other_devices_rows_in_the_batch_statistics_and_charges_them_nothing(digits) -> None:
    # bounded influence off: the batches below differ in scale on purpose (the context's arithmetic is tested)
    sim = Simulation(tiny_config("static", clients=3, rounds=1, server_bn_context=1, clip_activations=0.0), digits)
    co = sim.coordinator
    co.begin_round(1)
    shape = co.model.interface_shape(co.model.depth_of(2))
    rng = np.random.default_rng(0)
    za, zb, zc = (rng.standard_normal((4, *shape)).astype(np.float32) + m for m in (0.0, 3.0, -3.0))
    y = np.array([0, 1, 2, 3], np.int64)

    # the first activation has no context: the plain gradient
    expect = _dz_by_hand(co, za, y, [])
    reply = only_reply(co.receive(_activation(co, "client-000", 1, za, y)))
    assert reply.kind == "gradient" and torch.allclose(torch.from_numpy(reply.body["dz"]), expect, atol=1e-6)
    # client-001's batch is normalised together with client-000's latest rows (one other device)
    with_context = _dz_by_hand(co, zb, y, [torch.from_numpy(za)])
    alone = _dz_by_hand(co, zb, y, [])
    dz = torch.from_numpy(only_reply(co.receive(_activation(co, "client-001", 1, zb, y))).body["dz"])
    assert torch.allclose(dz, with_context, atol=1e-6) and not torch.allclose(dz, alone, atol=1e-3)
    # at most one other device: client-002 gets client-001's rows (the latest), not client-000's
    expect = _dz_by_hand(co, zc, y, [torch.from_numpy(zb)])
    dz = torch.from_numpy(only_reply(co.receive(_activation(co, "client-002", 1, zc, y))).body["dz"])
    assert torch.allclose(dz, expect, atol=1e-6)
    assert list(co.server.rows[2]) == ["client-001", "client-002"]  # n + 1 kept per split, most recent last

    # a refused activation changes nothing and never enters anyone's statistics
    held = {d: z.clone() for d, z in co.server.rows[2].items()}
    bad = only_reply(co.receive(_activation(co, "client-000", 2, np.full_like(za, np.nan), y)))
    assert bad.kind == "error" and co.server.rows[2].keys() == held.keys()
    assert all(torch.equal(co.server.rows[2][d], z) for d, z in held.items())


def test_bn_context_runs_and_is_refused_where_it_means_nothing(digits) -> None:
    rec = next(Simulation(tiny_config("static", clients=3, rounds=1, server_bn_context=2), digits).rounds())
    assert not rec["failures"] and math.isfinite(rec["train_loss"])
    with pytest.raises(ValueError, match="--server-bn-context"):
        validate_config(tiny_config("static", server_bn_context=-1))
    with pytest.raises(ValueError, match="--server-bn-context needs --server-copies shared"):
        validate_config(tiny_config("static", server_bn_context=2, server_copies="per_client"))
