"""In-process transport: the handler runs synchronously in the caller's thread.

Used to simulate many clients in one process and to test both ends of the
protocol together (h11's tests do the same with an in-memory link). Because
delivery is a plain function call, nested requests just work: a client handling
"round_start" may call the coordinator for every batch from inside its handler.

Exceptions raised by a handler propagate to the caller unchanged, whatever
their type: a LocalProtocolError or a programming error must fail the test
loudly, and a RemoteProtocolError reaches the caller as an exception so the
role decides what to do with it. (``Peer.serve`` already turns a peer's garbage
into an ``error`` reply, so a well-behaved handler rarely raises at all.)
``timeout`` is accepted for interface compatibility and ignored: the call
returns when the handler does.

A handler that leaves a request open (an ``OpenRequest``: the coordinator holding an activation for
a merged step) makes ``request`` return a ``PendingReply`` at once, since the caller's thread may be the only
one (``simulate``'s in-process scheduler); ``reply`` fills it, and the bytes are counted then. The
device's Peer turns it into a pending message, which its role waits on, or its scheduler skips the
device until it is ready (coordinator/scheduling.py).
"""

from __future__ import annotations

import threading

from collections import OrderedDict

from .base import Handler, OpenRequest, PendingReply, Transport, TransportError, TransportStats, check_address

__all__ = ["LoopbackTransport"]

_EARLY = 1024  # replies to open requests kept for a token not seen yet (a reply racing its handler's return)


def _nbytes(b: bytes | bytearray | memoryview) -> int:
    return b.nbytes if isinstance(b, memoryview) else len(b)


class LoopbackTransport(Transport):
    """Addresses map to handlers in a dict; request/send call them directly. Thread-safe."""

    def __init__(self) -> None:
        self.stats = TransportStats()
        self._handlers: dict[str, Handler] = {}
        self._lock = threading.Lock()
        self._closed = False
        # (replier, sender, seq) -> the pending reply and the requester's address; replies that came first
        self._open: dict[tuple[str, str, int], tuple[PendingReply, str]] = {}
        self._early: OrderedDict[tuple[str, str, int], bytes] = OrderedDict()

    def register(self, address: str, handler: Handler) -> None:
        check_address(address)
        if not callable(handler):
            raise TransportError(f"handler for {address!r} is not callable")
        with self._lock:
            self._check_open()
            if address in self._handlers:
                raise TransportError(f"address {address!r} is already registered; unregister it first")
            self._handlers[address] = handler

    def unregister(self, address: str) -> None:
        with self._lock:
            if self._handlers.pop(address, None) is None:
                raise TransportError(f"address {address!r} is not registered")

    def request(  # type: ignore[override]
        self, src: str, dst: str, payload: bytes, *, timeout: float | None = None
    ) -> bytes | PendingReply:
        if timeout is not None and timeout <= 0:
            raise TransportError(f"timeout must be positive, got {timeout}")
        handler = self._route(src, dst, payload)
        self.stats.record(src, dst, _nbytes(payload))
        reply = handler(payload)
        if isinstance(reply, OpenRequest):
            return self._keep_open(src, dst, reply)
        if reply is None:
            raise TransportError(f"{dst!r} sent no reply to a request from {src!r}")
        if not isinstance(reply, (bytes, bytearray, memoryview)):
            raise TransportError(f"handler of {dst!r} returned {type(reply).__name__}, not bytes")
        reply = bytes(reply)  # no copy when it already is bytes
        self.stats.record(dst, src, len(reply))
        return reply

    def _keep_open(self, src: str, dst: str, token: OpenRequest) -> PendingReply:
        pending = PendingReply()
        key = (dst, token.sender, token.seq)
        with self._lock:
            early = self._early.pop(key, None)
            if early is None:
                if key in self._open:
                    raise TransportError(f"{dst!r} left request {token.seq} of {token.sender!r} open twice")
                self._open[key] = (pending, src)
        if early is not None:
            self.stats.record(dst, src, len(early))
            pending.fill(early)
        return pending

    def reply(self, src: str, token: OpenRequest, payload: bytes) -> None:
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TransportError(f"payload must be bytes, got {type(payload).__name__}")
        data = bytes(payload)
        key = (src, token.sender, token.seq)
        with self._lock:
            self._check_open()
            entry = self._open.pop(key, None)
            if entry is None:  # its request has not returned from the handler yet: deliver it then
                self._early[key] = data
                while len(self._early) > _EARLY:
                    self._early.popitem(last=False)
                return
        pending, requester = entry
        self.stats.record(src, requester, len(data))
        pending.fill(data)

    def send(self, src: str, dst: str, payload: bytes) -> None:
        handler = self._route(src, dst, payload)
        self.stats.record(src, dst, _nbytes(payload))
        handler(payload)  # one-way: a reply, if any, goes nowhere and is not counted

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._handlers.clear()
            self._open.clear()
            self._early.clear()

    def _route(self, src: str, dst: str, payload: bytes) -> Handler:
        check_address(src)
        if not isinstance(payload, (bytes, bytearray, memoryview)):
            raise TransportError(f"payload must be bytes, got {type(payload).__name__}")
        with self._lock:
            self._check_open()
            handler = self._handlers.get(dst)
        if handler is None:
            known = ", ".join(sorted(self._handlers)) or "none"
            raise TransportError(f"no handler registered at {dst!r} (from {src!r}); registered: {known}")
        return handler

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")
