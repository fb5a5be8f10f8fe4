"""The Peer's cache of answered requests: a redelivered request gets the same reply, not a second run.

Kept per sender, so one sender's traffic never evicts another's entries, and bounded: ``size`` entries
per sender, ``sender_bytes`` of large replies per sender and ``total_bytes`` in all (over it, the sender
holding the most loses its oldest large reply; its digest stays, so a repeat is known as a replay).
Not thread-safe: the Peer calls it under its lock.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

__all__ = ["CacheEntry", "ReplyCache"]

_SMALL_REPLY = 4096  # replies up to this size are never dropped for bytes (only with their entry)
_ENTRY_COST = 200  # bookkeeping of one cache entry, counted against the byte caps


@dataclass(slots=True)
class CacheEntry:
    digest: bytes  # of the request bytes
    reply: bytes | None
    dropped: bool = False  # the reply was dropped for bytes: a repeat is a replay, refused


class _SenderCache:
    """One sender's answered messages, oldest first, and the bytes their replies hold."""

    __slots__ = ("bytes", "entries")

    def __init__(self) -> None:
        self.entries: OrderedDict[int, CacheEntry] = OrderedDict()
        self.bytes = 0


class ReplyCache:
    """Answered ``(sender, seq)`` -> the request's digest and its encoded reply, within the bounds above."""

    def __init__(self, size: int, sender_bytes: int, total_bytes: int, max_senders: int) -> None:
        self._size, self._sender_bytes, self._total_bytes = size, sender_bytes, total_bytes
        self._max_senders = max_senders
        self._senders: OrderedDict[str, _SenderCache] = OrderedDict()
        self.bytes = 0  # large replies plus a fixed cost per entry

    def get(self, sender: str, seq: int, digest: bytes) -> CacheEntry | None:
        """The entry of an identical earlier request (same bytes), freshly used; None if there is none."""
        cache = self._senders.get(sender)
        hit = cache.entries.get(seq) if cache is not None else None
        if hit is None or hit.digest != digest:
            return None
        cache.entries.move_to_end(seq)  # type: ignore[union-attr]
        return hit

    def put(self, sender: str, seq: int, entry: CacheEntry) -> None:
        """Cache one answer, then enforce the per-sender and global bounds."""
        cache = self._senders.get(sender)
        if cache is None:
            cache = self._senders[sender] = _SenderCache()
            while len(self._senders) > self._max_senders:
                _, gone = self._senders.popitem(last=False)
                self.bytes -= gone.bytes
        self._senders.move_to_end(sender)
        old = cache.entries.pop(seq, None)
        if old is not None:
            self._forget(cache, old)
        cache.entries[seq] = entry
        cost = self._cost(entry)
        cache.bytes += cost
        self.bytes += cost
        while len(cache.entries) > self._size:
            self._forget(cache, cache.entries.popitem(last=False)[1])
        while cache.bytes > self._sender_bytes and self._drop_oldest_large(cache):
            pass
        while self.bytes > self._total_bytes:
            biggest = max(self._senders.values(), key=lambda c: c.bytes)
            if not self._drop_oldest_large(biggest):
                break

    @staticmethod
    def _cost(entry: CacheEntry) -> int:
        big = entry.reply is not None and len(entry.reply) > _SMALL_REPLY and not entry.dropped
        return _ENTRY_COST + (len(entry.reply) if big else 0)  # type: ignore[arg-type]

    def _forget(self, cache: _SenderCache, entry: CacheEntry) -> None:
        cost = self._cost(entry)
        cache.bytes -= cost
        self.bytes -= cost

    def _drop_oldest_large(self, cache: _SenderCache) -> bool:
        """Drop the oldest large reply of ``cache`` (its digest stays, so a repeat is a replay)."""
        for entry in cache.entries.values():
            if entry.reply is not None and len(entry.reply) > _SMALL_REPLY and not entry.dropped:
                self._forget(cache, entry)
                entry.reply, entry.dropped = None, True
                cache.bytes += _ENTRY_COST
                self.bytes += _ENTRY_COST
                return True
        return False
