"""Private prompt channels (docs/method.md "Adaptation channel", paper Eq. 2).

Prompts are an *input* of the client prefix, not parameters of the backbone: they stay on the
device, are never aggregated, and a single exported ONNX prefix serves every device.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["PromptBias", "insert_prompt_tokens"]


class PromptBias(nn.Module):
    """CNN prompts: m vectors of the stem's channel count, mixed per sample into a channel bias.

    weights = softmax_k(<pool(s), e_k>) per sample, bias = sum_k weights_k e_k, added to every
    spatial position. Each token gets its own gradient through its own attention weight.
    """

    scale = 0.1

    def forward(self, s: Tensor, prompts: Tensor | None) -> Tensor:
        if prompts is None or prompts.shape[0] == 0:
            return s
        attn = torch.softmax(s.mean(dim=(2, 3)) @ prompts.t(), dim=-1)  # (B, m)
        return s + self.scale * (attn @ prompts)[:, :, None, None]


def insert_prompt_tokens(tokens: Tensor, prompts: Tensor | None, num_prefix: int = 1) -> Tensor:
    """ViT prompts: ``[cls, e_1..e_m, x_1..x_n]`` (inserted after the class token)."""
    if prompts is None or prompts.shape[0] == 0:
        return tokens
    b = tokens.shape[0]
    return torch.cat([tokens[:, :num_prefix], prompts.unsqueeze(0).expand(b, -1, -1), tokens[:, num_prefix:]], dim=1)
