"""Depth-wise, data-weighted aggregation of the backbone (docs/method.md "Aggregation").

Every block has one global copy. Its new value is the weighted average of the copies trained this
round: each client that ran the block locally (weight |D_i|) and the server's copy (weight = the
summed |D_i| of the clients whose data passed through the server's copy of that block). BatchNorm
running statistics are averaged the same way; integer counters (``num_batches_tracked``) take the
maximum, since averaging a count has no meaning.

``weighted_average`` is the plain reference; ``weighted_average_fast`` flattens all floating
tensors into one matrix and does one matrix-vector product. Tests check they agree.

``robust_average`` is the same average under a rule one device cannot steer (``--aggregation``,
docs/protocol.md "Robust aggregation"): a coordinate-wise weighted trimmed mean or median (Flower's
FedTrimmedAvg / FedMedian, weighted so that the server's copy still counts for the devices whose data
it trained), norm-bounded averaging (each copy's change scaled to at most the median change), or
multi-Krum (Blanchard et al. 2017, Flower's Krum: the copies closest to their nearest neighbours, the
farthest ``f`` left out whole, the rest averaged by weight).

``round_contributions`` / ``aggregate_round`` turn one round's device updates (plus the server's
copy) into that rule, so the coordinator's aggregation can be tested without a coordinator. Units:
blocks 0..L-1 are units 0..L-1 and the classifier head is unit L; which key belongs to which unit
is the model's answer (``SplitModel.unit_of``), passed to ``group_by_unit``: nothing here reads
parameter names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "RULES",
    "Contribution",
    "DeviceUpdate",
    "aggregate_blocks",
    "aggregate_round",
    "group_by_unit",
    "krum_keep",
    "robust_average",
    "round_contributions",
    "weighted_average",
    "weighted_average_fast",
]

State = Mapping[str, Tensor]
# fedsga_edge/config.py AGGREGATIONS: how the copies of one unit are combined
RULES = ("mean", "trimmed_mean", "median", "norm_bounded", "krum")


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


def robust_average(states: Sequence[State], weights: Sequence[float], rule: str = "mean", trim: float = 0.2,
                   ref: State | None = None) -> dict[str, Tensor]:
    """The copies combined under ``rule`` (``RULES``); integer counters take the maximum, as in the mean.

    ``trimmed_mean`` cuts ``trim`` of the total weight at each end of every coordinate's sorted values;
    ``median`` is every coordinate's weighted median (of two equal weights, their mean); ``norm_bounded``
    scales each copy's change from ``ref`` (required) down to the weighted median change first; ``krum``
    averages the copies multi-Krum keeps (``krum_keep``, ``trim`` of the copies assumed hostile).
    """
    if rule not in RULES:
        raise ValueError(f"aggregation rule {rule!r} is not one of {', '.join(RULES)}")
    if rule == "mean" or len(states) < 2:
        return weighted_average_fast(states, weights)
    if rule == "norm_bounded":
        if ref is None:
            raise ValueError("norm_bounded aggregation needs the reference state the changes are measured from")
        return weighted_average_fast(_norm_bounded(states, weights, ref), weights)
    if rule == "krum":
        kept = krum_keep(states, trim)
        return weighted_average_fast([states[i] for i in kept], [weights[i] for i in kept])
    _check(states, weights)
    ref0 = states[0]
    float_keys = [k for k, v in ref0.items() if v.is_floating_point()]
    out = weighted_average_fast(states, weights)  # the counters (and the layout)
    if not float_keys:
        return out
    mat = torch.stack([torch.cat([s[k].reshape(-1).to(torch.float64) for k in float_keys]) for s in states])
    w = torch.tensor([float(x) for x in weights], dtype=torch.float64, device=mat.device)
    flat = _trimmed(mat, w, trim) if rule == "trimmed_mean" else _median(mat, w)
    offset = 0
    for k in float_keys:
        n = ref0[k].numel()
        out[k] = flat[offset: offset + n].view_as(ref0[k]).to(ref0[k].dtype)
        offset += n
    return out


def krum_keep(states: Sequence[State], trim: float) -> list[int]:
    """Multi-Krum's choice: with f = round(``trim`` x n) copies assumed hostile (at least 1), each copy's score
    is the summed squared distance to its n - f - 2 nearest others (floating tensors, flattened); the n - f
    lowest scores are kept, in their order. Fewer than f + 3 copies give no neighbours to score by: all kept."""
    n = len(states)
    f = max(1, round(trim * n))
    if n < f + 3:
        return list(range(n))
    keys = [k for k, v in states[0].items() if v.is_floating_point()]
    mat = torch.stack([torch.cat([s[k].reshape(-1).to(torch.float64) for k in keys]) for s in states])
    dist = torch.cdist(mat, mat) ** 2
    dist.fill_diagonal_(float("inf"))
    scores = dist.sort(dim=1).values[:, : n - f - 2].sum(dim=1)
    return sorted(scores.argsort()[: n - f].tolist())


def _sorted(mat: Tensor, w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Each column's values sorted, their weights, and the cumulative weight at each one's upper end."""
    values, order = mat.sort(dim=0)
    weights = w[order]
    return values, weights, weights.cumsum(dim=0)


