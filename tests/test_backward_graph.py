"""`--train` graphs: gradients vs torch autograd, and a numpy-only SGD step vs torch's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _export_artifacts import train_artifacts
from fedsga_edge.device.runtime import PrefixRunner
from fedsga_edge.export.backward import convolution_backward
from fedsga_edge.export.manifest import read_manifest
from fedsga_edge.export.onnx_prefix import PrefixModule, ort_session

from fedsga_edge.models import create_model

K = 2  # the exported split: stem + layer1 + layer2 (stride-2 and 1x1 downsampling convs, BatchNorm)


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "padding", "dilation"),
    [(8, 3, 1, 1, 1), (9, 3, 2, 1, 1), (8, 1, 2, 0, 1), (11, 7, 2, 3, 1), (10, 3, 1, 2, 2), (32, 4, 4, 0, 1)],
)
def test_convolution_backward_decomposition_matches_autograd(size, kernel, stride, padding, dilation) -> None:
    g = torch.Generator().manual_seed(size * kernel + stride)
    x = torch.randn(3, 4, size, size + 1, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 4, kernel, kernel, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    y = F.conv2d(x, w, b, stride, padding, dilation)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    y.backward(dy)
    s, p, d = [stride] * 2, [padding] * 2, [dilation] * 2
    gi, gw, gb = convolution_backward(dy, x.detach(), w.detach(), [5], s, p, d, False, [0, 0], 1, [True, True, True])
    torch.testing.assert_close(gi, x.grad)
    torch.testing.assert_close(gw, w.grad)
    torch.testing.assert_close(gb, b.grad)


def _torch_prefix(state: dict[str, np.ndarray]) -> PrefixModule:
    model = create_model("resnet18_cifar", width=0.25)
    prefix = PrefixModule(model, model.depth_of(K)).train()
    prefix.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})
    return prefix


@pytest.fixture(scope="module")
def art():
    return train_artifacts()


@pytest.mark.parametrize("batch", [3, 5])
def test_gradients_match_autograd_at_other_batch_with_updated_weights(art, batch) -> None:
    entry = read_manifest(art, verify=True)["prefixes"][0]
    t = entry["train"]
    with np.load(art / t["state_file"]) as npz:
        state = {k: npz[k].copy() for k in npz.files}
    gen = np.random.default_rng(batch)
    for name in t["params"]:  # weights other than the exported ones: they are graph inputs
        state[name] = (state[name] + 0.1 * gen.standard_normal(state[name].shape)).astype(np.float32)
    for name in t["buffers"]:
        state[name] = (state[name] + np.abs(gen.standard_normal(state[name].shape))).astype(np.float32)
    prefix = _torch_prefix(state)
    x = gen.standard_normal((batch, 3, 32, 32), dtype=np.float32)
    prompts = gen.standard_normal((4, 16), dtype=np.float32)
    dz = gen.standard_normal((batch, *entry["activation"]["shape"]), dtype=np.float32)
    p = torch.from_numpy(prompts).requires_grad_(True)
    z = prefix(torch.from_numpy(x), p)
    (z * torch.from_numpy(dz)).sum().backward()

    fwd = ort_session(art / t["forward_file"])
    feeds = {"x": x, "prompts": prompts, "dz": dz, **state}
    got = fwd.run(None, {i.name: feeds[i.name] for i in fwd.get_inputs()})
    np.testing.assert_allclose(got[0], z.detach().numpy(), rtol=1e-4, atol=1e-4)
    new = prefix.state_dict()
    assert len(got) - 1 == len(t["buffers"]) > 0  # train-mode BN: updated running mean and var come out
    for value, name in zip(got[1:], t["buffers"]):
        np.testing.assert_allclose(value, new[name].numpy(), rtol=1e-5, atol=1e-6)

    bwd = ort_session(art / t["backward_file"])
    grads = dict(
        zip([o.name for o in bwd.get_outputs()], bwd.run(None, {i.name: feeds[i.name] for i in bwd.get_inputs()}))
    )
    assert list(grads) == t["backward_outputs"]
    named = dict(prefix.named_parameters())
    refs = {"grad.prompts": p.grad} | {f"grad.{n}": named[n].grad for n in t["params"]}
    for name, ref in refs.items():
        ref = ref.numpy()
        rel = np.abs(grads[name] - ref).max() / np.abs(ref).max()
        assert rel < 1e-5, (name, rel)  # the feasibility probe: ~3e-6


def _head_loss(z: np.ndarray, w: np.ndarray, y: np.ndarray) -> tuple[float, np.ndarray]:
    """Server stand-in in numpy: mean-pool, linear, cross-entropy; returns the loss and dL/dz."""
    pooled = z.mean(axis=(2, 3))
    logits = pooled @ w
    logits = logits - logits.max(1, keepdims=True)
    prob = np.exp(logits)
    prob /= prob.sum(1, keepdims=True)
    loss = float(-np.log(prob[np.arange(len(y)), y]).mean())
    g = prob.copy()
    g[np.arange(len(y)), y] -= 1
    dz = np.broadcast_to(((g / len(y)) @ w.T)[:, :, None, None] / (z.shape[2] * z.shape[3]), z.shape)
    return loss, np.ascontiguousarray(dz, dtype=np.float32)


def test_numpy_training_step_lowers_the_loss_and_matches_torch_sgd(art) -> None:
    runner = PrefixRunner(art, K)
    runner.set_optimizer(momentum=0.9, weight_decay=5e-4)
    prefix = _torch_prefix(runner.state_dict())
    opt = torch.optim.SGD(prefix.parameters(), lr=0.2, momentum=0.9, weight_decay=5e-4)
    gen = np.random.default_rng(0)
    x = gen.standard_normal((6, 3, 32, 32), dtype=np.float32)
    y = gen.integers(0, 10, 6)
    prompts = gen.standard_normal((4, 16), dtype=np.float32)
    w = 0.3 * gen.standard_normal((runner.activation_shape[0], 10)).astype(np.float32)
    w_t = torch.from_numpy(w)

    losses = []
    for _ in range(3):
        z = runner.train_forward(x, prompts)
        loss, dz = _head_loss(z, w, y)
        losses.append(loss)
        grads = runner.train_step(x, dz, prompts, lr=0.2)

        opt.zero_grad()
        p = torch.from_numpy(prompts).requires_grad_(True)
        logits = prefix(torch.from_numpy(x), p).mean(dim=(2, 3)) @ w_t
        ref_loss = F.cross_entropy(logits, torch.from_numpy(y))
        ref_loss.backward()
        opt.step()
        assert loss == pytest.approx(ref_loss.item(), rel=1e-4)
        np.testing.assert_allclose(grads["prompts"], p.grad.numpy(), rtol=1e-3, atol=1e-6)
        for name, value in prefix.state_dict().items():
            if name.endswith("num_batches_tracked"):
                assert runner.state[name] == value.item()
            else:
                np.testing.assert_allclose(runner.state[name], value.numpy(), rtol=1e-3, atol=1e-5, err_msg=name)
    final, _ = _head_loss(runner.train_forward(x, prompts, update_stats=False), w, y)
    assert losses[1] < losses[0] and losses[2] < losses[1] and final < losses[2], losses + [final]
