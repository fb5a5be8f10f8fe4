"""`--train` graphs: gradients vs torch autograd, and a numpy-only SGD step vs torch's."""

from __future__ import annotations

import re
import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from _export_artifacts import train_artifacts
from fedsga_edge.device.runtime import PrefixRunner
from fedsga_edge.export.backward import (
    KINK_TOL,
    _autograd,
    _CheckInputs,
    _flips,
    _onnx_relu_inputs,
    convolution_backward,
)
from fedsga_edge.export.manifest import ManifestError, read_manifest
from fedsga_edge.export.onnx_prefix import PrefixModule, ort_session

from fedsga_edge.models import create_model

K = 2  # the exported split: stem + layer1 + layer2 (stride-2 and 1x1 downsampling convs, BatchNorm)


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "padding", "dilation"),
    [
        (8, 3, 1, 1, 1),
        (9, 3, 2, 1, 1),
        (8, 1, 2, 0, 1),
        (11, 7, 2, 3, 1),
        (10, 3, 1, 2, 2),
        (32, 4, 4, 0, 1),
        (8, 1, 1, 0, 1),  # 1x1, stride 1: a plain matmul
        (9, 5, 1, 0, 1),  # stride 1 without padding
        (12, 3, 1, 3, 1),  # padding beyond the kernel: transposed conv for dx
        (6, 3, 1, 1, 3),  # stride 1 on a small map: im2col rather than row taps on dy
    ],
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


@pytest.mark.parametrize(
    ("size", "kernel", "stride", "padding", "channels"),
    [(4, 1, 2, 0, 32), (8, 4, 4, 0, 32), (2, 3, 1, 1, 112), (5, 3, 2, 1, 48)],
)
def test_weight_gradient_arrangements_for_many_channels(size, kernel, stride, padding, channels) -> None:
    """Many channels on small maps take the other weight-gradient arrangements (batch in the
    reduction axis; im2col instead of row taps at stride 1): 1x1, patches, 3x3 / 1 and 3x3 / 2."""
    g = torch.Generator().manual_seed(size + channels)
    x = torch.randn(3, channels, size, size, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(channels + 1, channels, kernel, kernel, generator=g, dtype=torch.float64, requires_grad=True)
    y = F.conv2d(x, w, None, stride, padding)
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64)
    y.backward(dy)
    s, p = [stride] * 2, [padding] * 2
    mask = [True, True, False]
    gi, gw, _ = convolution_backward(dy, x.detach(), w.detach(), None, s, p, [1, 1], False, [0, 0], 1, mask)
    torch.testing.assert_close(gi, x.grad)
    torch.testing.assert_close(gw, w.grad)


def test_batchnorm_and_relu_decompositions_match_autograd() -> None:
    """The train-mode BatchNorm forward / backward and the ReLU backward the train graphs use."""
    from fedsga_edge.export.backward import batch_norm_backward, batch_norm_train, threshold_backward

    g = torch.Generator().manual_seed(7)
    x = (3 + 2 * torch.randn(4, 5, 6, 7, generator=g, dtype=torch.float64)).requires_grad_(True)
    w = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, generator=g, dtype=torch.float64, requires_grad=True)
    rm, rv = torch.randn(5, generator=g, dtype=torch.float64), torch.rand(5, generator=g, dtype=torch.float64)
    ref_rm, ref_rv = rm.clone(), rv.clone()
    y = F.batch_norm(x, ref_rm, ref_rv, w, b, training=True, momentum=0.1, eps=1e-5)
    out, mean, rstd, new_rm, new_rv = batch_norm_train(x.detach(), w.detach(), b.detach(), rm, rv, True, 0.1, 1e-5)
    torch.testing.assert_close(out, y.detach())
    torch.testing.assert_close((new_rm, new_rv), (ref_rm, ref_rv))
    h = F.relu(y)
    dh = torch.randn(h.shape, generator=g, dtype=torch.float64)
    h.backward(dh)
    dy = threshold_backward(dh, h.detach(), 0.0)
    torch.testing.assert_close(dy, torch.where(h.detach() <= 0, 0.0, dh))
    gx, gw, gb = batch_norm_backward(dy, x.detach(), w.detach(), rm, rv, mean, rstd, True, 1e-5, [True, True, True])
    torch.testing.assert_close((gx, gw, gb), (x.grad, w.grad, b.grad))


