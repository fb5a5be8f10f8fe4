"""The transport interface: move bytes between named addresses, count them, nothing else.

Roles never see a transport; they talk through a ``Peer`` (``peer.py``), which
encodes messages and hands bytes to whichever transport the CLI picked. So
loopback simulation and MQTT trials run the same role code.
"""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Handler", "OpenRequest", "PendingReply", "Transport", "TransportError", "TransportStats", "check_address"]


@dataclass(frozen=True, slots=True)
class OpenRequest:
    """Request ``seq`` of ``sender``, whose reply its handler has not emitted yet: the transport keeps the
    request open, and ``Transport.reply`` with this token answers it (the coordinator holding an
    activation for a merged step, MergeSFL)."""

    sender: str
    seq: int


Handler = Callable[[bytes], "bytes | OpenRequest | None"]
"""Request bytes in, reply bytes out; None means "no reply", an ``OpenRequest`` "not answered yet"."""


class PendingReply:
    """The reply to a request left open, on a transport whose ``request`` cannot wait for it (loopback:
    the handler runs in the caller's thread, which may be the only one). ``ready`` once
    ``Transport.reply`` filled it; ``wait`` blocks until then and returns the bytes."""

    __slots__ = ("_done", "_data")

    def __init__(self) -> None:
        self._done = threading.Event()
        self._data: bytes | None = None

    @property
    def ready(self) -> bool:
        return self._done.is_set()

    @property
    def nbytes(self) -> int:
        """The reply's size once it is here (0 before)."""
        return len(self._data) if self._data is not None else 0

    def fill(self, data: bytes) -> None:
        self._data = bytes(data)
        self._done.set()

    def wait(self, timeout: float | None = None) -> bytes:
        """The reply's bytes; TransportError if it has not come within ``timeout`` (None: wait as long as it takes)."""
        if not self._done.wait(timeout):
            raise TransportError(f"no reply to the open request within {timeout:g} s")
        assert self._data is not None
        return self._data

# Addresses end up in MQTT topics: no '/', '+', '#', spaces or control characters.
_ADDRESS = re.compile(r"[A-Za-z0-9._:-]{1,128}")


class TransportError(Exception):
    """Bytes could not be delivered: unknown address, no reply, timeout, closed transport."""


def check_address(address: str) -> None:
    """Raise TransportError unless ``address`` is safe to embed in an MQTT topic."""
    if not isinstance(address, str) or not _ADDRESS.fullmatch(address):
        raise TransportError(f"bad address {address!r}: use 1-128 of [A-Za-z0-9._:-]")


class TransportStats:
    """Bytes and messages per direction (src, dst); thread-safe.

    Counts payload lengths exactly as handed to the transport (after encoding,
    before any chunking or broker framing), so they equal the sum of
    ``len(encode(...))`` of what the roles sent.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.messages: Counter[tuple[str, str]] = Counter()

    def record(self, src: str, dst: str, nbytes: int) -> None:
        with self._lock:
            self.bytes[(src, dst)] += nbytes
            self.messages[(src, dst)] += 1

    def bytes_sent(self, src: str | None = None, dst: str | None = None) -> int:
        """Total bytes from ``src`` to ``dst``; None matches any address."""
        return self._sum(self.bytes, src, dst)

    def messages_sent(self, src: str | None = None, dst: str | None = None) -> int:
        """Total messages from ``src`` to ``dst``; None matches any address."""
        return self._sum(self.messages, src, dst)

    def reset(self) -> None:
        with self._lock:
            self.bytes.clear()
            self.messages.clear()

    def _sum(self, counter: Counter[tuple[str, str]], src: str | None, dst: str | None) -> int:
        with self._lock:
            return sum(v for (s, d), v in counter.items() if (src is None or s == src) and (dst is None or d == dst))


class Transport(ABC):
    """Deliver opaque payloads between registered addresses.

    ``request`` blocks until the destination's handler replies; ``send`` is
    one-way (any reply the handler returns is dropped). Implementations count
    every payload they carry in ``stats``, replies included.

    A handler may leave a request open by returning an ``OpenRequest`` token; its reply goes out when
    ``reply`` is called with that token (MQTT: on the request's reply topic under its correlation id,
    the requester's ``request`` still waiting; loopback: ``request`` has returned a ``PendingReply``,
    which ``reply`` fills).
    """

    stats: TransportStats

    @abstractmethod
    def register(self, address: str, handler: Handler) -> None:
        """Deliver payloads addressed to ``address`` to ``handler``."""

    @abstractmethod
    def unregister(self, address: str) -> None:
        """Stop delivering to ``address`` (a device leaving, or a simulated failure)."""

    @abstractmethod
    def request(self, src: str, dst: str, payload: bytes, *, timeout: float | None = None) -> bytes:
        """Send ``payload`` to ``dst`` and return its reply; TransportError if none comes."""

    @abstractmethod
    def send(self, src: str, dst: str, payload: bytes) -> None:
        """Send ``payload`` to ``dst`` without waiting for a reply."""

    def reply(self, src: str, token: OpenRequest, payload: bytes) -> None:
        """Deliver ``payload`` from ``src`` as the reply to the request its handler answered with ``token``.

        A reply may come before the transport has seen the token (another thread released it between
        the handler's return and the transport's bookkeeping): it is kept and delivered then."""
        raise TransportError(f"{type(self).__name__} cannot answer an open request")

    @abstractmethod
    def close(self) -> None:
        """Release resources; later calls raise TransportError."""
