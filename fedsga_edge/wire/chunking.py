"""Split large messages under a broker's packet limit and put them back together.

Sans-I/O: ``split_message`` turns bytes into chunks, ``Reassembler.feed`` turns
chunks back into bytes. Who moves the chunks (MQTT, a test) is not our business.

Each chunk is a small msgpack map::

    {"v": 1, "id": str, "i": index, "n": count, "total": whole-message bytes,
     "crc": crc32 of the whole message, "part": bin}

Every chunk carries ``n``, ``total`` and ``crc`` so any chunk may arrive first
and a chunk that contradicts its siblings is caught at once.

Picking ``max_chunk``: the broker's packet limit minus headroom for the MQTT
header, topic and (MQTT 5) properties. Default limits we know of: EMQX 1 MiB,
AWS IoT Core 128 KiB, Azure IoT Hub 256 KiB; Mosquitto imposes none beyond the
MQTT maximum (256 MiB) unless ``message_size_limit`` is set.
``max_chunk_for(BROKER_PACKET_LIMITS["aws_iot"])`` gives a safe value.
"""

from __future__ import annotations

import math
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack

from .errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "BROKER_PACKET_LIMITS",
    "CHUNK_VERSION",
    "DEFAULT_HEADROOM",
    "Reassembler",
    "max_chunk_for",
    "split_message",
]

CHUNK_VERSION = 1
BROKER_PACKET_LIMITS: dict[str, int] = {
    "emqx": 1024 * 1024,
    "aws_iot": 128 * 1024,
    "azure_iot_hub": 256 * 1024,
}
DEFAULT_HEADROOM = 1024  # MQTT fixed header + topic + packet id + MQTT 5 properties, generously
_MAX_ID_LEN = 256
_U32 = 2**32 - 1
_KEYS = frozenset({"v", "id", "i", "n", "total", "crc", "part"})


def max_chunk_for(packet_limit: int, *, headroom: int = DEFAULT_HEADROOM) -> int:
    """Largest chunk (encoded bytes) that fits a broker packet limit with headroom to spare."""
    if packet_limit - headroom < 64:
        raise LocalProtocolError(f"packet limit {packet_limit} minus headroom {headroom} is too small")
    return packet_limit - headroom


def _pack_chunk(msg_id: str, i: int, n: int, total: int, crc: int, part: Any) -> bytes:
    d = {"v": CHUNK_VERSION, "id": msg_id, "i": i, "n": n, "total": total, "crc": crc, "part": part}
    return msgpack.packb(d, use_bin_type=True)


