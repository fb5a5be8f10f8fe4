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


@pytest.mark.parametrize("prompt_lr", [0.05, 2.0])
def test_prompts_step_at_their_own_rate_and_the_blocks_at_lr(prompt_lr):
    """docs/method.md, "Adaptation channel": --prompt-lr moves the prompts, --lr the blocks."""
    torch = pytest.importorskip("torch")
    from fedsga_edge.config import TrainConfig
    from fedsga_edge.device.client import TorchBackend
    from fedsga_edge.device.role import ClientData
    from fedsga_edge.models import create_model

    def one_step(rate):
        torch.manual_seed(0)
        be = TorchBackend(lambda: create_model("resnet18_cifar", num_classes=10, img_size=32, width=0.25),
                          ClientData(None, np.arange(4), (0.0,) * 3, (1.0,) * 3), torch.Generator().manual_seed(0))
        prompts = be.init_prompts(4)
        blocks = {n: v.clone() for n, v in be.model.blocks[0].state_dict().items() if v.dtype.is_floating_point}
        cfg = TrainConfig(lr=0.1, weight_decay=0.0)
        be.train_begin(cfg, be.depth_of(1), False, prompts, prompt_lr=rate)
        z, _ = be.forward(torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1)), False)
        grad, before = be.backward(np.ones_like(z))
        after = be.train_end()
        moved = {n: (be.model.blocks[0].state_dict()[n] - v).abs().sum().item() for n, v in blocks.items()}
        return after - before, grad, moved

    step, grad, moved = one_step(prompt_lr)
    assert np.allclose(step, -prompt_lr * grad, rtol=1e-4, atol=1e-7) and np.abs(step).max() > 0
    _, _, moved_default = one_step(None)  # None: the prompts at --lr; the blocks' step is the same either way
    assert moved == pytest.approx(moved_default)
