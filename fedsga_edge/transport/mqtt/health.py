"""The transport's health counters: what it dropped or refused, and why (read as ``MqttTransport.counters``)."""

from __future__ import annotations

import threading
from collections import Counter

__all__ = ["Health"]


class Health:
    """Thread-safe counts of: garbage (undecodable frames, foreign or retained topics), spoofed (replies on
    the wrong topic), duplicates (QoS 1 redeliveries), rejected (too big / over the buffer cap), no_handler,
    handler_errors (a handler raised), late_replies (reply after its request gave up)."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, key: str) -> None:
        with self._lock:
            self.counters[key] += 1
