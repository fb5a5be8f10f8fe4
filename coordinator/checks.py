"""What the coordinator accepts in a device's request: shapes, dtypes, splits and weights.

Each check raises ``RemoteProtocolError`` naming the problem (the device broke the rules: it gets a
refusal and nothing changes); any other exception out of a request's handling is our bug.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from fedsga_edge.tensors import from_numpy
from fedsga_edge.wire import RemoteProtocolError

from .limits import check_report, check_values

__all__ = ["check_batch", "check_blocks", "check_split", "check_update", "check_weights"]


def check_batch(co: Any, body: dict[str, Any], key: str, k: int) -> tuple[Tensor, Tensor]:
    """``body[key]`` and ``body["y"]`` as a batch entering ``co``'s model at split k (tensors on its device)."""
    z, y = body[key], body["y"]
    if not isinstance(z, np.ndarray) or not isinstance(y, np.ndarray):
        raise RemoteProtocolError(f"{key} and y must be arrays")
    if z.dtype.kind != "f":
        raise RemoteProtocolError(f"{key} must be floating point, got {z.dtype}")
    if y.dtype.kind not in "iu":
        raise RemoteProtocolError(f"labels must be integers, got {y.dtype}")
    m = co.model.prompt_positions(co.strategy.prompt_tokens(co.cfg))
    expected = co.model.interface_shape(co.model.depth_of(k), m)
    if z.ndim != len(expected) + 1 or tuple(z.shape[1:]) != expected or y.shape != z.shape[:1] or len(y) < 2:
        raise RemoteProtocolError(f"{key} {z.shape} / labels {y.shape} do not fit split {k} "
                                  f"(expected (B>=2, *{expected}))")
    most = co.cfg.train.batch_size + 1  # a device folds a last batch of one into the one before
    if len(y) > most:
        raise RemoteProtocolError(f"{key} holds {len(y)} samples, more than a batch ({most})")
    check_values(z, key)
    if y.min() < 0 or y.max() >= co.num_classes:
        raise RemoteProtocolError(f"labels outside 0..{co.num_classes - 1}")
    return from_numpy(z, co.device).float(), from_numpy(y, co.device).long()


def check_split(co: Any, body: dict[str, Any], device: str) -> int:
    """The request's split: in range, and one this round lets ``device`` train at (not quarantined)."""
    co.anomaly.check(device)
    k = body.get("split")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= co.model.num_splits:
        raise RemoteProtocolError(f"split {k!r} out of range 1..{co.model.num_splits}")
    fixed = co.round.assigned.get(device)
    if not co.strategy.accepts_split(fixed, k, co.round.calibrate):
        raise RemoteProtocolError(f"split {k} but this round assigned {fixed}")
    return k


def check_blocks(raw: Any, num_blocks: int) -> set[int]:
    """A fetch's block indices: integers in 0..num_blocks-1."""
    if not all(isinstance(j, int) and not isinstance(j, bool) for j in raw):
        raise RemoteProtocolError("blocks must be integers")
    blocks = set(raw)
    if any(not 0 <= j < num_blocks for j in blocks):
        raise RemoteProtocolError(f"block indices {sorted(blocks)} out of range 0..{num_blocks - 1}")
    return blocks


def check_update(co: Any, body: dict[str, Any], device: str) -> tuple[int, int]:
    """An update's split, depth, weights, sample count and reported numbers: its ``(split, depth)``, the
    split 0 and the depth past the head for a whole-model device."""
    co.anomaly.check(device)
    L = co.model.num_blocks
    full = co.round.assigned[device] == 0
    k = 0 if full else check_split(co, body, device)
    depth = L if full else co.model.depth_of(k)  # blocks trained on the device
    if body.get("depth") != depth:
        raise RemoteProtocolError(f"depth {body.get('depth')!r} does not match split {k} (expected {depth})")
    if full:
        depth = L + 1  # the head (unit L) too
    snapshot = co._snapshot
    check_weights(body["weights"], {n: v for n, v in snapshot.items() if co.model.unit_of(n) < depth}, depth)
    if body.get("num_samples") != co.clients[device]:
        raise RemoteProtocolError(f"num_samples {body.get('num_samples')!r:.40} is not this device's "
                                  f"{co.clients[device]}")
    check_report(body)
    return k, depth


def check_weights(weights: dict[str, Any], expected: dict[str, torch.Tensor], depth: int) -> None:
    """An update's weights: exactly ``expected``'s names (the units below ``depth``), their shapes and
    dtypes, finite values."""
    if set(weights) != set(expected):
        extra, missing = sorted(set(weights) - set(expected))[:3], sorted(set(expected) - set(weights))[:3]
        raise RemoteProtocolError(f"update weights do not match depth {depth}: extra {extra}, missing {missing}")
    for n, arr in weights.items():
        ref = expected[n]
        if not isinstance(arr, np.ndarray) or tuple(arr.shape) != tuple(ref.shape):
            raise RemoteProtocolError(f"weight {n} has shape {getattr(arr, 'shape', None)}, "
                                      f"expected {tuple(ref.shape)}")
        if ref.is_floating_point():
            if arr.dtype.kind != "f":
                raise RemoteProtocolError(f"weight {n} must be floating point, got {arr.dtype}")
            check_values(arr, f"weight {n}")
        elif arr.dtype.kind not in "iu" or (arr.size and (arr.min() < 0 or arr.max() > 2**62)):
            raise RemoteProtocolError(f"weight {n} must be a non-negative integer counter")
