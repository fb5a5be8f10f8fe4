"""The server's work in a round: its optimizer steps and their FLOPs, counted where the server steps.

Methods differ in how much the server trains per round (MU-SplitFed's tau steps per activation, MultiSFL's
branches and replay, MergeSFL's one step per merged batch, FedSGA's phi_s, FedGH's head on the class
means), so a comparison of methods needs that work beside the clients'. Nothing here is a
formula per method: every place that takes a server optimizer step calls ``ServerWork.add`` once per step
(coordinator/server_side.py for the server blocks, the strategies' own server hooks for what they train).

FLOPs are forward + backward of the pass that led to the step, counted by torch's FLOP counter
(fedsga_edge/models/cost.py ``count_flops``) once per kind of pass (``key``: the split an activation
enters at, phi_s, the head) on deep copies of the trained modules, so the live copy's weights, BatchNorm
statistics and gradients never see the counter; later passes of the same kind are that per-row count
times their rows. A refused step (non-finite) is not counted: it changed nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Hashable
from contextlib import ExitStack
from typing import Any

from torch import Tensor, nn

from fedsga_edge.models.cost import count_flops, unfused_attention

__all__ = ["ServerWork", "pass_flops", "step_flops"]


class ServerWork:
    """One run's server steps and FLOPs; ``begin_round`` starts a round's counts, ``record`` reports them."""

    def __init__(self) -> None:
        self.steps = 0  # optimizer steps this round
        self.flops = 0  # FLOPs of their passes this round
        self._per_row: dict[Hashable, float] = {}  # key -> FLOPs per row, counted once per run

    def begin_round(self) -> None:
        self.steps, self.flops = 0, 0

    def add(self, key: Hashable, rows: int, measure: Callable[[], float], steps: int = 1) -> None:
        """``steps`` optimizer steps after a pass of ``rows`` rows of kind ``key``; ``measure()`` gives that
        kind's FLOPs per row, called the first time the kind is seen (``pass_flops``)."""
        per_row = self._per_row.get(key)
        if per_row is None:
            per_row = self._per_row[key] = float(measure())
        self.steps += steps
        self.flops += round(per_row * rows)

    def record(self, forward_flops: int = 0) -> dict[str, int]:
        """The round's fields of metrics.jsonl; ``forward_flops``: the server's passes that step nothing
        (FedSGA's calibration probes, the server part of its ``calibration_flops``)."""
        return {"server_steps": int(self.steps), "server_flops": int(self.flops + forward_flops)}


def pass_flops(modules: tuple[nn.Module, ...], loss_of: Callable[..., Tensor], rows: int) -> float:
    """FLOPs per row of ``loss_of(*copies)`` and its backward, on deep copies of ``modules`` (attention
    unfused so that the counter sees it: fedsga_edge/models/cost.py); ``rows``: the rows it runs over."""
    copies = [copy.deepcopy(m) for m in modules]
    with ExitStack() as stack:
        for m in copies:
            m.train()
            stack.enter_context(unfused_attention(m))
        return count_flops(lambda: loss_of(*copies).backward()) / max(rows, 1)


def step_flops(strategy: Any, model: nn.Module, head: nn.Module, z: Tensor, k: int) -> float:
    """FLOPs per row of one server step's forward and backward on activation rows shaped like ``z`` entering
    at split k, under the strategy's ``forward`` and ``loss``: the input gradient the device receives included."""
    from types import SimpleNamespace

    import torch

    def loss_of(m: nn.Module, h: nn.Module) -> Tensor:
        zz = torch.zeros_like(z.detach()).requires_grad_(True)
        logits, Z = strategy.forward(SimpleNamespace(model=m, head=h), zz, k)
        return strategy.loss(logits, Z, torch.zeros(len(zz), dtype=torch.long, device=zz.device))

    return pass_flops((model, head), loss_of, len(z))