def split_message(data: bytes | bytearray | memoryview, *, max_chunk: int, msg_id: str) -> list[bytes]:
    """Cut ``data`` into chunks whose encoded length is at most ``max_chunk`` bytes.

    ``msg_id`` must be unique per message for at least the receiver's timeout
    (e.g. ``f"{sender}-{seq}-{random hex}"``): the receiver swallows chunks of
    an id it has just completed as QoS 1 redeliveries. Always returns at least
    one chunk, even for empty data.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise LocalProtocolError(f"split_message() takes bytes, got {type(data).__name__}")
    if not isinstance(msg_id, str) or not 0 < len(msg_id) <= _MAX_ID_LEN:
        raise LocalProtocolError(f"msg_id must be a non-empty str of at most {_MAX_ID_LEN} chars")
    view = memoryview(data).cast("B")
    total, crc = len(view), zlib.crc32(view)
    # Header cost with the widest i/n msgpack may use, plus the bin32 length prefix
    # (an empty part packs with the 2-byte bin8 prefix; bin32's is 5).
    overhead = len(_pack_chunk(msg_id, _U32, _U32, total, crc, b"")) + 3
    room = max_chunk - overhead
    if room < 1:
        raise LocalProtocolError(f"max_chunk={max_chunk} leaves no room: the chunk header alone needs {overhead}")
    n = max(1, math.ceil(total / room))
    return [_pack_chunk(msg_id, i, n, total, crc, view[i * room : (i + 1) * room]) for i in range(n)]


@dataclass(slots=True)
class _Partial:
    n: int
    total: int
    crc: int
    started: float
    owner: str | None = None
    parts: dict[int, bytes] = field(default_factory=dict)
    size: int = 0


class Reassembler:
    """Collect chunks into whole messages, with memory caps and a timeout.

    Memory counts what arrived, never what a chunk declares: ``max_bytes``
    caps the part bytes held by all partial messages together and
    ``max_owner_bytes`` (default ``max_bytes``) those held for one ``owner``
    (the sender a transport observed). Declaring a huge ``total`` therefore
    pins nothing; a message that declares more than a cap is refused on its
    first chunk (it could never complete), and one whose next part would push
    its owner past ``max_owner_bytes`` evicts that owner's older partial
    messages first and is refused (its parts freed) only if that is not enough.

    When a part would push everything past ``max_bytes``, whole partial
    messages are evicted, oldest first: another owner's if that owner holds
    more than the newcomer's owner would, else the newcomer's owner's own
    older ones; only if that frees nothing is the newcomer refused. So one
    peer's flood cannot starve the others (an owner within its fair share is
    never refused for others' bytes), and a stale half-sent message gives way
    to a live one. ``max_pending`` and ``max_owner_pending`` bound the number
    of partial messages the same way (a new message evicts the oldest partial
    one of its owner, or of the owner with the most), so their bookkeeping
    (under 1 KiB each) stays bounded. The per-part overhead (~150 bytes) is
    bounded by whoever feeds the chunks (``transport/mqtt/frames.py`` demands at
    least 1 KiB per part but the last). An evicted message's next chunk raises
    once, so its sender hears why.

    Call ``expire()`` periodically (feed does not): it drops partial messages
    whose first chunk is older than ``timeout_s``.

    ``stats`` counts: completed (messages), duplicates (chunks already held or
    of a just-completed message), expired (messages), rejected (messages
    refused for size or corrupted at assembly), evicted (messages dropped to
    make room), invalid (chunks refused as malformed or contradicting their
    siblings), dropped (later chunks of a rejected or evicted message, ignored
    quietly so one bad message raises once).
    """

    def __init__(
        self,
        max_bytes: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        remember: int = 4096,
        max_owner_bytes: int | None = None,
        max_pending: int = 4096,
        max_owner_pending: int | None = None,
    ) -> None:
        if max_bytes < 0 or timeout_s <= 0 or remember < 1 or max_pending < 1:
            raise LocalProtocolError("need max_bytes >= 0, timeout_s > 0, remember >= 1 and max_pending >= 1")
        self.max_bytes = max_bytes
        self.max_owner_bytes = max_bytes if max_owner_bytes is None else min(max_owner_bytes, max_bytes)
        self.max_pending = max_pending
        self.max_owner_pending = max_pending if max_owner_pending is None else max(1, min(max_owner_pending, max_pending))
        self.timeout_s = timeout_s
        self._clock = clock
        self._remember = remember
        self._partial: dict[str, _Partial] = {}  # oldest first
        self._in_flight = 0
        self._owner_bytes: dict[str | None, int] = {}
        self._owner_pending: dict[str | None, int] = {}
        # Recently finished ids -> when; bounded by `remember` and by timeout_s.
        self._completed: OrderedDict[str, float] = OrderedDict()
        self._rejected: OrderedDict[str, float] = OrderedDict()
        self._evicted: OrderedDict[str, None] = OrderedDict()  # the next chunk of these says so, once
        self.stats: dict[str, int] = dict.fromkeys(
            ("completed", "duplicates", "expired", "rejected", "evicted", "invalid", "dropped"), 0
        )

    @property
    def in_flight_bytes(self) -> int:
        """Part bytes held by partial messages (what arrived, not what they declare)."""
        return self._in_flight

    def owner_bytes(self, owner: str | None) -> int:
        """Part bytes held for ``owner``'s partial messages."""
        return self._owner_bytes.get(owner, 0)

    @property
    def pending(self) -> list[str]:
        """Ids of messages still waiting for chunks."""
        return list(self._partial)

    def feed(self, chunk: bytes | bytearray | memoryview, owner: str | None = None) -> bytes | None:
        """Take one chunk; return the whole message once its last chunk is in, else None.

        ``owner`` is who sent it as the transport saw it (None: one shared owner);
        its messages share the ``max_owner_bytes`` and ``max_owner_pending`` quotas.
        """
        msg_id, i, n, total, crc, part = self._parse(chunk)
        if msg_id in self._completed:
            self.stats["duplicates"] += 1
            return None
        if msg_id in self._rejected:
            self.stats["dropped"] += 1
            if self._evicted.pop(msg_id, False) is None:
                raise RemoteProtocolError(f"message {msg_id!r} was evicted to make room for newer or fairer traffic")
            return None
        p = self._partial.get(msg_id)
        if p is None:
            cap = min(self.max_bytes, self.max_owner_bytes)
            if total > cap:
                self._reject(msg_id)
                raise RemoteProtocolError(f"message {msg_id!r} declares {total} bytes, cap is {cap}")
            if self._owner_pending.get(owner, 0) >= self.max_owner_pending:
                self._evict(self._oldest(owner))
            if len(self._partial) >= self.max_pending:
                self._evict(self._oldest(max(self._owner_pending, key=self._owner_pending.__getitem__)))
            p = self._partial[msg_id] = _Partial(n=n, total=total, crc=crc, started=self._clock(), owner=owner)
            self._owner_pending[owner] = self._owner_pending.get(owner, 0) + 1
        elif (n, total, crc) != (p.n, p.total, p.crc):
            self.stats["invalid"] += 1
            raise RemoteProtocolError(
                f"chunk {i} of {msg_id!r} says n={n} total={total} crc={crc:#x}, "
                f"earlier chunks said n={p.n} total={p.total} crc={p.crc:#x}"
            )
        held = p.parts.get(i)
        if held is not None:
            if held == part:
                self.stats["duplicates"] += 1
                return None
            self.stats["invalid"] += 1
            raise RemoteProtocolError(f"chunk {i} of {msg_id!r} arrived twice with different contents")
        if p.size + len(part) > p.total:
            self.stats["invalid"] += 1
            raise RemoteProtocolError(f"chunk {i} of {msg_id!r} overflows the declared {p.total} bytes")
        wants = self._owner_bytes.get(owner, 0) + len(part)
        while wants > self.max_owner_bytes and (older := self._oldest(owner, msg_id)) is not None:
            self._evict(older)  # the owner's own stale half-sent messages give way first
            wants = self._owner_bytes.get(owner, 0) + len(part)
        if wants <= self.max_owner_bytes:
            self._make_room(msg_id, owner, wants, len(part))
        if self._in_flight + len(part) > self.max_bytes or wants > self.max_owner_bytes:
            self._drop(msg_id)
            self._reject(msg_id)
            raise RemoteProtocolError(
                f"message {msg_id!r} refused: {len(part)} more bytes would hold {wants} for this sender and "
                f"{self._in_flight + len(part)} in all in flight, caps are {self.max_owner_bytes} / {self.max_bytes}"
            )
        p.parts[i] = part
        p.size += len(part)
        self._in_flight += len(part)
        self._owner_bytes[owner] = wants
        if len(p.parts) < p.n:
            return None
        return self._assemble(msg_id, p)

    def expire(self) -> list[str]:
        """Drop partial messages older than ``timeout_s``; return their ids."""
        now = self._clock()
        gone = [k for k, p in self._partial.items() if now - p.started > self.timeout_s]
        for k in gone:
            self._drop(k)
        self.stats["expired"] += len(gone)
        for memo in (self._completed, self._rejected):
            while memo and now - next(iter(memo.values())) > self.timeout_s:
                self._evicted.pop(memo.popitem(last=False)[0], None)
        return gone

    # ---------------------------------------------------------------- helpers

    def _oldest(self, owner: str | None, but: str | None = None) -> str | None:
        return next((k for k, q in self._partial.items() if q.owner == owner and k != but), None)

    def _make_room(self, msg_id: str, owner: str | None, wants: int, need: int) -> None:
        """Evict partial messages, oldest first, until ``need`` more bytes fit: another owner's if it
        holds more than ``owner`` would (``wants``), else ``owner``'s own older ones."""
        while self._in_flight + need > self.max_bytes:
            rival = max((o for o in self._owner_bytes if o != owner), key=self._owner_bytes.__getitem__, default=None)
            victim = self._oldest(rival if rival is not None and self._owner_bytes[rival] > wants else owner, msg_id)
            if victim is None:
                return
            self._evict(victim)

    def _evict(self, msg_id: str | None) -> None:
        """Drop a partial message to make room; its next chunk hears why (once), later ones are dropped."""
        if msg_id is None:
            return
        self._drop(msg_id)
        self._memo(self._rejected, msg_id)
        self._evicted[msg_id] = None
        while len(self._evicted) > self._remember:
            self._evicted.popitem(last=False)
        self.stats["evicted"] += 1

    def _drop(self, msg_id: str) -> _Partial:
        """Forget a partial message and release what it held."""
        p = self._partial.pop(msg_id)
        self._in_flight -= p.size
        left = self._owner_bytes.pop(p.owner, 0) - p.size
        if left > 0:
            self._owner_bytes[p.owner] = left
        count = self._owner_pending.pop(p.owner, 0) - 1
        if count > 0:
            self._owner_pending[p.owner] = count
        return p

    def _assemble(self, msg_id: str, p: _Partial) -> bytes:
        self._drop(msg_id)
        data = b"".join(p.parts[k] for k in range(p.n))
        if len(data) != p.total or zlib.crc32(data) != p.crc:
            self._reject(msg_id)
            raise RemoteProtocolError(
                f"message {msg_id!r} reassembled to {len(data)} bytes / crc {zlib.crc32(data):#x}, "
                f"declared {p.total} / {p.crc:#x}: corrupted, dropped"
            )
        self.stats["completed"] += 1
        self._memo(self._completed, msg_id)
        return data

    def _reject(self, msg_id: str) -> None:
        self.stats["rejected"] += 1
        self._memo(self._rejected, msg_id)

    def _memo(self, memo: OrderedDict[str, float], msg_id: str) -> None:
        memo[msg_id] = self._clock()
        memo.move_to_end(msg_id)
        while len(memo) > self._remember:
            memo.popitem(last=False)

    def _parse(self, chunk: Any) -> tuple[str, int, int, int, int, bytes]:
        try:
            # A chunk is one flat map: no arrays, no big maps, so a hostile one cannot expand in memory.
            d = msgpack.unpackb(chunk, raw=False, strict_map_key=True, max_ext_len=0, max_array_len=0, max_map_len=16)
        except Exception as e:  # msgpack's ValueError zoo, or not a buffer at all
            self.stats["invalid"] += 1
            raise RemoteProtocolError(f"chunk is not msgpack: {e}") from e
        try:
            return _validate_chunk(d)
        except RemoteProtocolError:
            self.stats["invalid"] += 1
            raise


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate_chunk(d: Any) -> tuple[str, int, int, int, int, bytes]:
    if not isinstance(d, dict):
        raise RemoteProtocolError(f"chunk must be a msgpack map, got {type(d).__name__}")
    if d.get("v") != CHUNK_VERSION or not _is_int(d.get("v")):
        raise RemoteProtocolError(f"unsupported chunk version {d.get('v')!r:.40}; this side reads {CHUNK_VERSION}")
    if d.keys() != _KEYS:
        raise RemoteProtocolError(f"chunk keys must be {sorted(_KEYS)}, got {sorted(map(repr, d.keys()))}")
    msg_id, i, n, total, crc, part = (d[k] for k in ("id", "i", "n", "total", "crc", "part"))
    if not isinstance(msg_id, str) or not 0 < len(msg_id) <= _MAX_ID_LEN:
        raise RemoteProtocolError(f"chunk id must be a non-empty str of at most {_MAX_ID_LEN} chars")
    if not (_is_int(total) and total >= 0 and _is_int(crc) and 0 <= crc <= _U32):
        raise RemoteProtocolError(f"chunk of {msg_id!r}: bad total {total!r:.40} or crc {crc!r:.40}")
    # A non-empty message has non-empty parts, so n <= total bounds the part table.
    if not (_is_int(n) and 1 <= n <= max(1, total) and _is_int(i) and 0 <= i < n):
        raise RemoteProtocolError(f"chunk of {msg_id!r}: bad index i={i!r:.40} n={n!r:.40} (total={total})")
    if not isinstance(part, bytes) or len(part) > total or (total > 0 and not part):
        raise RemoteProtocolError(f"chunk {i} of {msg_id!r}: part must be 1..{total} bytes of bin")
    return msg_id, i, n, total, crc, part
