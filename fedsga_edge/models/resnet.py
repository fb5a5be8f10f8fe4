"""ResNet-18 split at stage boundaries, with a width multiplier and the CNN prompt bias."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .base import SplitModel
from .prompts import PromptBias
from .registry import register_model

__all__ = ["ResNetSplit", "resnet18", "resnet18_cifar"]


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample: nn.Module | None = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + (x if self.downsample is None else self.downsample(x)))


def _stage(cin: int, cout: int, stride: int, n: int = 2) -> nn.Sequential:
    return nn.Sequential(BasicBlock(cin, cout, stride), *[BasicBlock(cout, cout, 1) for _ in range(n - 1)])


class Stem(nn.Module):
    """conv-bn-relu(-maxpool), then the client's prompt bias (docs/method.md "Adaptation channel", CNN case)."""

    def __init__(self, width: int, imagenet: bool) -> None:
        super().__init__()
        if imagenet:
            self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        else:
            self.conv1 = nn.Conv2d(3, width, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, 2, 1) if imagenet else nn.Identity()
        self.prompt = PromptBias()

    def forward(self, x: Tensor, prompts: Tensor | None = None) -> Tensor:
        return self.prompt(self.maxpool(F.relu(self.bn1(self.conv1(x)))), prompts)


class Stage(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.layer = _stage(cin, cout, stride)

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)


class ResNetSplit(SplitModel):
    """Blocks: [stem, layer1, layer2, layer3, layer4]; candidate splits after layer1, 2, 3."""

    family = "cnn"
    interface_pool_axes = (2, 3)  # global average over H, W
    # std 1: with std 0.02 every token got the same gradient direction (cosine 1.0000),
    # which makes Eq. 2's per-token contributions meaningless.
    prompt_std = 1.0

    def __init__(self, num_classes: int, width: float, imagenet_stem: bool, input_size: int) -> None:
        if width <= 0:
            raise ValueError(f"width must be > 0, got {width}")
        ch = [max(4, int(round(c * width))) for c in (64, 128, 256, 512)]
        blocks: list[nn.Module] = [
            Stem(ch[0], imagenet_stem),
            Stage(ch[0], ch[0], 1),
            Stage(ch[0], ch[1], 2),
            Stage(ch[1], ch[2], 2),
            Stage(ch[2], ch[3], 2),
        ]
        super().__init__(blocks, nn.Linear(ch[3], num_classes), (2, 3, 4), ch[3], ch[0], input_size)
        self.width = width
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def pool(self, h: Tensor) -> Tensor:
        return h.mean(dim=(2, 3))

    @staticmethod
    def remap_upstream(state: dict[str, Tensor]) -> dict[str, Tensor]:
        """torchvision resnet18 keys -> ours (``layer2.0.conv1`` -> ``blocks.2.layer.0.conv1``)."""
        out: dict[str, Tensor] = {}
        for key, value in state.items():
            head, _, rest = key.partition(".")
            if head in ("conv1", "bn1"):
                out[f"blocks.0.{key}"] = value
            elif head.startswith("layer") and head[5:].isdigit():
                out[f"blocks.{int(head[5:])}.layer.{rest}"] = value
            elif head == "fc":
                out[f"head.{rest}"] = value
        return out


@register_model(small={"width": 0.25, "num_classes": 10, "img_size": 64})
def resnet18(num_classes: int = 1000, width: float = 1.0, img_size: int = 224) -> ResNetSplit:
    """ResNet-18 with the ImageNet stem (7x7/2 conv + max-pool), 224 px."""
    return ResNetSplit(num_classes, width, imagenet_stem=True, input_size=img_size)


@register_model(small={"width": 0.25, "num_classes": 10})
def resnet18_cifar(num_classes: int = 10, width: float = 1.0, img_size: int = 32) -> ResNetSplit:
    """ResNet-18 with a 3x3 stride-1 stem and no max-pool, for 32 px images."""
    return ResNetSplit(num_classes, width, imagenet_stem=False, input_size=img_size)