def _trimmed(mat: Tensor, w: Tensor, trim: float) -> Tensor:
    """Per column: the weighted mean of the values between the ``trim`` and ``1 - trim`` weight quantiles."""
    values, weights, upper = _sorted(mat, w)
    total = float(w.sum())
    lo, hi = trim * total, (1.0 - trim) * total
    kept = (upper.clamp(max=hi) - (upper - weights).clamp(min=lo)).clamp(min=0)
    return (kept * values).sum(dim=0) / kept.sum(dim=0).clamp_min(1e-300)


def _median(mat: Tensor, w: Tensor) -> Tensor:
    """Per column: the weighted median (the mean of the two middle values when the weight splits evenly)."""
    values, _, upper = _sorted(mat, w)
    half = float(w.sum()) / 2
    lo = (upper < half * (1 - 1e-12)).sum(dim=0, keepdim=True)  # first value whose cumulative weight reaches half
    hi = (upper <= half * (1 + 1e-12)).sum(dim=0, keepdim=True).clamp(max=len(w) - 1)  # first past it
    return (values.gather(0, lo) + values.gather(0, hi)).squeeze(0) / 2


def _norm_bounded(states: Sequence[State], weights: Sequence[float], ref: State) -> list[dict[str, Tensor]]:
    """Each state with its change from ``ref`` scaled down to the weighted median change (floats only)."""
    deltas = [{k: v.to(torch.float64) - ref[k].to(torch.float64) for k, v in s.items() if v.is_floating_point()}
              for s in states]
    norms = torch.tensor([float(torch.sqrt(sum((d ** 2).sum() for d in ds.values()))) if ds else 0.0
                          for ds in deltas], dtype=torch.float64)
    limit = float(_median(norms.view(-1, 1), torch.tensor([float(x) for x in weights], dtype=torch.float64)))
    out: list[dict[str, Tensor]] = []
    for s, ds, norm in zip(states, deltas, norms.tolist()):
        scale = limit / norm if norm > limit > 0 else 1.0
        out.append({k: (ref[k].to(torch.float64) + ds[k] * scale).to(v.dtype) if k in ds else v
                    for k, v in s.items()})
    return out


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
    rule: str = "mean",
    trim: float = 0.2,
) -> dict[int, dict[str, Tensor]]:
    """New value of every block: the copies that trained it combined under ``rule`` (``robust_average``;
    the weighted mean by default); untouched blocks stay."""
    out: dict[int, dict[str, Tensor]] = {}
    for j, old in global_states.items():
        parts = [(c.states[j], c.weight) for c in contributions if j in c.states and c.weight > 0]
        states, weights = [p for p, _ in parts], [w for _, w in parts]
        if not parts:
            out[j] = dict(old)
        elif rule == "mean":
            out[j] = (weighted_average_fast if fast else weighted_average)(states, weights)
        else:
            out[j] = robust_average(states, weights, rule, trim, old)
    return out


