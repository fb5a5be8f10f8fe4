"""Model specifics: prompts, pretrained weights, costs (what every backbone promises: tests/test_backbones.py)."""

from __future__ import annotations

import pytest
import torch

from fedsga_edge.models import CostTable, create_model, load_weights, model_entry, prefix_cost

def _small(name: str):
    return create_model(name, **model_entry(name).small)


@pytest.mark.parametrize("name", ["resnet18_cifar", "vit_tiny_c32"])
def test_prompts_change_the_output_and_none_means_no_prompts(name: str) -> None:
    torch.manual_seed(0)
    model = _small(name).eval()
    x = torch.randn(2, 3, model.input_size, model.input_size)
    with torch.no_grad():
        base = model(x)
        assert torch.equal(model(x, torch.zeros(0, model.prompt_dim)), base)
        assert not torch.allclose(model(x, model.init_prompts(4)), base)


def _prompt_grad_cosines(std: float) -> torch.Tensor:
    torch.manual_seed(0)
    model = create_model("resnet18_cifar", width=0.25, num_classes=10).train()
    prompts = (std * torch.randn(4, model.prompt_dim)).requires_grad_(True)
    x = torch.randn(8, 3, 32, 32)
    y = torch.randint(0, 10, (8,))
    torch.nn.functional.cross_entropy(model(x, prompts), y).backward()
    g = torch.nn.functional.normalize(prompts.grad, dim=1)
    cos = g @ g.t()
    return cos[~torch.eye(4, dtype=torch.bool)]


def test_cnn_prompt_tokens_get_distinct_gradients() -> None:
    # With std-1 prompts (our init) each token has its own gradient direction (Eq. 2 needs it).
    assert _prompt_grad_cosines(1.0).abs().max() < 0.99
    # The measured failure mode that motivated the init: tiny prompts get parallel gradients.
    assert _prompt_grad_cosines(0.02).abs().min() > 0.995


def test_vit_prompt_tokens_get_distinct_gradients() -> None:
    torch.manual_seed(0)
    model = create_model("vit_tiny_c32", num_classes=10).train()
    prompts = model.init_prompts(4).requires_grad_(True)
    x = torch.randn(4, 3, 32, 32)
    torch.nn.functional.cross_entropy(model(x, prompts), torch.tensor([0, 1, 2, 3])).backward()
    g = torch.nn.functional.normalize(prompts.grad, dim=1)
    off = (g @ g.t())[~torch.eye(4, dtype=torch.bool)]
    assert off.abs().max() < 0.99


def test_split_index_out_of_range_is_a_clear_error() -> None:
    model = create_model("resnet18_cifar", width=0.25)
    with pytest.raises(ValueError, match="split index 4 out of range 1..3"):
        model.depth_of(4)


def test_unknown_model_names_the_choices() -> None:
    with pytest.raises(ValueError, match="resnet18_cifar"):
        create_model("resnet50")


def test_pretrained_torchvision_weights_are_mapped(tmp_path) -> None:
    import torchvision

    tv = torchvision.models.resnet18(num_classes=10)
    path = tmp_path / "tv.pth"
    torch.save(tv.state_dict(), path)
    model = create_model("resnet18", num_classes=10, pretrained=path)
    assert torch.equal(model.blocks[0].conv1.weight, tv.conv1.weight)
    assert torch.equal(model.blocks[3].layer[1].bn2.running_var, tv.layer3[1].bn2.running_var)
    assert torch.equal(model.head.weight, tv.fc.weight)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert torch.allclose(model.eval()(x), tv.eval()(x), atol=1e-5)


def test_pretrained_timm_weights_are_mapped(tmp_path) -> None:
    from timm.models.vision_transformer import VisionTransformer

    vit = VisionTransformer(img_size=32, patch_size=4, embed_dim=192, depth=12, num_heads=3, num_classes=10).eval()
    path = tmp_path / "vit.pth"
    torch.save(vit.state_dict(), path)
    model = create_model("vit_tiny_c32", pretrained=path).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(model(x), vit(x), atol=1e-5)


def test_missing_or_mismatched_weights_fail_clearly(tmp_path) -> None:
    model = create_model("resnet18_cifar", width=0.25)
    with pytest.raises(FileNotFoundError, match="local file"):
        load_weights(model, tmp_path / "nope.pth")
    torch.save({"something": torch.zeros(3)}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match="no tensor that fits"):
        load_weights(model, tmp_path / "bad.pth")


def test_costs_grow_with_depth_and_train_exceeds_forward() -> None:
    model = create_model("resnet18_cifar", width=0.25)
    costs = CostTable(model)
    trains = [costs.train(k) for k in (1, 2, 3)]
    assert trains == sorted(trains) and len(set(trains)) == 3
    assert costs.train(0) > trains[-1]  # the whole model (FedAvg)
    for k in (1, 2, 3):
        assert costs.prefix[k].flops_train > costs.prefix[k].flops_forward > 0
        assert costs.suffix_fwd(k) + costs.prefix_fwd(k) == costs.full_fwd
    # First conv of the CIFAR stem, counted by hand once: 2 * 3*3*3 * 16 * 32*32 FLOPs per sample.
    stem_only = prefix_cost(model, 1).flops_forward
    assert stem_only >= 2 * 27 * 16 * 32 * 32



def test_a_model_with_4_channel_shortcuts_trains(tmp_path) -> None:
    """resnet18_cifar at width 0.0625 has 1x1 shortcuts with 4 input channels, whose weight gradient crashed
    torch's oneDNN kernel: `simulate --width 0.0625` died of a segfault (or an abort) in its first round, for
    whole-model (fedavg) and split (static, split 3) training alike. In fresh processes (a crash must not take
    the test worker with it, and the workaround turns oneDNN off for the whole process): both now finish, with
    the warning that says why convolutions are slower."""
    import subprocess
    import sys

    for extra in (["--strategy", "fedavg"], ["--strategy", "static", "--split", "3"]):
        cmd = [sys.executable, "-m", "fedsga_edge.cli.main", "simulate", "--dataset", "digits", "--clients", "2",
               "--rounds", "1", "--model", "resnet18_cifar", "--width", "0.0625", "--max-batches", "2", "--seed", "0",
               "--threads", "1", "--quiet", "--out", str(tmp_path / extra[1]), *extra]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0 and "final_acc=" in res.stdout, (extra, res.returncode, res.stderr[-2000:])
        assert "oneDNN is off for this process" in res.stderr
    wide = create_model("resnet18_cifar", width=0.125, num_classes=10)  # 8 channels and up: oneDNN stays on
    assert torch.backends.mkldnn.enabled and wide is not None
