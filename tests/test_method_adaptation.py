import math

import pytest
import torch

from fedsga_edge.method import descriptor, prompt_contributions
from fedsga_edge.method.adaptation import descriptor_weights, weight_entropy


def test_contributions_hand_computed():
    grad = torch.tensor([[1.0, 2.0], [0.0, -3.0]])
    prompts = torch.tensor([[3.0, -1.0], [2.0, 1.0]])
    # |1*3 + 2*(-1)| = 1, |0*2 + (-3)*1| = 3
    assert torch.equal(prompt_contributions(grad, prompts), torch.tensor([1.0, 3.0]))


def test_descriptor_hand_computed_and_detached():
    prompts = torch.eye(2, requires_grad=True)
    # c / mean(c) = [0.5, 1.5] -> / tau_m = 0.5 -> [1, 3] -> softmax [1, e^2] / (1 + e^2)
    c = torch.tensor([1.0, 3.0])
    e2 = math.exp(2.0)
    m = descriptor(prompts, c, tau_m=0.5)
    assert torch.allclose(m, torch.tensor([1 / (1 + e2), e2 / (1 + e2)]))
    assert not m.requires_grad


def test_tiny_contributions_still_give_distinct_weights():
    # The paper's softmax(c / tau_m) of c ~ 1e-6 is uniform to 3 decimals (entropy ~ log 4).
    c = torch.tensor([1.0, 2.0, 3.0, 4.0]) * 1e-6
    alpha = descriptor_weights(c, tau_m=0.5)
    assert weight_entropy(alpha) < 0.9 * math.log(4)
    assert torch.equal(torch.argsort(alpha), torch.arange(4))  # ordering of c preserved
    assert alpha.sum().item() == pytest.approx(1.0)
    # only the relative contributions matter: the gradient's overall scale drops out
    assert torch.allclose(alpha, descriptor_weights(c * 1e6, tau_m=0.5), atol=1e-7)
    assert torch.allclose(descriptor(torch.eye(4), c), alpha)  # descriptor uses these weights


def test_equal_or_zero_contributions_give_uniform_weights():
    for c in (torch.full((4,), 3e-6), torch.zeros(4)):
        alpha = descriptor_weights(c, tau_m=0.5)
        assert torch.allclose(alpha, torch.full((4,), 0.25))
        assert weight_entropy(alpha) == pytest.approx(math.log(4))
    assert weight_entropy(torch.tensor([0.0, 1.0, 0.0])) == 0.0


def test_temperature_sharpens_and_bad_inputs_are_rejected():
    c = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert weight_entropy(descriptor_weights(c, 0.1)) < weight_entropy(descriptor_weights(c, 0.5))
    with pytest.raises(ValueError, match="tau_m"):
        descriptor_weights(c, 0.0)
    with pytest.raises(ValueError, match="non-negative"):
        descriptor_weights(-c, 0.5)
    with pytest.raises(ValueError, match="contributions"):
        descriptor(torch.eye(4), c[:3])
