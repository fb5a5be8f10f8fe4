import math

import pytest
import torch

from fedsga_edge.method import Harmonizer, alignment_loss, server_loss


def test_alignment_loss_hand_computed():
    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    Z = torch.tensor([[3.0, 0.0]])  # cos = [1, 0] -> logits [2, 0] at tau 0.5
    loss = alignment_loss(Z, torch.tensor([0]), protos, tau_a=0.5)
    assert math.isclose(float(loss), math.log(1 + math.exp(-2)), rel_tol=1e-6)
    # zero prototypes: constant log(C)
    unset = alignment_loss(Z, torch.tensor([0]), torch.zeros(2, 2))
    assert math.isclose(float(unset), math.log(2), rel_tol=1e-6)


def test_server_loss_combines_parts():
    torch.manual_seed(0)
    logits, Z = torch.randn(4, 3), torch.randn(4, 5)
    labels, protos = torch.tensor([0, 1, 2, 1]), torch.randn(3, 5)
    loss, parts = server_loss(logits, Z, labels, protos, lambda_align=0.1, tau_a=0.5)
    assert torch.allclose(loss, parts["ce"] + 0.1 * parts["align"])
    assert torch.allclose(parts["ce"], torch.nn.functional.cross_entropy(logits, labels))


def test_harmonizer_depth_conditioning():
    torch.manual_seed(0)
    h = Harmonizer(in_dims=8, num_depths=3, dim=16, depth_dim=4)
    x = torch.randn(5, 8)
    z1, z3 = h(x, 1), h(x, 3)
    assert z1.shape == (5, 16)
    assert not torch.allclose(z1, z3)
    mixed = h(x, torch.tensor([1, 3, 1, 3, 1]))
    assert torch.allclose(mixed[0], z1[0]) and torch.allclose(mixed[1], z3[1])
    for bad in (0, 4):
        with pytest.raises(ValueError):
            h(x, bad)


def test_harmonizer_per_depth_widths():
    h = Harmonizer(in_dims={1: 4, 2: 6}, num_depths=2, dim=8)
    assert h(torch.randn(3, 4), 1).shape == (3, 8)
    assert h(torch.randn(3, 6), 2).shape == (3, 8)
    with pytest.raises(ValueError):
        h(torch.randn(3, 6), 1)


def test_residual_harmonizer_starts_as_the_identity_with_one_head_and_learns_per_depth_corrections():
    """--harmonizer-form residual: Z = pooled + MLP([pooled, e(k)]), the MLP's last layer at zero, so every depth
    starts with the same Z (the pooled features); a step moves the depths apart through e(k) only as far as the
    correction grows."""
    torch.manual_seed(0)
    h = Harmonizer(in_dims=8, num_depths=3, dim=16, depth_dim=4, residual=True)
    x = torch.randn(5, 8)
    assert h.dim == 8 and h(x, 1).shape == (5, 8)
    for k in (1, 2, 3):
        assert torch.equal(h(x, k), x)
    opt = torch.optim.SGD(h.parameters(), lr=0.5)
    for _ in range(3):
        opt.zero_grad()
        (h(x, 1) - 1.0).pow(2).mean().backward()
        opt.step()
    z1, z3 = h(x, 1), h(x, 3)
    assert not torch.allclose(z1, x) and not torch.allclose(z1, z3)
    paper = Harmonizer(in_dims=8, num_depths=3, dim=16, depth_dim=4)
    assert paper.dim == 16 and not torch.allclose(paper(x, 1), paper(x, 3))


def test_fedsga_with_the_residual_harmonizer_keeps_prototypes_in_the_pooled_space_and_trains(digits) -> None:
    """The strategy wires the form: G reads the pooled width, prototypes and phi_s live there, every depth head is
    one at the start, and a round runs with every device."""
    from _runs import tiny_config

    from fedsga_edge.config import FedSGAConfig
    from fedsga_edge.simulation import Simulation

    sim = Simulation(tiny_config("fedsga", rounds=1, width=0.125),  # the residual form is the default
                     digits)
    strat = sim.coordinator.strategy
    width = sim.model.feature_dim
    assert strat.head.G.in_features == width and strat.proto_dim == width
    assert strat.prototypes.protos.shape[1] == width and strat.phi_s.net[-1].out_features == width
    feats = torch.randn(4, width)
    heads = strat.eval_logits(sim.model, feats)
    assert len(heads) == strat.K and all(torch.equal(heads[1], v) for v in heads.values())
    rec = next(sim.rounds())
    assert rec["failures"] == {} and len(rec["splits"]) == sim.cfg.clients
    paper = Simulation(tiny_config("fedsga", rounds=1, width=0.125, fedsga=FedSGAConfig(harmonizer_form="mlp")),
                       digits).coordinator.strategy  # the paper's form: its own 128-d space
    assert paper.proto_dim == FedSGAConfig().proto_dim != width and paper.head.G.in_features == paper.proto_dim
