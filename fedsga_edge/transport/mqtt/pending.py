"""Requests waiting for their replies, by correlation id."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from ..base import TransportStats
from .frames import Frame
from .health import Health
from .topics import Topics

__all__ = ["Pending", "PendingReplies"]

_MAX_REASON = 1000  # bytes of an err frame's reason kept: it ends up in exceptions and logs


@dataclass(slots=True)
class Pending:
    """One request waiting for its reply; only a frame on ``reply_topic`` may answer it."""

    reply_topic: str
    event: threading.Event = field(default_factory=threading.Event)
    reply: bytes | None = None
    error: str | None = None


class PendingReplies:
    """The table of open requests; a reply is matched by cid and must arrive on the request's reply topic,
    so one device cannot answer a request sent to another."""

    def __init__(self, lock: threading.RLock, topics: Topics, stats: TransportStats, local: set[str],
                 health: Health) -> None:
        self._lock = lock
        self._topics = topics
        self._stats = stats
        self._local = local  # addresses this transport speaks for: their payloads were counted when sent
        self._health = health
        self._pending: dict[str, Pending] = {}

    def open(self, cid: str, reply_topic: str) -> Pending:
        with self._lock:
            pending = self._pending[cid] = Pending(reply_topic)
            return pending

    def drop(self, cid: str) -> None:
        with self._lock:
            self._pending.pop(cid, None)

    def waiting(self) -> list[Pending]:
        with self._lock:
            return list(self._pending.values())

    @staticmethod
    def fail(pendings: list[Pending], reason: str) -> None:
        """Wake each request with ``reason`` as its error (the transport is closing)."""
        for p in pendings:
            p.error = reason
            p.event.set()

    def answer(self, topic: str, frame: Frame, payload: bytes) -> None:
        """A ``rep`` or ``err`` frame arrived on ``topic``: wake its request, or count why not."""
        with self._lock:
            pending = self._pending.get(frame.cid)
            if pending is None:
                self._health.count("late_replies")
                return
            if pending.reply_topic != topic:  # someone else answering our request
                self._health.count("spoofed")
                return
            del self._pending[frame.cid]
        src, dst = self._topics.classify(topic) or ("?", "?")
        if frame.op == "err":
            pending.error = bytes(payload[:_MAX_REASON]).decode("utf-8", "replace")  # the peer's words, bounded
        else:
            pending.reply = payload
            if src not in self._local:  # our own replies were counted when published
                self._stats.record(src, dst, len(payload))
        pending.event.set()
