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
