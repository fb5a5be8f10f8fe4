import math

import numpy as np
import pytest

from fedsga_edge.method import descriptor, prompt_contributions
from fedsga_edge.method.adaptation import descriptor_weights, weight_entropy


def test_contributions_hand_computed():
    grad = np.array([[1.0, 2.0], [0.0, -3.0]])
    prompts = np.array([[3.0, -1.0], [2.0, 1.0]])
    # |1*3 + 2*(-1)| = 1, |0*2 + (-3)*1| = 3
    np.testing.assert_array_equal(prompt_contributions(grad, prompts), [1.0, 3.0])


def test_torch_tensors_are_accepted_as_they_are():
    torch = pytest.importorskip("torch")
    p = torch.eye(2, requires_grad=True)
    np.testing.assert_allclose(descriptor(p, torch.tensor([1.0, 3.0])), descriptor(np.eye(2), [1.0, 3.0]))


def test_descriptor_hand_computed():
    # c / mean(c) = [0.5, 1.5] -> / tau_m = 0.5 -> [1, 3] -> softmax [1, e^2] / (1 + e^2)
    e2 = math.exp(2.0)
    m = descriptor(np.eye(2), np.array([1.0, 3.0]), tau_m=0.5)
    np.testing.assert_allclose(m, [1 / (1 + e2), e2 / (1 + e2)], rtol=1e-6)


def test_tiny_contributions_still_give_distinct_weights():
    # The paper's softmax(c / tau_m) of c ~ 1e-6 is uniform to 3 decimals (entropy ~ log 4).
    c = np.array([1.0, 2.0, 3.0, 4.0]) * 1e-6
    alpha = descriptor_weights(c, tau_m=0.5)
    assert weight_entropy(alpha) < 0.9 * math.log(4)
    np.testing.assert_array_equal(np.argsort(alpha), np.arange(4))  # ordering of c preserved
    assert alpha.sum() == pytest.approx(1.0)
    # only the relative contributions matter: the gradient's overall scale drops out
    np.testing.assert_allclose(alpha, descriptor_weights(c * 1e6, tau_m=0.5), atol=1e-12)
    np.testing.assert_allclose(descriptor(np.eye(4), c), alpha, rtol=1e-6)  # descriptor uses these weights


def test_equal_or_zero_contributions_give_uniform_weights():
    for c in (np.full(4, 3e-6), np.zeros(4)):
        alpha = descriptor_weights(c, tau_m=0.5)
        np.testing.assert_allclose(alpha, np.full(4, 0.25))
        assert weight_entropy(alpha) == pytest.approx(math.log(4))
    assert weight_entropy(np.array([0.0, 1.0, 0.0])) == 0.0


def test_temperature_sharpens_and_bad_inputs_are_rejected():
    c = np.array([1.0, 2.0, 3.0, 4.0])
    assert weight_entropy(descriptor_weights(c, 0.1)) < weight_entropy(descriptor_weights(c, 0.5))
    with pytest.raises(ValueError, match="tau_m"):
        descriptor_weights(c, 0.0)
    with pytest.raises(ValueError, match="non-negative"):
        descriptor_weights(-c, 0.5)
    with pytest.raises(ValueError, match="finite"):
        descriptor_weights(np.array([1.0, np.nan]), 0.5)
    with pytest.raises(ValueError, match="contributions"):
        descriptor(np.eye(4), c[:3])
