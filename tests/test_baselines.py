"""Issue 19's baselines beyond the paper's own: each method's core rule, checked so that breaking the
rule fails the test (docs/method.md, "Baselines beyond the paper's own")."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _runs import tiny_config

from fedsga_edge.simulation import Simulation


# -- MU-SplitFed: tau server steps per activation --------------------------------------------------------

def _activation(sim: Simulation, k: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    model = sim.coordinator.model
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(n, *model.interface_shape(model.depth_of(k), 0), generator=gen)
    return z, torch.randint(0, 10, (n,), generator=gen)


def _hand_steps(model, head, cfg, z, y, k: int, steps: int) -> tuple[dict, torch.Tensor]:
    """``steps`` plain SGD steps of suffix + head on one activation; the state and the first step's dz."""
    model, head = copy.deepcopy(model), copy.deepcopy(head)
    tc = cfg.train
    opt = torch.optim.SGD(list(model.parameters()) + list(head.parameters()), lr=tc.lr, momentum=tc.momentum,
                          weight_decay=tc.weight_decay)
    model.train()
    dz = None
    for _ in range(steps):
        zz = z.clone().requires_grad_(True)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model.head(model.suffix(zz, model.depth_of(k))), y).backward()
        opt.step()
        dz = zz.grad if dz is None else dz
    return model.state_dict(), dz


@pytest.mark.parametrize("tau", [1, 3])
def test_musplitfed_server_takes_exactly_tau_steps_per_activation(digits, tau: int) -> None:
    sim = Simulation(tiny_config("musplitfed", rounds=1, clients=2, strategy_args={"tau": tau}), digits)
    c = sim.coordinator
    k = sim.cfg.split
    z, y = _activation(sim, k)
    expected = {s: _hand_steps(c.model, c.head, sim.cfg, z, y, k, s) for s in (tau - 1, tau, tau + 1) if s}
    count = {"steps": 0}
    opt_step = c.server.shared.opt.step

    def counted(*a, **kw):
        count["steps"] += 1
        return opt_step(*a, **kw)

    c.server.shared.opt.step = counted
    zz = z.clone()
    c.server.step("client-000", zz, y, k, c.strategy)
    assert count["steps"] == tau
    state = c.model.state_dict()
    for s, (want, dz) in expected.items():
        same = all(torch.equal(state[n], want[n]) for n in want)
        assert same == (s == tau), f"server state {'differs from' if s == tau else 'equals'} {s} hand-made steps"
    assert torch.equal(zz.grad, expected[tau][1])  # the device's gradient: the first step's


def test_musplitfed_round_counts_tau_steps_for_every_activation(digits) -> None:
    """In a simulated round, every device batch (one activation) moves the server tau times."""
    tau, clients, batches = 3, 2, 2
    sim = Simulation(tiny_config("musplitfed", rounds=1, clients=clients, max_batches=batches,
                                 strategy_args={"tau": tau}), digits)
    opt = sim.coordinator.server.shared.opt
    count = {"steps": 0}
    opt_step = opt.step

    def counted(*a, **kw):
        count["steps"] += 1
        return opt_step(*a, **kw)

    opt.step = counted
    rec = next(sim.rounds())
    assert rec["failures"] == {} and len(rec["splits"]) == clients
    assert count["steps"] == tau * clients * batches


def test_musplitfed_refuses_a_server_side_it_cannot_step() -> None:
    from fedsga_edge.coordinator.server_side import make_server_side
    from torch import nn

    cfg = tiny_config("musplitfed", server_copies="per_client")
    with pytest.raises(ValueError, match="server-copies shared"):
        make_server_side(nn.Linear(2, 2), nn.Module(), cfg, lambda d: 1.0, steps=2)