def test_backward_graph_recomputes_no_convolution(art) -> None:
    """The backward takes the forward's saved activations: its only convolutions are the
    input gradients (every conv but the stem's), its ReLUs one per forward ReLU (the masks)."""
    import onnx

    t = {p["split"]: p for p in read_manifest(art)["prefixes"]}[K]["train"]
    fwd, bwd = (onnx.load(str(art / t[k])).graph for k in ("forward_file", "backward_file"))

    def count(graph, *ops: str) -> int:
        return sum(n.op_type in ops for n in graph.node)

    assert count(fwd, "Conv") == 10  # stem, layer1 (4), layer2 (4 + the 1x1 downsample)
    assert count(bwd, "Conv", "ConvTranspose") == 9
    assert count(bwd, "Relu") == count(fwd, "Relu") > 0
    assert t["saved"] and t["forward_outputs"][-len(t["saved"]) :] == t["saved"]
    assert set(t["saved"]) <= set(t["backward_inputs"]) == {i.name for i in bwd.input}


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
    entry = {p["split"]: p for p in read_manifest(art, verify=True)["prefixes"]}[K]
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
    names = [o.name for o in fwd.get_outputs()]
    got = dict(zip(names, fwd.run(None, {i.name: feeds[i.name] for i in fwd.get_inputs()})))
    np.testing.assert_allclose(got["z"], z.detach().numpy(), rtol=1e-4, atol=1e-4)
    new = prefix.state_dict()
    assert names[: len(t["forward_outputs"])] == t["forward_outputs"]
    assert t["buffers"]  # train-mode BN: updated running mean and var come out
    for name in t["buffers"]:
        np.testing.assert_allclose(got[f"new.{name}"], new[name].numpy(), rtol=1e-5, atol=1e-6)

    feeds |= got  # a backward taking saved forward tensors (saved.N) gets them from this forward run
    bwd = ort_session(art / t["backward_file"])
    feeds |= {k: v for k, v in got.items() if k.startswith("saved.")}  # the forward's activations
    grads = dict(
        zip([o.name for o in bwd.get_outputs()], bwd.run(None, {i.name: feeds[i.name] for i in bwd.get_inputs()}))
    )
    assert list(grads) == t["backward_outputs"]
    # Against float64 autograd on the graph's own ReLU masks, as check_train_graphs judges: a pre-activation
    # within float32 rounding of the kink lands on either side in onnxruntime and torch float32, and switches
    # its unit's whole gradient path (batch 5 here once: 1 of 573440 masks, 6e-8 of its layer's max from the
    # kink, moved grad.prompts by 1.9e-3 against torch float32; 1.4e-6 against this reference).
    inp = _CheckInputs(prefix, torch.from_numpy(x), p.detach(), torch.from_numpy(dz), state)
    pre = _onnx_relu_inputs(art / t["backward_file"], feeds)
    flips, units, far = _flips(pre, _autograd(inp, t["params"], torch.float64).relu_inputs)
    assert units > 0 and far <= KINK_TOL, (flips, units, far)  # any disagreement is at the kink itself
    ref = _autograd(inp, t["params"], torch.float64, masks=[a > 0 for a in pre])
    for name, r in zip(t["backward_outputs"], ref.grads):
        rel = np.abs(grads[name] - r).max() / np.abs(r).max()
        assert rel < 1e-5, (name, rel)  # the feasibility probe's figure: ~3e-6


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


# --- check_train_graphs: float32 rounding at ReLU kinks vs a wrong graph ---------------------------------


def _checked_copy(art, tmp_path):
    """The split-K train files copied to tmp_path, with the model holding the export's weights."""
    import shutil

    from fedsga_edge.export.backward import TrainGraphs

    entry = {p["split"]: p for p in read_manifest(art)["prefixes"]}[K]
    t = entry["train"]
    for name in (t["forward_file"], t["backward_file"], t["state_file"]):
        shutil.copy(art / name, tmp_path / name)
    model = create_model("resnet18_cifar", width=0.25)
    with np.load(art / t["state_file"]) as npz:
        PrefixModule(model, entry["depth"]).load_state_dict({k: torch.from_numpy(npz[k].copy()) for k in npz.files})
    graphs = TrainGraphs(t["forward_file"], t["backward_file"], t["state_file"], t["params"], t["buffers"], 0.0)
    return model, entry["depth"], graphs


