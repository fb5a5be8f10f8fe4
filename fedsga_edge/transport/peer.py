"""Peer: how roles talk, in Messages, without ever touching bytes or a transport.

``call`` numbers, encodes and sends a message and decodes the reply; ``serve``
wraps a ``Message -> Message | None`` handler into the bytes handler a
transport wants, and adds the two things every handler needs on MQTT:

* idempotency -- QoS 1 may deliver a message twice. A repeat of an already
  answered ``(sender, seq)`` with identical bytes gets the cached reply and the
  handler does not run again. Same ``(sender, seq)`` with *different* bytes is
  not a redelivery (e.g. the sender restarted and its seq began again), so it
  is handled afresh. The cache is kept per sender, so one sender's traffic
  never evicts another's entries, and bounded: ``cache_size`` entries per
  sender, ``cache_bytes`` of large replies per sender and ``cache_total_bytes``
  in all (over it, the sender holding the most loses its oldest large reply).
  A repeat whose large reply was dropped that way is refused as a replay (the
  handler does not run twice); one whose entry is gone entirely (more than
  ``cache_size`` messages ago) is handled afresh, so side effects need their
  own guard too (the coordinator refuses a request whose seq does not grow).
  Error replies are never cached: a refusal changes nothing, so answering a
  repeat afresh is safe, and senders that only ever get refused (unknown
  devices) occupy no cache at all.
* robustness -- bytes that do not decode, a message for another run, or a
  RemoteProtocolError raised by the handler (the role judged the peer wrong)
  become an ``error`` reply, ``peer.errors += 1`` and ``peer.rejections[sender]
  += 1``. The log and ``on_reject(sender, kind, reason)`` (if set) hear of the
  first 10 per sender each minute, then of one summary with the count
  (``logthrottle``), so a flood cannot flood the log. The handler keeps
  serving. Anything else a handler raises is our bug and propagates.
* check before decode -- the envelope is checked before the body is decoded:
  run, sender (against the observed one) and then the role's ``admit``
  (if set: it raises RemoteProtocolError for a round or kind it will not
  take), so a message refused on its envelope never builds a tensor.
* identity -- a transport that knows who really sent the bytes (MQTT: the
  topic they arrived on, which broker ACLs tie to the login) exposes it as
  ``observed_sender()``; a message whose ``sender`` differs is answered with an
  ``error`` and never reaches the handler or the reply cache. Loopback has no
  such method, so nothing changes there.
* one output channel -- a handler may return, instead of one reply, the list of messages its role
  wants sent (``Outgoing``: device, message; the coordinator's). The one to this message's sender
  with its seq is its reply; each other one answers that device's open request of the same seq
  (``answer``: MergeSFL's merged step, released by this message). A request whose reply is not in
  the list stays open (nothing is cached, and a repeat of the same bytes meanwhile is not handled
  again) until some later list or ``answer`` emits it. On loopback the requester's ``call`` then
  returns a ``PendingMessage`` (``ready``, ``result()``) instead of waiting, since the coordinator may
  run in the requester's own thread; over MQTT ``call`` simply waits for the reply.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np

from ..logthrottle import Summary, Throttle, describe
from ..wire import (
    TENSOR_FORMATS,
    Admit,
    Envelope,
    LocalProtocolError,
    Message,
    Outgoing,
    RemoteProtocolError,
    decode,
    encode,
)
from .base import Handler, OpenRequest, PendingReply, Transport, TransportError, check_address
from .replycache import CacheEntry, ReplyCache

__all__ = ["LOSSY_FIELDS", "LOSSY_KINDS", "MessageHandler", "Peer", "PendingMessage"]

MessageHandler = Callable[[Message], "Message | Outgoing | None"]

log = logging.getLogger(__name__)
_MAX_REASON = 1000
RejectHook = Callable[[str, str, str], None]

# A lossy tensor_format (fp16 / int8 / int4) touches only the per-batch tensors of these kinds: activations,
# their gradients and the calibration probe (docs/protocol.md, "Messages"). Weights (round_start,
# weights, update), prototypes and phi_s always travel exact, and labels are integers, which the
# codec never encodes lossily. A message of these kinds that holds a floating tensor under any other
# name is sent raw as a whole, so nothing outside LOSSY_FIELDS is ever rounded.
LOSSY_KINDS = frozenset({"activation", "gradient", "probe"})
LOSSY_FIELDS = frozenset({"z", "h1", "dz", "z1", "zref"})


class PendingMessage:
    """A reply the other side answers later (loopback only; see the module doc): ``ready`` once it came,
    ``result()`` waits for it and returns the decoded Message (RemoteProtocolError if it is garbage)."""

    __slots__ = ("_pending", "_decode", "_message")

    def __init__(self, pending: PendingReply, decode_reply: Callable[[bytes], Message]) -> None:
        self._pending, self._decode = pending, decode_reply
        self._message: Message | None = None

    @property
    def ready(self) -> bool:
        return self._pending.ready

    def result(self, timeout: float | None = None) -> Message:
        if self._message is None:
            self._message = self._decode(self._pending.wait(timeout))
        return self._message


class Peer:
    """One party (coordinator or a device) on a transport, speaking for one run.

    ``tensor_format`` (raw, fp16, int8, int4) is how this peer *sends* the per-batch tensors
    (``LOSSY_KINDS`` / ``LOSSY_FIELDS``); everything else goes raw. Receiving accepts every
    encoding whatever this peer's own setting. Thread-safe: seq numbers and the reply cache are
    guarded by a lock.
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
        cache_bytes: int = 64 * 1024 * 1024,
        cache_total_bytes: int = 256 * 1024 * 1024,
        max_senders: int = 1024,
        on_reject: RejectHook | None = None,
        admit: Admit | None = None,
    ) -> None:
        """``cache_size`` entries and ``cache_bytes`` of replies per sender, ``cache_total_bytes`` and
        ``max_senders`` in all bound the reply cache (see the module doc); ``admit`` is the role's check
        of an incoming envelope, run before the body is decoded."""
        check_address(me)
        if tensor_format not in TENSOR_FORMATS:
            raise LocalProtocolError(f"unknown tensor_format {tensor_format!r}; use one of {TENSOR_FORMATS}")
        if cache_size < 1 or cache_bytes < 0 or cache_total_bytes < 0 or max_senders < 1:
            raise LocalProtocolError("need cache_size >= 1, cache_bytes >= 0, cache_total_bytes >= 0, max_senders >= 1")
        self.transport = transport
        self.me = me
        self.run = run
        self.tensor_format = tensor_format
        # per recipient, the tensor_format sent to it instead (a coordinator under --wire-format auto: each
        # device's gradients in the format its round start named); replaced whole, never changed in place
        self.formats: dict[str, str] = {}
        self.errors = 0  # garbage received: undecodable, wrong run, or judged wrong by the handler
        self.duplicates = 0  # redeliveries answered from the cache
        self.replays = 0  # repeats whose reply was dropped from the cache: refused, not handled twice
        self.rejections: Counter[str] = Counter()  # error replies sent, by (observed) sender
        # bytes this peer encoded to send, by message kind: what each kind costs on the wire (a cached reply
        # sent again is not encoded again, so redeliveries are not counted here; the transport's stats count them)
        self.encoded_bytes: Counter[str] = Counter()
        self.on_reject = on_reject
        self.admit = admit
        self.log_throttle = Throttle()  # rejections written to the log and on_reject: per sender, per minute
        self._max_senders = max_senders
        self._seq = itertools.count(seq_start)
        self._lock = threading.Lock()
        self._replies = ReplyCache(cache_size, cache_bytes, cache_total_bytes, max_senders)  # under _lock
        self._busy: dict[tuple[str, int], bytes] = {}  # requests being handled or open: their digests

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
        self, dst: str, kind: str, round: int, body: dict[str, Any] | None = None, *, timeout: float | None = None,
        tensor_format: str | None = None,
    ) -> Message | PendingMessage:
        """Send a request and return the decoded reply (an ``error`` reply is returned, not raised), or,
        when the other side answers later on a transport that cannot wait (loopback), a ``PendingMessage``.
        ``tensor_format``: this request's per-batch tensors in that format instead of the peer's (a device
        under --wire-format auto sends in the format its round start named).

        Raises RemoteProtocolError if the reply is garbage or belongs to another
        run, TransportError if it never comes.
        """
        if tensor_format is not None and tensor_format not in TENSOR_FORMATS:
            raise LocalProtocolError(f"unknown tensor_format {tensor_format!r}; use one of {TENSOR_FORMATS}")
        payload = self._encode(self.message(kind, round, body), tensor_format or self.formats.get(dst))
        raw = self.transport.request(self.me, dst, payload, timeout=timeout)
        if isinstance(raw, PendingReply):
            return PendingMessage(raw, self._decode_reply)
        return self._decode_reply(raw)

    def _decode_reply(self, raw: bytes) -> Message:
        try:
            rep = decode(raw, admit=self._check_run)
        except RemoteProtocolError:
            with self._lock:
                self.errors += 1
            raise
        return rep

    def send(self, dst: str, kind: str, round: int, body: dict[str, Any] | None = None) -> None:
        """One-way message; any reply is dropped by the transport."""
        payload = self._encode(self.message(kind, round, body), self.formats.get(dst))
        self.transport.send(self.me, dst, payload)

    def answer(self, to: str, reply: Message) -> None:
        """Send ``reply`` as the reply to ``to``'s open request ``reply.seq`` (one this peer's handler has
        not answered yet)."""
        data = self._encode(reply, self.formats.get(to))
        try:
            self.transport.reply(self.me, OpenRequest(to, reply.seq), data)
        finally:
            with self._lock:
                self._busy.pop((to, reply.seq), None)
        if reply.kind == "error":  # the role refused it (and logs it itself), as serve counts it
            self._count_rejection(to, "?", str(reply.body.get("reason", "")), notify=False)

    # ------------------------------------------------------------- incoming

    def serve(self, handler: MessageHandler, *, sender_of: Callable[[], str | None] | None = None) -> Handler:
        """Adapt a Message handler to a bytes handler (dedup + error replies, see module doc).

        ``sender_of`` returns the sender the transport observed for the bytes
        being handled (None: unknown, no check); it defaults to the transport's
        ``observed_sender`` when it has one.
        """
        observed = sender_of if sender_of is not None else getattr(self.transport, "observed_sender", None)

        def on_bytes(data: bytes) -> bytes | OpenRequest | None:
            seen = observed() if observed is not None else None
            heard: list[Envelope] = []  # the envelope, once read: its kind names the refusal in the log

            def admit(env: Envelope) -> None:
                heard.append(env)
                self._check_envelope(env, seen)

            try:
                msg = decode(data, admit=admit)
            except RemoteProtocolError as e:
                return self._error_reply(e, 0, seen or "?", heard[0].kind if heard else "?")
            digest = hashlib.blake2b(data, digest_size=16).digest()
            with self._lock:
                hit = self._replies.get(msg.sender, msg.seq, digest)
                if hit is not None and not hit.dropped:
                    self.duplicates += 1
                    return hit.reply
                if hit is not None:
                    self.replays += 1
                elif self._busy.get((msg.sender, msg.seq)) == digest:
                    # Redelivered while the first copy is still being handled (threaded transports) or
                    # its request is open: that copy's reply will answer it.
                    self.duplicates += 1
                    return None
                else:
                    self._busy[(msg.sender, msg.seq)] = digest
            if hit is not None:
                e = RemoteProtocolError(f"{msg.kind!r} seq {msg.seq} from {msg.sender!r} was answered already and "
                                        f"its reply is no longer held: a replay, not handled again")
                return self._error_reply(e, msg.round, msg.sender, msg.kind)
            return self._handle(handler, msg, digest)

        return on_bytes

    def _handle(self, handler: MessageHandler, msg: Message, digest: bytes) -> bytes | OpenRequest | None:
        """Run ``handler`` on a new message: its encoded reply (cached unless a refusal), or the open
        request's token when the handler's list does not answer it yet."""
        key = (msg.sender, msg.seq)
        open_ = False
        try:
            try:
                out = handler(msg)
            except RemoteProtocolError as e:
                return self._error_reply(e, msg.round, msg.sender, msg.kind)
            if isinstance(out, list):
                out = self._answer_others(out, key)
                if out is None:  # answered by a later list or ``answer``; a repeat meanwhile is not handled again
                    open_ = True
                    return OpenRequest(*key)
            if out is not None and not isinstance(out, Message):
                raise LocalProtocolError(f"handler returned {type(out).__name__}, not Message, a list or None")
            reply = None if out is None else self._encode(out, self.formats.get(msg.sender))
            if out is not None and out.kind == "error":  # the role refused it (and logs it itself): not cached,
                self._count_rejection(msg.sender, msg.kind, str(out.body.get("reason", "")), notify=False)
                return reply  # a refusal changed nothing, so a repeat may be answered afresh
            with self._lock:
                self._replies.put(msg.sender, msg.seq, CacheEntry(digest, reply))
            return reply
        finally:
            if not open_:
                with self._lock:
                    self._busy.pop(key, None)

    def _answer_others(self, out: Outgoing, key: tuple[str, int]) -> Message | None:
        """Send every message of ``out`` but the reply to ``key`` (each answers its device's open request,
        in order); that reply, if it is there."""
        own = None
        for device, m in out:
            if own is None and (device, m.seq) == key:
                own = m
                continue
            try:
                self.answer(device, m)
            except TransportError as exc:  # its requester times out, as for any reply lost on the way
                log.warning("%s: the reply to %r's request %d was not delivered: %s", self.me, device, m.seq, exc)
        return own

    def register(self, handler: MessageHandler) -> None:
        """Serve ``handler`` at this peer's own address on its transport."""
        self.transport.register(self.me, self.serve(handler))

    # -------------------------------------------------------------- helpers

    def format_for(self, msg: Message, fmt: str | None = None) -> str:
        """The tensor encoding ``msg`` travels in: ``fmt`` (default ``tensor_format``) for per-batch tensors
        only, else raw."""
        fmt = fmt or self.tensor_format
        if fmt == "raw" or msg.kind not in LOSSY_KINDS:
            return "raw"
        for name, value in msg.body.items():
            if name not in LOSSY_FIELDS and _holds_float(value):
                return "raw"
        return fmt

    def _encode(self, msg: Message, fmt: str | None = None) -> bytes:
        data = encode(msg, tensor_format=self.format_for(msg, fmt))
        with self._lock:
            self.encoded_bytes[msg.kind] += len(data)
        return data

    def _check_run(self, env: Envelope) -> None:
        if env.run != self.run:
            raise RemoteProtocolError(f"{env.kind!r} from {env.sender!r:.140} is for run {env.run!r:.140}, not {self.run!r}")

    def _check_envelope(self, env: Envelope, seen: str | None) -> None:
        """Before the body is decoded: this run, the sender the transport saw, then the role's ``admit``."""
        self._check_run(env)
        self._check_sender(env, seen)
        if self.admit is not None:
            self.admit(env)

    @property
    def cached_bytes(self) -> int:
        """Bytes the reply cache holds (large replies plus a fixed cost per entry)."""
        return self._replies.bytes

    @staticmethod
    def _check_sender(env: Envelope, seen: str | None) -> None:
        if seen is not None and env.sender != seen:
            raise RemoteProtocolError(
                f"{env.kind!r} claims sender {env.sender!r:.140} but arrived from {seen!r}: rejected"
            )

    def _error_reply(self, e: RemoteProtocolError, round: int, sender: str, kind: str) -> bytes:
        with self._lock:
            self.errors += 1
        reason = str(e)[:_MAX_REASON]
        self._count_rejection(sender, kind, reason)
        return encode(self.message("error", round, {"reason": reason}), tensor_format=self.tensor_format)

    def _count_rejection(self, sender: str, kind: str, reason: str, *, notify: bool = True) -> None:
        """Count an error reply to ``sender``; the log and ``on_reject`` hear of it through the throttle."""
        with self._lock:
            self.rejections[sender] += 1
            n = self.rejections[sender]
            while len(self.rejections) > 4 * self._max_senders:  # unknown senders cannot grow it forever
                del self.rejections[next(iter(self.rejections))]
        if not notify:
            return
        ok, due = self.log_throttle.hit(("rejected", sender))
        self._summarise(due)
        if ok:
            log.warning("%s: rejected %r from %r (%d so far): %s", self.me, kind, sender, n, reason)
            self._tell(sender, kind, f"{reason} ({n} rejections of this sender so far)" if n > 1 else reason)

    def flush_log(self) -> None:
        """Write the summaries the log throttle still owes (at the end of a run)."""
        self._summarise(self.log_throttle.flush())

    def _summarise(self, due: list[Summary]) -> None:
        """What the throttle held back, one line per sender (kind ``*`` for on_reject)."""
        for s in due:
            who = s.key[1] if isinstance(s.key, tuple) else describe(s.key)
            scope = f" of {s.keys} senders" if s.keys > 1 else ""
            note = f"{s.suppressed} more rejections{scope} not logged in the last {s.seconds:.0f} s"
            log.warning("%s: %s from %r", self.me, note, who)
            self._tell(str(who), "*", note)

    def _tell(self, sender: str, kind: str, reason: str) -> None:
        hook = self.on_reject
        if hook is not None:
            try:
                hook(sender, kind, reason)
            except Exception:  # a broken log must not turn a refusal into a crash (ours: keep the traceback)
                log.exception("%s: on_reject hook failed", self.me)


def _holds_float(v: Any, depth: int = 0) -> bool:
    """Whether ``v`` is or holds a floating numpy array (which a lossy format would round)."""
    if isinstance(v, np.ndarray):
        return v.dtype.kind == "f"
    if depth > 32:  # the codec refuses deeper bodies anyway
        return False
    if isinstance(v, dict):
        return any(_holds_float(x, depth + 1) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_holds_float(x, depth + 1) for x in v)
    return False
