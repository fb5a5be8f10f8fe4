"""Costs of a client prefix, counted by torch.utils.flop_counter (never by hand)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from .base import SplitModel

__all__ = ["PrefixCost", "CostTable", "count_flops", "unfused_attention", "prefix_cost"]


@contextmanager
def unfused_attention(model: torch.nn.Module) -> Iterator[None]:
    """timm's fused attention off: the FLOP counter sees 0 FLOPs in its CPU kernel, ONNX has no op for it."""
    fused = [(m, m.fused_attn) for m in model.modules() if hasattr(m, "fused_attn")]
    for m, _ in fused:
        m.fused_attn = False
    try:
        yield
    finally:
        for m, value in fused:
            m.fused_attn = value


def count_flops(fn, *args, **kwargs) -> int:  # noqa: ANN001 - any callable
    """FLOPs of everything ``fn`` runs (forward and any backward it triggers)."""
    with FlopCounterMode(display=False) as counter:
        fn(*args, **kwargs)
    return int(counter.get_total_flops())


@dataclass(frozen=True)
class PrefixCost:
    depth: int
    params: int
    flops_forward: int  # per sample
    flops_train: int  # per sample: forward + backward of the prefix given dL/dz (and prompt gradients)
    activation_shape: tuple[int, ...]  # per sample

    @property
    def activation_elems(self) -> int:
        n = 1
        for s in self.activation_shape:
            n *= s
        return n

    def to_dict(self) -> dict:
        return asdict(self) | {"activation_elems": self.activation_elems}


def prefix_cost(model: SplitModel, depth: int, prompts_m: int = 0, batch: int = 2) -> PrefixCost:
    """Per-sample FLOPs of the client part at ``depth`` (0 = nothing, num_blocks = whole backbone)."""
    ref = next(model.parameters())
    x = torch.randn(batch, 3, model.input_size, model.input_size, device=ref.device)
    prompts = torch.randn(prompts_m, model.prompt_dim, device=ref.device, requires_grad=True) if prompts_m else None
    was_training = model.training
    model.train()
    try:
        if depth == 0:
            return PrefixCost(0, 0, 0, 0, (3, model.input_size, model.input_size))
        with torch.no_grad(), unfused_attention(model):
            fwd = count_flops(model.prefix, x, depth, prompts)

        def step() -> None:
            z = model.prefix(x, depth, prompts)
            z.backward(torch.ones_like(z))

        with unfused_attention(model):
            train = count_flops(step)
        shape = model.interface_shape(depth, prompts_m)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return PrefixCost(depth, model.block_param_count(0, depth), fwd // batch, train // batch, shape)


class CostTable:
    """Per-sample FLOPs of every candidate split of one model, counted once and looked up after.

    ``train(k)``: client forward + backward at split index k (k = 0: the whole model and head,
    as in FedAvg); ``prefix_fwd(k)``: client forward only (calibration probes); ``suffix_fwd(k)``:
    the server's forward from split k to the logits (the full forward minus the prefix's).
    """

    def __init__(self, model: SplitModel, prompts_m: int = 0) -> None:
        self.prefix = {k: prefix_cost(model, model.depth_of(k), prompts_m) for k in range(1, model.num_splits + 1)}
        self.params = {k: c.params for k, c in self.prefix.items()}
        full = _full_cost(model, prompts_m)
        self.full_fwd, self.full_train = full
        self.params[0] = sum(p.numel() for p in model.parameters())

    def train(self, k: int) -> int:
        return self.full_train if k == 0 else self.prefix[k].flops_train

    def prefix_fwd(self, k: int) -> int:
        return self.full_fwd if k == 0 else self.prefix[k].flops_forward

    def suffix_fwd(self, k: int) -> int:
        return self.full_fwd - self.prefix_fwd(k)


def _full_cost(model: SplitModel, prompts_m: int, batch: int = 2) -> tuple[int, int]:
    ref = next(model.parameters())
    x = torch.randn(batch, 3, model.input_size, model.input_size, device=ref.device)
    prompts = torch.randn(prompts_m, model.prompt_dim, device=ref.device, requires_grad=True) if prompts_m else None
    was_training = model.training
    model.train()
    try:
        with torch.no_grad(), unfused_attention(model):
            fwd = count_flops(model, x, prompts)

        def step() -> None:
            model(x, prompts).sum().backward()

        with unfused_attention(model):
            train = count_flops(step)
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return fwd // batch, train // batch