def group_by_unit(state: Mapping[str, Tensor], unit_of: Callable[[str], int]) -> dict[int, dict[str, Tensor]]:
    """A flat state dict grouped by unit (only the units that have keys); inverse of merging them.

    ``unit_of`` is the model's key -> unit map (``SplitModel.unit_of``; the ONNX device's manifest).
    """
    units: dict[int, dict[str, Tensor]] = {}
    for name, value in state.items():
        units.setdefault(unit_of(name), {})[name] = value
    return units


@dataclass(frozen=True)
class DeviceUpdate:
    """What aggregation needs from one device's round: who, how deep, how much data, which states.

    ``depth`` is the number of leading units the device ran locally: blocks 0..depth-1 on the
    device, blocks depth..L-1 and the head (unit L) on the server. A whole-model (FedAvg) device
    has depth L+1, or depth L with the head's complete state sent (what a full device reports on
    the wire): either way none of its data passes through the server's copy. ``num_samples`` is
    the device's aggregation weight |D_i|. ``states`` maps unit -> that unit's state.
    """

    device_id: str
    depth: int
    num_samples: float
    states: Mapping[int, State] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.depth < 0 or self.num_samples < 0:
            raise ValueError(
                f"device {self.device_id}: depth and num_samples must be >= 0, got {self.depth}, {self.num_samples}"
            )


def _complete(state: State, ref: State) -> bool:
    """A device's unit state counts only if it holds exactly the unit's keys with the global shapes."""
    return set(state) == set(ref) and all(tuple(state[k].shape) == tuple(ref[k].shape) for k in ref)


def round_contributions(
    global_units: Mapping[int, State],
    updates: Sequence[DeviceUpdate],
    server_units: Mapping[int, State] | None = None,
) -> list[Contribution]:
    """docs/method.md "Aggregation" as contributions: one per device (its complete units, weight |D_i|), then the server.

    The server's copy of unit j is weighted by the summed |D_i| of the devices with depth <= j that
    did not send a complete state of unit j themselves, i.e. whose data went through the server's
    copy (coordinator/server.py ``_aggregate``). A partial unit state (keys or shapes differ from
    the global unit's) is dropped: averaging it key by key would mix a half-sent unit into the
    global one. For a unit the device ran locally (j < depth) its data then counts nowhere, since
    it never passed through the server's copy. Units outside ``global_units`` are ignored. ``server_units=None`` means the server trained nothing this round; if some
    device's data did pass through a server copy that is absent, that is a wiring error (raised).
    """
    if not global_units or set(global_units) != set(range(len(global_units))):
        raise ValueError(f"global_units must be units 0..L (blocks, then the head), got {sorted(global_units)}")
    head = len(global_units) - 1
    contributions: list[Contribution] = []
    server_weight = {j: 0.0 for j in global_units}
    for u in updates:
        if u.depth > head + 1:
            raise ValueError(f"device {u.device_id}: depth {u.depth} exceeds {head + 1} units")
        complete = {j: s for j, s in u.states.items() if j in global_units and _complete(s, global_units[j])}
        contributions.append(Contribution(complete, u.num_samples))
        for j in global_units:
            if j >= u.depth and j not in complete:
                server_weight[j] += u.num_samples
    for j, w in server_weight.items():
        if w <= 0:
            continue
        if server_units is None or j not in server_units:
            raise ValueError(f"unit {j}: {w:g} samples passed through the server's copy, but no server state was given")
        contributions.append(Contribution({j: server_units[j]}, w))
    return contributions


def aggregate_round(
    global_units: Mapping[int, State],
    updates: Sequence[DeviceUpdate],
    server_units: Mapping[int, State] | None = None,
    fast: bool = True,
    rule: str = "mean",
    trim: float = 0.2,
) -> dict[int, dict[str, Tensor]]:
    """New global value of every unit after one round (``rule``: ``robust_average``); units nobody
    trained keep ``global_units``."""
    return aggregate_blocks(global_units, round_contributions(global_units, updates, server_units), fast=fast,
                            rule=rule, trim=trim)
