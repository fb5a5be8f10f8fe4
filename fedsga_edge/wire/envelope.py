"""A message's envelope, read without building its body.

``decode`` must know who sent a message, for which run, round and kind before it spends memory
on the body: a hostile peer's tensors should cost nothing when its envelope already says "refuse
me". msgpack-python can only build whole objects, so this module reads the top-level map's
headers itself: it decodes the short envelope values (at most ``_MAX_SCALAR`` bytes each) and
records where the body's bytes lie, skipping over it without building anything when it is not the
last entry (honest encoders put it last, so then it is not even walked).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import RemoteProtocolError

__all__ = ["Envelope", "Opaque", "read_envelope"]

_MAX_KEYS = 64  # entries of the top-level map scanned; the envelope has 7
_MAX_SCALAR = 4096  # bytes of one envelope value decoded; longer ones are refused by name
_MAX_SKIP = 200_000  # elements walked when skipping a body that is not the last entry


@dataclass(slots=True, frozen=True)
class Envelope:
    """What a message says about itself, before its body is decoded."""

    kind: str
    run: str
    round: int
    seq: int
    sender: str


@dataclass(slots=True, frozen=True)
class Opaque:
    """An envelope value left unbuilt (a container or an oversized string); ``kind`` is its Python type name."""

    kind: str
    size: int

    def __repr__(self) -> str:
        return f"<{self.kind} of {self.size}>"


_TYPE_NAMES = {"map": "dict", "array": "list", "str": "str", "bin": "bytes", "ext": "ExtType"}


class _Truncated(Exception):
    pass


# msgpack header byte -> payload size of fixed-size scalars; -> (kind, bytes of its length field) of sized ones
_FIXED = {0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}
_SIZED = {0xC4: ("bin", 1), 0xC5: ("bin", 2), 0xC6: ("bin", 4), 0xC7: ("ext", 1), 0xC8: ("ext", 2),
          0xC9: ("ext", 4), 0xD9: ("str", 1), 0xDA: ("str", 2), 0xDB: ("str", 4), 0xDC: ("array", 2),
          0xDD: ("array", 4), 0xDE: ("map", 2), 0xDF: ("map", 4)}

def _head(b: memoryview, pos: int) -> tuple[str, int, int]:
    """The msgpack object at ``pos``: (family, n, next). ``n`` is the payload's bytes (str, bin, ext)
    or element count (array, map) and ``next`` where its payload starts; scalars: n=0, next past them."""
    if pos >= len(b):
        raise _Truncated
    t = b[pos]
    if t <= 0x7F or t >= 0xE0:
        return "scalar", 0, pos + 1
    if t <= 0x8F:
        return "map", t & 0x0F, pos + 1
    if t <= 0x9F:
        return "array", t & 0x0F, pos + 1
    if t <= 0xBF:
        return "str", t & 0x1F, pos + 1
    if t in (0xC0, 0xC2, 0xC3):
        return "scalar", 0, pos + 1
    if t in _FIXED:
        return "scalar", 0, pos + 1 + _FIXED[t]
    if 0xD4 <= t <= 0xD8:  # fixext 1..16: type byte + payload
        return "ext", 1 << (t - 0xD4), pos + 2
    if t not in _SIZED:  # 0xC1: never used
        raise RemoteProtocolError(f"not a msgpack message ({len(b)} bytes): reserved type byte 0xc1")
    family, width = _SIZED[t]
    if pos + 1 + width > len(b):
        raise _Truncated
    n = int.from_bytes(b[pos + 1 : pos + 1 + width], "big")
    start = pos + 1 + width + (1 if family == "ext" else 0)
    return family, n, start


def _skip(b: memoryview, pos: int) -> int:
    """Where the object at ``pos`` ends, walking headers only (nothing is built)."""
    todo, walked = 1, 0
    while todo:
        family, n, pos = _head(b, pos)
        todo -= 1
        if family in ("str", "bin", "ext"):
            pos += n
        elif family in ("array", "map"):
            walked += n
            if walked > _MAX_SKIP:
                raise RemoteProtocolError(f"message holds more than {_MAX_SKIP} list and map elements")
            todo += n * (2 if family == "map" else 1)
        if pos > len(b):
            raise _Truncated
    return pos


def _value(b: memoryview, pos: int) -> tuple[Any, int]:
    """One envelope value and where it ends: short scalars and strings built, anything else Opaque."""
    family, n, start = _head(b, pos)
    if family in ("array", "map"):
        return Opaque(_TYPE_NAMES[family], n), _skip(b, pos)
    end = start + n if family != "scalar" else start
    if end > len(b):
        raise _Truncated
    if end - pos > _MAX_SCALAR:
        return Opaque(_TYPE_NAMES[family], n), end
    try:
        return msgpack.unpackb(b[pos:end], raw=False, max_ext_len=0), end
    except Exception as e:  # invalid UTF-8, an ext type
        raise RemoteProtocolError(f"not a msgpack message ({len(b)} bytes): {e}") from e


def read_envelope(data: memoryview) -> tuple[dict[str, Any], tuple[int, int] | None, str]:
    """The top-level map's entries except the body, the body's byte span, and the body's type name.

    Raises RemoteProtocolError for anything that is not one well-formed msgpack map, and
    ``LookupError`` when the input is not a map at all (the caller then reports what it is).
    """
    try:
        family, n, pos = _head(data, 0)
        if family != "map":
            raise LookupError
        if n > _MAX_KEYS:
            raise RemoteProtocolError(f"bad envelope: {n} keys")
        fields: dict[str, Any] = {}
        body: tuple[int, int] | None = None
        body_type = "NoneType"
        for i in range(n):
            kfam = _head(data, pos)[0]
            if kfam != "str":
                raise RemoteProtocolError(f"not a msgpack message ({len(data)} bytes): envelope keys must be str")
            key, pos = _value(data, pos)
            if key in fields or (key == "body" and body is not None):
                raise RemoteProtocolError(f"bad envelope: key {key!r:.40} twice")
            if key == "body":
                if _head(data, pos)[0] == "map":
                    body_type = "dict"
                    end = len(data) if i == n - 1 else _skip(data, pos)  # last: the body's decode checks the end
                else:
                    v, end = _value(data, pos)
                    body_type = v.kind if isinstance(v, Opaque) else type(v).__name__
                body = (pos, end)
                pos = end
            else:
                fields[key if isinstance(key, str) else repr(key)], pos = _value(data, pos)
        if pos != len(data):
            raise RemoteProtocolError(f"not a msgpack message ({len(data)} bytes): extra data after the message")
    except _Truncated as e:
        raise RemoteProtocolError(f"not a msgpack message ({len(data)} bytes): truncated") from e
    return fields, body, body_type
