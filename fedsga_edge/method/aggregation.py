"""Depth-wise, data-weighted aggregation of the backbone (DESIGN §1.8).

Every block has one global copy. Its new value is the weighted average of the copies trained this
round: each client that ran the block locally (weight |D_i|) and the server's copy (weight = the
summed |D_i| of the clients whose data passed through the server's copy of that block). BatchNorm
running statistics are averaged the same way; integer counters (``num_batches_tracked``) take the
maximum, since averaging a count has no meaning.

``weighted_average`` is the plain reference; ``weighted_average_fast`` flattens all floating
tensors into one matrix and does one matrix-vector product. Tests check they agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

__all__ = ["weighted_average", "weighted_average_fast", "Contribution", "aggregate_blocks"]

State = Mapping[str, Tensor]


def _check(states: Sequence[State], weights: Sequence[float]) -> float:
    if len(states) != len(weights) or not states:
        raise ValueError(f"need one weight per state and at least one state, got {len(states)} and {len(weights)}")
    if any(w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"weights must be non-negative with a positive sum, got {list(weights)}")
    keys = set(states[0])
    for s in states[1:]:
        if set(s) != keys:
            raise ValueError(f"states disagree on keys: {sorted(keys ^ set(s))[:5]}")
    return float(sum(weights))


def weighted_average(states: Sequence[State], weights: Sequence[float]) -> dict[str, Tensor]:
    """Reference: key by key, sum_i w_i s_i / sum_i w_i."""
    total = _check(states, weights)
    out: dict[str, Tensor] = {}
    for key, ref in states[0].items():
        if ref.is_floating_point():
            acc = torch.zeros_like(ref, dtype=torch.float64)
            for s, w in zip(states, weights):
                acc += float(w) * s[key].to(torch.float64)
            out[key] = (acc / total).to(ref.dtype)
        else:
            out[key] = torch.stack([s[key] for s in states]).amax(dim=0)
    return out


def weighted_average_fast(states: Sequence[State], weights: Sequence[float]) -> dict[str, Tensor]:
    """Same result as :func:`weighted_average` with one (n x P) @ (n,) product for all floats."""
    total = _check(states, weights)
    ref = states[0]
    float_keys = [k for k, v in ref.items() if v.is_floating_point()]
    out: dict[str, Tensor] = {}
    if float_keys:
        mat = torch.stack([torch.cat([s[k].reshape(-1).to(torch.float64) for k in float_keys]) for s in states])
        w = torch.tensor([float(x) for x in weights], dtype=torch.float64, device=mat.device) / total
        flat = w @ mat
        offset = 0
        for k in float_keys:
            n = ref[k].numel()
            out[k] = flat[offset : offset + n].view_as(ref[k]).to(ref[k].dtype)
            offset += n
    for k, v in ref.items():
        if not v.is_floating_point():
            out[k] = torch.stack([s[k] for s in states]).amax(dim=0)
    return {k: out[k] for k in ref}


class Contribution:
    """One trained copy of some blocks: ``states[j]`` is block j's state, weighted by ``weight``."""

    __slots__ = ("states", "weight")

    def __init__(self, states: Mapping[int, State], weight: float) -> None:
        self.states = dict(states)
        self.weight = float(weight)


def aggregate_blocks(
    global_states: Mapping[int, State],
    contributions: Sequence[Contribution],
    fast: bool = True,
) -> dict[int, dict[str, Tensor]]:
    """New value of every block: the weighted mean of the copies that trained it; untouched blocks stay."""
    average = weighted_average_fast if fast else weighted_average
    out: dict[int, dict[str, Tensor]] = {}
    for j, old in global_states.items():
        parts = [(c.states[j], c.weight) for c in contributions if j in c.states and c.weight > 0]
        out[j] = average([p for p, _ in parts], [w for _, w in parts]) if parts else dict(old)
    return out
