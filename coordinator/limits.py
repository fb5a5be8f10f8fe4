"""What the coordinator accepts as numbers from a device: finite, of a sane size."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedsga_edge.wire import RemoteProtocolError

__all__ = ["MAX_ABS_VALUE", "REPORT_FIELDS", "check_values", "all_finite", "check_report", "capped_samples"]

# Largest |value| accepted in an activation, h1 or weight. Honest ones are O(1)-O(1e3); anything this
# big means a diverged or hostile device, and would overflow float32 a few layers on.
MAX_ABS_VALUE = 1e6
# Per-client numbers an update may report (docs/method.md); copied into metrics.jsonl, so checked here.
REPORT_FIELDS = ("a", "delta", "q", "r", "r_prev", "k_policy", "L1", "Lref", "s", "descriptor_entropy",
                 "probe_samples", "obs_samples", "steps")


def check_values(arr: np.ndarray, what: str) -> None:
    """Finite and of a sane size, or ValueError naming the problem (one NaN would spread for good)."""
    if arr.size == 0 or arr.dtype.kind not in "fc":
        return
    if not np.isfinite(arr).all():
        raise RemoteProtocolError(f"{what} holds non-finite values")
    peak = float(np.abs(arr).max())
    if peak > MAX_ABS_VALUE:
        raise RemoteProtocolError(f"{what} holds |values| up to {peak:.3g}, over the {MAX_ABS_VALUE:g} any honest "
                                  "device sends")


def all_finite(tensors: Any) -> bool:
    import torch

    return all(t is None or bool(torch.isfinite(t).all()) for t in tensors)


def check_report(body: dict[str, Any]) -> None:
    """The update's own numbers go into metrics.jsonl and end_round's sums: finite numbers only."""
    loss = body.get("train_loss")
    if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
        raise RemoteProtocolError("train_loss must be a finite number")
    for key in REPORT_FIELDS:
        v = body.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                              or abs(v) > MAX_ABS_VALUE):
            raise RemoteProtocolError(f"{key} must be a finite number, got {type(v).__name__}")
    for key in ("probe_samples", "obs_samples"):  # counts that FLOPs are multiplied by
        if body.get(key) is not None and (not isinstance(body[key], int) or body[key] < 0):
            raise RemoteProtocolError(f"{key} must be a non-negative integer")


def capped_samples(clients: dict[str, int], device: str, cap: float) -> float:
    """``device``'s sample count, at most ``cap`` x the median count of ``clients`` (0: as it stands).

    A count the coordinator cannot check (a device with its own data) is a claim: one device saying
    10^9 would otherwise take all of aggregation's weight. The median over the fleet is what one liar
    cannot move."""
    n = clients[device]
    return min(n, cap * float(np.median(list(clients.values())))) if cap else n
