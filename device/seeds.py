"""A device's random streams: its seed from the run's seed and its id, the same on every machine and Python."""

from __future__ import annotations

import numpy as np

__all__ = ["PROBE_SPAWN_KEY", "device_rng", "stable_hash"]

PROBE_SPAWN_KEY = 0x9B0BE  # the probe slice's branch of a device's seed sequence


def stable_hash(text: str) -> int:
    """FNV-1a: the same per-device seed on every machine and Python (unlike ``hash``)."""
    h = 2166136261
    for ch in text.encode():
        h = ((h ^ ch) * 16777619) & 0xFFFFFFFF
    return h


def device_rng(seed: int, cid: str) -> tuple[np.random.Generator, int]:
    """The device's own generator (batch order) and the seed of its backend's (augmentation, prompts).

    Both backends draw the backend seed the same way, so for one seed they see the same batches.
    """
    rng = np.random.default_rng([seed, stable_hash(cid)])
    return rng, int(rng.integers(2**31))
