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
    parts: dict[int, bytes] = field(default_factory=dict)
    size: int = 0


class Reassembler:
    """Collect chunks into whole messages, with a memory cap and a timeout.

    ``max_bytes`` caps the sum of the *declared* sizes of all messages in
    flight, reserved on a message's first chunk, so memory stays bounded
    whatever peers claim. Call ``expire()`` periodically (feed does not): it
    drops partial messages whose first chunk is older than ``timeout_s``.

    ``stats`` counts: completed (messages), duplicates (chunks already held or
    of a just-completed message), expired (messages), rejected (messages
    refused for size or corrupted at assembly), invalid (chunks refused as
    malformed or contradicting their siblings), dropped (later chunks of a
    rejected message, ignored quietly so one bad message raises once).
    """

    def __init__(
        self,
        max_bytes: int,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        remember: int = 4096,
    ) -> None:
        if max_bytes < 0 or timeout_s <= 0 or remember < 1:
            raise LocalProtocolError("need max_bytes >= 0, timeout_s > 0 and remember >= 1")
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self._clock = clock
        self._remember = remember
        self._partial: dict[str, _Partial] = {}
        self._in_flight = 0
        # Recently finished ids -> when; bounded by `remember` and by timeout_s.
        self._completed: OrderedDict[str, float] = OrderedDict()
        self._rejected: OrderedDict[str, float] = OrderedDict()
        self.stats: dict[str, int] = dict.fromkeys(
            ("completed", "duplicates", "expired", "rejected", "invalid", "dropped"), 0
        )

    @property
    def in_flight_bytes(self) -> int:
        """Bytes reserved by partial messages (their declared totals)."""
        return self._in_flight

    @property
    def pending(self) -> list[str]:
        """Ids of messages still waiting for chunks."""
        return list(self._partial)

    def feed(self, chunk: bytes | bytearray | memoryview) -> bytes | None:
        """Take one chunk; return the whole message once its last chunk is in, else None."""
        msg_id, i, n, total, crc, part = self._parse(chunk)
        if msg_id in self._completed:
            self.stats["duplicates"] += 1
            return None
        if msg_id in self._rejected:
            self.stats["dropped"] += 1
            return None
        p = self._partial.get(msg_id)
        if p is None:
            if total > self.max_bytes:
                self._reject(msg_id)
                raise RemoteProtocolError(f"message {msg_id!r} declares {total} bytes, cap is {self.max_bytes}")
            if self._in_flight + total > self.max_bytes:
                self._reject(msg_id)
                raise RemoteProtocolError(
                    f"message {msg_id!r} ({total} bytes) would put {self._in_flight + total} bytes "
                    f"in flight, cap is {self.max_bytes}"
                )
            p = self._partial[msg_id] = _Partial(n=n, total=total, crc=crc, started=self._clock())
            self._in_flight += total
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
        p.parts[i] = part
        p.size += len(part)
        if len(p.parts) < p.n:
            return None
        return self._assemble(msg_id, p)

    def expire(self) -> list[str]:
        """Drop partial messages older than ``timeout_s``; return their ids."""
        now = self._clock()
        gone = [k for k, p in self._partial.items() if now - p.started > self.timeout_s]
        for k in gone:
            self._in_flight -= self._partial.pop(k).total
        self.stats["expired"] += len(gone)
        for memo in (self._completed, self._rejected):
            while memo and now - next(iter(memo.values())) > self.timeout_s:
                memo.popitem(last=False)
        return gone

    # ---------------------------------------------------------------- helpers

    def _assemble(self, msg_id: str, p: _Partial) -> bytes:
        del self._partial[msg_id]
        self._in_flight -= p.total
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
            d = msgpack.unpackb(chunk, raw=False, strict_map_key=True, max_ext_len=0)
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