def _edit_backward(path, edit) -> None:
    """Loads the backward graph at ``path``, lets ``edit(graph)`` change it, checks and saves it."""
    import onnx

    proto = onnx.load(str(path))
    edit(proto.graph)
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))


def _check(model, depth, tmp_path, graphs):
    from fedsga_edge.export.backward import check_train_graphs

    checks, worst = check_train_graphs(model, depth, tmp_path, graphs, prompts_m=4)
    return checks, worst, "\n".join(c.line() for c in checks)


def test_check_fails_a_gradient_of_the_wrong_sign_and_says_wrong_graph(art, tmp_path) -> None:
    import onnx

    model, depth, graphs = _checked_copy(art, tmp_path)
    checks, worst, text = _check(model, depth, tmp_path, graphs)
    assert all(c.ok for c in checks) and worst < 1e-4, text  # the copy itself is right

    target = f"grad.{graphs.params[len(graphs.params) // 2]}"  # a mid-prefix conv/BN gradient, negated

    def negate(graph) -> None:
        (node,) = [n for n in graph.node if target in n.output]
        node.output[list(node.output).index(target)] = f"{target}.unsigned"
        graph.node.append(onnx.helper.make_node("Neg", [f"{target}.unsigned"], [target]))

    _edit_backward(tmp_path / graphs.backward_file, negate)
    checks, worst, text = _check(model, depth, tmp_path, graphs)
    assert checks[0].ok and checks[1].ok, text  # the forward graph is untouched
    assert not checks[-1].ok and "a wrong gradient graph" in checks[-1].detail, text
    assert "vs float64" in checks[-2].text and worst > 0.5, text


def _relu_units(model, depth, graphs, j: int, lo: float, hi: float, n: int = 3):
    """``n`` units of the j-th ReLU whose float64 pre-activation (on the check's own inputs) sits between
    ``lo`` and ``hi`` of the layer's max |pre-activation| from the kink, one per sample; and those values."""
    from fedsga_edge.export.backward import _autograd, _check_inputs

    inp = _check_inputs(model, depth, prompts_m=4, batch=3)
    pre = _autograd(inp, graphs.params, torch.float64).relu_inputs[j]
    scale = np.abs(pre).max()
    delta = np.zeros(pre.shape, np.float32)
    for s in range(n):
        a = np.abs(pre[s % pre.shape[0]]) / scale
        idx = np.unravel_index(np.argmin(np.where((a > lo) & (a < hi), a, np.inf)), a.shape)
        assert lo < a[idx] < hi, (lo, hi)
        delta[(s % pre.shape[0], *idx)] = -2 * pre[(s % pre.shape[0], *idx)]
    return delta


def _shift_relu_input(j: int, delta: np.ndarray):
    """Graph edit: the j-th Relu reads its input + ``delta`` (a constant; the check runs at batch 3)."""
    import onnx
    from onnx import numpy_helper

    def edit(graph) -> None:
        relu = [n for n in graph.node if n.op_type == "Relu"][j]
        graph.initializer.append(numpy_helper.from_array(delta, "test.delta"))
        graph.node.insert(
            list(graph.node).index(relu), onnx.helper.make_node("Add", [relu.input[0], "test.delta"], ["test.shifted"])
        )
        relu.input[0] = "test.shifted"

    return edit


def test_check_accepts_relu_masks_flipped_at_rounding_level_and_says_kinks(art, tmp_path) -> None:
    """Three ReLU units ~1e-5 (of the layer's max) from the kink pushed to its other side in the backward
    graph: what float32 rounding does at width 1.0 (docs in check_train_graphs), made deterministic."""
    model, depth, graphs = _checked_copy(art, tmp_path)
    j = 3  # layer1's second block: 16 x 32 x 32 units per sample at width 0.25
    delta = _relu_units(model, depth, graphs, j, 3e-6, 3e-5)
    _edit_backward(tmp_path / graphs.backward_file, _shift_relu_input(j, delta))
    checks, worst, text = _check(model, depth, tmp_path, graphs)
    assert "vs torch float32 autograd (> 1e-04)" in checks[-2].text, text  # the flips did break the plain check
    assert all(c.ok for c in checks), text
    assert checks[-1].text.startswith("ReLU kinks, not a wrong graph: "), text
    assert worst < 1e-4, text  # against float64 autograd on the graph's own masks


