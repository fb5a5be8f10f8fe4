import math

import torch

from fedsga_edge.method import descriptor, prompt_contributions


def test_contributions_hand_computed():
    grad = torch.tensor([[1.0, 2.0], [0.0, -3.0]])
    prompts = torch.tensor([[3.0, -1.0], [2.0, 1.0]])
    # |1*3 + 2*(-1)| = 1, |0*2 + (-3)*1| = 3
    assert torch.equal(prompt_contributions(grad, prompts), torch.tensor([1.0, 3.0]))


def test_descriptor_hand_computed_and_detached():
    prompts = torch.eye(2, requires_grad=True)
    c = torch.tensor([0.0, 0.5 * math.log(2.0)])  # c / 0.5 = [0, ln 2] -> softmax [1/3, 2/3]
    m = descriptor(prompts, c, tau_m=0.5)
    assert torch.allclose(m, torch.tensor([1 / 3, 2 / 3]))
    assert not m.requires_grad


def test_descriptor_tiny_contributions_uniform_unless_normalized():
    prompts = torch.eye(2)
    c = torch.tensor([1e-6, 2e-6])
    assert torch.allclose(descriptor(prompts, c), torch.tensor([0.5, 0.5]), atol=1e-5)
    # normalised: c / max = [0.5, 1] -> /0.5 = [1, 2] -> softmax [1, e] / (1 + e)
    e = math.e
    expected = torch.tensor([1 / (1 + e), e / (1 + e)])
    assert torch.allclose(descriptor(prompts, c, normalize=True), expected)
    assert torch.allclose(descriptor(prompts, torch.zeros(2), normalize=True), torch.tensor([0.5, 0.5]))
