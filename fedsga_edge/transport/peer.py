"""Peer: how roles talk, in Messages, without ever touching bytes or a transport.

``call`` numbers, encodes and sends a message and decodes the reply; ``serve``
wraps a ``Message -> Message | None`` handler into the bytes handler a
transport wants, and adds the two things every handler needs on MQTT:

* idempotency -- QoS 1 may deliver a message twice. A repeat of an already
  answered ``(sender, seq)`` with identical bytes gets the cached reply and the
  handler does not run again. Same ``(sender, seq)`` with *different* bytes is
  not a redelivery (e.g. the sender restarted and its seq began again), so it
  is handled afresh.
* robustness -- bytes that do not decode, a message for another run, or a
  RemoteProtocolError raised by the handler (the role judged the peer wrong)
  become an ``error`` reply and ``peer.errors += 1``; the handler keeps
  serving. Anything else a handler raises is our bug and propagates.
* identity -- a transport that knows who really sent the bytes (MQTT: the
  topic they arrived on, which broker ACLs tie to the login) exposes it as
  ``observed_sender()``; a message whose ``sender`` differs is answered with an
  ``error`` and never reaches the handler or the reply cache. Loopback has no
  such method, so nothing changes there.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ..wire import TENSOR_FORMATS, LocalProtocolError, Message, RemoteProtocolError, decode, encode
from .base import Handler, Transport, check_address

__all__ = ["MessageHandler", "Peer"]

MessageHandler = Callable[[Message], Message | None]

log = logging.getLogger(__name__)
_MAX_REASON = 1000


class Peer:
    """One party (coordinator or a device) on a transport, speaking for one run.

    Thread-safe: seq numbers and the reply cache are guarded by a lock.
    """

    def __init__(
        self,
        transport: Transport,
        me: str,
        run: str,
        tensor_format: str = "raw",
        *,
        cache_size: int = 1024,
        seq_start: int = 1,
    ) -> None:
        check_address(me)
        if tensor_format not in TENSOR_FORMATS:
            raise LocalProtocolError(f"unknown tensor_format {tensor_format!r}; use one of {TENSOR_FORMATS}")
        if cache_size < 1:
            raise LocalProtocolError("cache_size must be >= 1")
        self.transport = transport
        self.me = me
        self.run = run
        self.tensor_format = tensor_format
        self.errors = 0  # garbage received: undecodable, wrong run, or judged wrong by the handler
        self.duplicates = 0  # redeliveries answered from the cache
        self._cache_size = cache_size
        self._seq = itertools.count(seq_start)
        self._lock = threading.Lock()
        # (sender, seq) -> (digest of request bytes, encoded reply or None)
        self._replies: OrderedDict[tuple[str, int], tuple[bytes, bytes | None]] = OrderedDict()
        self._busy: dict[tuple[str, int], bytes] = {}

    # ------------------------------------------------------------- outgoing

    def message(self, kind: str, round: int, body: dict[str, Any] | None = None) -> Message:
        """A new message from this peer with the next sequence number."""
        with self._lock:
            seq = next(self._seq)
        return Message(kind=kind, run=self.run, round=round, seq=seq, sender=self.me, body=body or {})

    def reply(self, to: Message, kind: str, body: dict[str, Any] | None = None) -> Message:
        """A new message answering ``to`` (same round)."""
        return self.message(kind, to.round, body)

    def call(
        self, dst: str, kind: str, round: int, body: dict[str, Any] | None = None, *, timeout: float | None = None
    ) -> Message:
        """Send a request and return the decoded reply (an ``error`` reply is returned, not raised).

        Raises RemoteProtocolError if the reply is garbage or belongs to another
        run, TransportError if it never comes.
        """
        payload = encode(self.message(kind, round, body), tensor_format=self.tensor_format)
        raw = self.transport.request(self.me, dst, payload, timeout=timeout)
        try:
            rep = decode(raw)
            self._check_run(rep)
        except RemoteProtocolError:
            with self._lock:
                self.errors += 1
            raise
        return rep

    def send(self, dst: str, kind: str, round: int, body: dict[str, Any] | None = None) -> None:
        """One-way message; any reply is dropped by the transport."""
        payload = encode(self.message(kind, round, body), tensor_format=self.tensor_format)
        self.transport.send(self.me, dst, payload)

    # ------------------------------------------------------------- incoming

    def serve(self, handler: MessageHandler, *, sender_of: Callable[[], str | None] | None = None) -> Handler:
        """Adapt a Message handler to a bytes handler (dedup + error replies, see module doc).

        ``sender_of`` returns the sender the transport observed for the bytes
        being handled (None: unknown, no check); it defaults to the transport's
        ``observed_sender`` when it has one.
        """
        observed = sender_of if sender_of is not None else getattr(self.transport, "observed_sender", None)

        def on_bytes(data: bytes) -> bytes | None:
            try:
                msg = decode(data)
                self._check_run(msg)
                if observed is not None:
                    self._check_sender(msg, observed())
            except RemoteProtocolError as e:
                return self._error_reply(e, 0)
            key = (msg.sender, msg.seq)
            digest = hashlib.blake2b(data, digest_size=16).digest()
            with self._lock:
                hit = self._replies.get(key)
                if hit is not None and hit[0] == digest:
                    self._replies.move_to_end(key)
                    self.duplicates += 1
                    return hit[1]
                if self._busy.get(key) == digest:
                    # Redelivered while the first copy is still being handled
                    # (threaded transports): that copy's reply will answer it.
                    self.duplicates += 1
                    return None
                self._busy[key] = digest
            reply: bytes | None
            try:
                try:
                    out = handler(msg)
                except RemoteProtocolError as e:
                    reply = self._error_reply(e, msg.round)
                else:
                    if out is not None and not isinstance(out, Message):
                        raise LocalProtocolError(f"handler returned {type(out).__name__}, not Message or None")
                    reply = None if out is None else encode(out, tensor_format=self.tensor_format)
                with self._lock:
                    self._replies[key] = (digest, reply)
                    self._replies.move_to_end(key)
                    while len(self._replies) > self._cache_size:
                        self._replies.popitem(last=False)
                return reply
            finally:
                with self._lock:
                    self._busy.pop(key, None)

        return on_bytes

    def register(self, handler: MessageHandler) -> None:
        """Serve ``handler`` at this peer's own address on its transport."""
        self.transport.register(self.me, self.serve(handler))

    # -------------------------------------------------------------- helpers

    def _check_run(self, msg: Message) -> None:
        if msg.run != self.run:
            raise RemoteProtocolError(f"{msg.kind!r} from {msg.sender!r} is for run {msg.run!r}, not {self.run!r}")

    @staticmethod
    def _check_sender(msg: Message, seen: str | None) -> None:
        if seen is not None and msg.sender != seen:
            raise RemoteProtocolError(
                f"{msg.kind!r} claims sender {msg.sender!r:.140} but arrived from {seen!r}: rejected"
            )

    def _error_reply(self, e: RemoteProtocolError, round: int) -> bytes:
        with self._lock:
            self.errors += 1
        log.warning("%s: rejected a message: %s", self.me, e)
        reason = str(e)[:_MAX_REASON]
        return encode(self.message("error", round, {"reason": reason}), tensor_format=self.tensor_format)