def test_check_fails_relu_masks_flipped_far_from_the_kink(art, tmp_path) -> None:
    """The same edit 0.05-0.2 of the layer's max away from the kink: a wrong forward, not rounding."""
    model, depth, graphs = _checked_copy(art, tmp_path)
    j = 3
    delta = _relu_units(model, depth, graphs, j, 0.05, 0.2)
    _edit_backward(tmp_path / graphs.backward_file, _shift_relu_input(j, delta))
    checks, _, text = _check(model, depth, tmp_path, graphs)
    assert not checks[-1].ok and checks[-1].detail.startswith("no, "), text


@pytest.mark.slow
@pytest.mark.full("one more export_train_graphs call (65-123 s on the shared 2 cores); the wrong-sign and far-flip "
                  "tests cover a wrong graph in the default run")
def test_check_fails_batchnorm_exported_as_inference(tmp_path, monkeypatch) -> None:
    """Without torch's train-mode BatchNorm decomposition the exporter writes inference BatchNormalization."""
    from fedsga_edge.export import backward

    conv = torch.ops.aten.convolution_backward.default
    conv_only = {k: v for k, v in backward._decompositions().items() if k is conv}
    monkeypatch.setattr(backward, "_decompositions", lambda: conv_only)
    torch.manual_seed(0)
    model = create_model("resnet18_cifar", width=0.25).eval()
    depth = model.depth_of(1)
    graphs = backward.export_train_graphs(model, depth, tmp_path, "bad", prompts_m=4, opset=18)
    checks, _, text = _check(model, depth, tmp_path, graphs)
    grads = [c for c in checks if "gradients" in c.text]
    assert grads and not any(c.ok for c in grads), text
    assert "a wrong gradient graph" in grads[-1].detail, text


@pytest.mark.slow
@pytest.mark.full("a train export at width 1.0 (94-120 s in the suite); the default run validates the same graphs "
                  "at width 0.25 (the shared train export)")
def test_train_export_validates_at_paper_width(tmp_path) -> None:
    """Width 1.0, split 2 (depth 3), one of the two splits where float32 rounding at a ReLU kink once
    failed the check (splits 2 and 3; whether a mask flips depends on the graph's exact
    arithmetic): the export validates either way. Split 2 rather than 3 to keep the suite short."""
    from fedsga_edge.export.pipeline import ExportConfig, export_prefixes

    lines: list[str] = []
    cfg = ExportConfig(model="resnet18_cifar", width=1.0, out=tmp_path, splits=(2,), train=True)
    (entry,) = export_prefixes(cfg, log=lines.append)["prefixes"]
    log = "\n".join(lines)
    assert entry["valid"], log
    checks = entry["train"]["checks"]
    assert all(c["ok"] for c in checks) and entry["train"]["max_rel_grad_err"] < 1e-4, log
    assert any("match autograd" in c["text"] or c["text"].startswith("ReLU kinks") for c in checks), log
    assert "Validating train graphs" in log


def test_verify_rehashes_every_train_graph_including_the_eval_one(art, tmp_path) -> None:
    """A device checks its artifacts before loading them: a changed byte in any listed file, the
    eval-mode observation graph included, must fail verification and name the file."""
    copy = tmp_path / "art"
    shutil.copytree(art, copy)
    read_manifest(copy, verify=True)  # as exported: passes
    entry = read_manifest(copy)["prefixes"][0]["train"]
    for key in ("forward_file", "backward_file", "state_file", "eval_file"):
        path = copy / entry[key]
        original = path.read_bytes()
        path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        with pytest.raises(ManifestError, match=re.escape(entry[key])):
            read_manifest(copy, verify=True)
        path.write_bytes(original)
