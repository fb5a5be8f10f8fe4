"""Frames: the small msgpack map every MQTT payload is, carrying a correlation id and the payload or one chunk.

Parsing is strict (one flat map, known keys, bounded sizes) so a hostile publisher cannot make a frame
expand in memory, and a chunk must name its sender, so one peer cannot pass for another's chunks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from ...wire import RemoteProtocolError
from ..base import TransportError

__all__ = ["FRAME_VERSION", "MIN_PART", "Frame", "as_bytes_view", "check_chunk_head", "pack_frame", "parse_frame"]

FRAME_VERSION = 1
_OPS = frozenset({"req", "rep", "send", "err"})
_FRAME_KEYS_WHOLE = frozenset({"tf", "op", "cid", "p"})
_FRAME_KEYS_CHUNK = frozenset({"tf", "op", "cid", "chunk"})
_MAX_CID = 64
# Every chunk but a message's last must carry at least this much, so a message of `total` bytes
# has at most ceil(total / MIN_PART) parts. The Reassembler reserves the declared total, which
# bounds the part bytes it holds; this bounds the per-part Python overhead (~150 bytes) too,
# so a peer cannot pin 100x its reservation with 1-byte chunks. Honest chunks are >= 2.9 KiB.
MIN_PART = 1024


def as_bytes_view(payload: Any) -> memoryview:
    """A byte view of ``payload`` so lengths are bytes, not elements (memoryview of float32...)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TransportError(f"payload must be bytes, got {type(payload).__name__}")
    view = memoryview(payload)
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def pack_frame(op: str, cid: str, *, p: Any = None, chunk: Any = None) -> bytes:
    """One frame: the whole payload ``p``, or one ``chunk`` of it (``wire.chunking``)."""
    d: dict[str, Any] = {"tf": FRAME_VERSION, "op": op, "cid": cid}
    if chunk is not None:
        d["chunk"] = chunk
    else:
        d["p"] = p
    return msgpack.packb(d, use_bin_type=True)


@dataclass(slots=True)
class Frame:
    op: str
    cid: str
    p: bytes | None
    chunk: bytes | None


def parse_frame(data: bytes) -> Frame:
    """Validate one MQTT payload as a frame; anything else is RemoteProtocolError."""
    try:  # a frame is one flat map: no arrays or big maps, so a hostile one cannot expand in memory
        d = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0, max_array_len=0, max_map_len=8)
    except Exception as e:  # msgpack's ValueError zoo
        raise RemoteProtocolError(f"not a frame ({len(data)} bytes of non-msgpack)") from e
    if not isinstance(d, dict) or d.get("tf") != FRAME_VERSION or isinstance(d.get("tf"), bool):
        raise RemoteProtocolError(f"not a version-{FRAME_VERSION} frame")
    if d.keys() not in (_FRAME_KEYS_WHOLE, _FRAME_KEYS_CHUNK):
        raise RemoteProtocolError(f"frame keys {sorted(map(repr, d.keys()))} are not a whole or a chunk frame")
    op, cid = d["op"], d["cid"]
    if op not in _OPS:
        raise RemoteProtocolError(f"unknown frame op {op!r:.40}")
    if not isinstance(cid, str) or not 0 < len(cid) <= _MAX_CID:
        raise RemoteProtocolError(f"frame cid must be a str of 1-{_MAX_CID} chars")
    body = d.get("p", d.get("chunk"))
    if not isinstance(body, bytes):
        raise RemoteProtocolError(f"frame body must be bin, got {type(body).__name__}")
    return Frame(op, cid, d.get("p"), d.get("chunk"))


def check_chunk_head(chunk: bytes, want_id: str) -> None:
    """What the Reassembler does not check: whose chunk this is, and that its parts are not tiny."""
    try:
        head = msgpack.unpackb(chunk, raw=False, strict_map_key=True, max_ext_len=0, max_array_len=0, max_map_len=16)
    except Exception as e:
        raise RemoteProtocolError("chunk is not msgpack") from e
    if not isinstance(head, dict) or head.get("id") != want_id:
        raise RemoteProtocolError(f"chunk id must be {want_id!r}")
    i, n, total, part = head.get("i"), head.get("n"), head.get("total"), head.get("part")
    if not all(isinstance(v, int) for v in (i, n, total)) or not isinstance(part, bytes):
        return  # malformed: the Reassembler says why
    if n > max(1, -(-total // MIN_PART)) or (i < n - 1 and len(part) < MIN_PART):
        raise RemoteProtocolError(f"chunks must carry >= {MIN_PART} bytes each but the last (n={n}, total={total})")
