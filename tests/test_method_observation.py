import math

import torch

from fedsga_edge.method import (
    Observation,
    ShallowHead,
    alignment,
    alignment_loss,
    drift,
    phi_s_loss,
    prompt_variation,
)


def test_alignment_hand_computed():
    out = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    protos = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    labels = torch.tensor([0, 1])
    assert math.isclose(alignment(out, protos, labels), (1 + 1 / math.sqrt(2)) / 2, rel_tol=1e-6)


def test_alignment_uninitialised_prototypes():
    out = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    labels = torch.tensor([0, 1])
    assert alignment(out, torch.zeros(2, 2), labels) == 0.0
    # only the sample whose class prototype exists counts
    partial = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    assert math.isclose(alignment(out, partial, labels), 1.0, rel_tol=1e-6)


def test_drift_and_prompt_variation():
    assert drift(torch.tensor([3.0, 4.0]), torch.zeros(2)) == 5.0
    assert drift(torch.tensor([3.0, 4.0]), None) == 0.0
    # q: the prompts' movement under one set of weights (tests/test_method_q.py has the properties)
    assert math.isclose(prompt_variation(torch.ones(2, 4), torch.zeros(2, 4), torch.tensor([0.5, 0.5])), 2.0)
    assert prompt_variation(torch.ones(2, 4), None, torch.tensor([0.5, 0.5])) == 0.0


def test_observation_values():
    o = Observation(a=0.5, delta=2.0, q=0.25)
    assert o.values() == [0.5, 2.0, 0.25]
    assert o.values(adapt=False) == [0.5, 2.0]
    assert o.as_array().dtype.name == "float32" and o.as_array().tolist() == [0.5, 2.0, 0.25]


def test_alignment_rejects_labels_outside_the_prototypes():
    import pytest

    with pytest.raises(ValueError, match="labels"):
        alignment(torch.ones(2, 2), torch.ones(2, 2), torch.tensor([0, 2]))


def test_shallow_head_and_loss():
    torch.manual_seed(0)
    head = ShallowHead(in_dim=6, proto_dim=4)
    out = head(torch.randn(5, 6))
    assert out.shape == (5, 4)
    protos, labels = torch.randn(3, 4), torch.tensor([0, 1, 2, 0, 1])
    loss = phi_s_loss(out, labels, protos, tau_a=0.5)
    assert torch.equal(loss, alignment_loss(out, labels, protos, 0.5))
    loss.backward()
    grad = head.net[0].weight.grad  # the loss reaches phi_s's first layer with a usable gradient
    assert grad is not None and bool(torch.isfinite(grad).all()) and grad.abs().sum().item() > 0
