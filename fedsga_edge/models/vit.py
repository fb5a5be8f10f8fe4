"""Vision Transformers (timm) split after transformer blocks, with prompt tokens after CLS."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .base import SplitModel
from .prompts import insert_prompt_tokens
from .registry import register_model

__all__ = ["ViTSplit", "vit_b16", "vit_tiny_c32"]


class Embed(nn.Module):
    """Patch embedding, class token, position embedding, then the prompts after CLS.

    Standard ViT order (timm's default: class token, position embedding over it, no register
    tokens); the prompts get no position embedding, as in VPT.
    """

    def __init__(self, vit: nn.Module) -> None:
        super().__init__()
        self.patch_embed = vit.patch_embed
        self.cls_token = vit.cls_token
        self.pos_embed = vit.pos_embed
        self.norm_pre = vit.norm_pre

    def forward(self, x: Tensor, prompts: Tensor | None = None) -> Tensor:
        tokens = self.patch_embed(x)
        tokens = torch.cat([self.cls_token.expand(tokens.shape[0], -1, -1), tokens], dim=1) + self.pos_embed
        return self.norm_pre(insert_prompt_tokens(tokens, prompts, num_prefix=1))


class ViTBlock(nn.Module):
    """One transformer block; the last one also carries the final norm so it aggregates with it."""

    def __init__(self, block: nn.Module, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.block = block
        self.norm = norm if norm is not None else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.block(x))


class ViTSplit(SplitModel):
    """Blocks: [embed, block_1 .. block_D]; candidate splits after blocks D/4, D/2, 3D/4 (3, 6, 9 for D=12)."""

    family = "vit"
    # Mean over all tokens: at shallow depths the class token has gathered little yet.
    interface_pool_axes = (1,)
    prompts_as_tokens = True  # inserted after CLS, so the sequence grows by m
    int8_op_types = ("Conv", "MatMul", "Gemm")  # LayerNorm / Softmax stay float, as usual for int8 ViTs
    prompt_std = 0.02

    def __init__(self, vit: nn.Module, input_size: int) -> None:
        depth = len(vit.blocks)
        units: list[nn.Module] = [Embed(vit)]
        units += [ViTBlock(b, vit.norm if i == depth - 1 else None) for i, b in enumerate(vit.blocks)]
        splits = tuple(sorted({max(1, round(depth * f)) + 1 for f in (0.25, 0.5, 0.75)}))
        dim = vit.embed_dim
        super().__init__(units, nn.Linear(dim, vit.num_classes), splits, dim, dim, input_size)
        with torch.no_grad():
            self.head.weight.copy_(vit.head.weight)
            self.head.bias.copy_(vit.head.bias)

    def pool(self, h: Tensor) -> Tensor:
        return h[:, 0]  # class token (timm's "token" pooling, after the final norm)

    def set_fused_attention(self, enabled: bool) -> None:
        """timm's fused attention has no ONNX op and breaks joint-graph export: turn it off there."""
        for m in self.modules():
            if hasattr(m, "fused_attn"):
                m.fused_attn = enabled

    def remap_upstream(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """timm ViT keys -> ours (``blocks.3.attn`` -> ``blocks.4.block.attn``)."""
        last = self.num_blocks - 1
        out: dict[str, Tensor] = {}
        for key, value in state.items():
            head, _, rest = key.partition(".")
            if head in ("cls_token", "pos_embed", "patch_embed", "norm_pre"):
                out[f"blocks.0.{key}"] = value
            elif head == "blocks":
                i, _, tail = rest.partition(".")
                out[f"blocks.{int(i) + 1}.block.{tail}"] = value
            elif head == "norm":
                out[f"blocks.{last}.norm.{rest}"] = value
            elif head == "head":
                out[key] = value
        return out


def _timm_vit(**kwargs: object) -> nn.Module:
    from timm.models.vision_transformer import VisionTransformer

    return VisionTransformer(**kwargs)


@register_model(small={"num_classes": 10, "img_size": 32}, heavy=True)  # 2x2 patches at 32 px: same blocks
def vit_b16(num_classes: int = 1000, img_size: int = 224) -> ViTSplit:
    """timm's vit_base_patch16_224 (86M parameters)."""
    vit = _timm_vit(img_size=img_size, patch_size=16, embed_dim=768, depth=12, num_heads=12, num_classes=num_classes)
    return ViTSplit(vit, img_size)


@register_model(small={"num_classes": 10})
def vit_tiny_c32(num_classes: int = 10, img_size: int = 32) -> ViTSplit:
    """ViT-Tiny (dim 192, 12 blocks, 3 heads) on 32 px images with 4 px patches."""
    vit = _timm_vit(img_size=img_size, patch_size=4, embed_dim=192, depth=12, num_heads=3, num_classes=num_classes)
    return ViTSplit(vit, img_size)
