"""A transport whose every payload is sealed for its recipient and opened before anyone reads it.

``SealedTransport`` wraps any transport (loopback, MQTT) with a ``Keyring`` (fedsga_edge/wire/auth.py):
what goes out is sealed for its destination (a request, a one-way message, a reply: for the requester),
and what comes in is opened first. A frame that fails (no MAC, a wrong or unknown key, addressed to
someone else) never reaches the Peer's decoder: it is dropped, counted in ``refused`` and logged
(throttled), and a request gets a plain ``error`` reply naming the problem, so a device without a
valid key learns why it is refused. The Peer above sees the frame's verified sender as the observed
sender, so a message whose envelope names another sender is refused like one from the wrong topic;
where the inner transport knows the sender too (MQTT's topic), the two must agree.

So the broker carries only sealed frames: a login that reads ``#`` sees the addresses and sizes, and
with ``encrypt`` nothing of a tensor; a forged ``bye`` or ``round_start`` is refused on any transport.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

from ..logthrottle import Throttle
from ..wire import Message, RemoteProtocolError, decode, encode
from ..wire.auth import Keyring
from .base import Handler, OpenRequest, PendingReply, Transport

__all__ = ["SealedTransport"]

log = logging.getLogger(__name__)
RefuseHook = Callable[[str, str, str], None]


class _OpenedReply(PendingReply):
    """A pending reply whose bytes are opened when they come (loopback's open requests)."""

    __slots__ = ("_inner", "_open")

    def __init__(self, inner: PendingReply, open_: Callable[[bytes], bytes]) -> None:
        super().__init__()
        self._inner, self._open = inner, open_

    @property
    def ready(self) -> bool:
        return self._inner.ready

    @property
    def nbytes(self) -> int:
        return self._inner.nbytes

    def wait(self, timeout: float | None = None) -> bytes:
        return self._open(self._inner.wait(timeout))


class SealedTransport:
    """``inner`` with every payload sealed by ``keyring`` (module doc); ``run`` names refusals' replies."""

    def __init__(self, inner: Transport | Any, keyring: Keyring, run: str, *,
                 on_reject: RefuseHook | None = None) -> None:
        self._inner, self.keyring, self.run = inner, keyring, run
        self.on_reject = on_reject  # (sender, kind, reason) of each refused frame, as Peer's hook
        self.refused: Counter[str] = Counter()  # refused frames by claimed sender
        self._throttle = Throttle()
        self._local = threading.local()
        self._lock = threading.Lock()

    # -- out ------------------------------------------------------------------------------------------
    def request(self, src: str, dst: str, payload: bytes, *, timeout: float | None = None) -> Any:
        raw = self._inner.request(src, dst, self.keyring.seal(dst, payload), timeout=timeout)
        if isinstance(raw, PendingReply):
            return _OpenedReply(raw, lambda b: self._open_reply(dst, b))
        return self._open_reply(dst, raw)

    def send(self, src: str, dst: str, payload: bytes) -> None:
        self._inner.send(src, dst, self.keyring.seal(dst, payload))

    def reply(self, src: str, token: OpenRequest, payload: bytes) -> None:
        self._inner.reply(src, token, self.keyring.seal(token.sender, payload))

    # -- in -------------------------------------------------------------------------------------------
    def register(self, address: str, handler: Handler) -> None:
        self._inner.register(address, self._opening(handler))

    def observed_sender(self) -> str | None:
        """Inside a handler: the sender whose key opened the payload being handled."""
        return getattr(self._local, "sender", None)

    def _opening(self, handler: Handler) -> Handler:
        inner_seen = getattr(self._inner, "observed_sender", None)

        def on_bytes(data: bytes) -> Any:
            try:
                sender, payload = self.keyring.open(data)
                seen = inner_seen() if inner_seen is not None else None
                if seen is not None and seen != sender:
                    raise RemoteProtocolError(f"sealed by {sender!r} but arrived from {seen!r}: refused")
            except RemoteProtocolError as exc:
                return self._refuse(data, exc)
            before, self._local.sender = getattr(self._local, "sender", None), sender
            try:
                out = handler(payload)
            finally:
                self._local.sender = before  # a nested delivery (loopback) hands the outer one back
            if isinstance(out, (bytes, bytearray, memoryview)):
                return self.keyring.seal(sender, bytes(out))
            return out

        return on_bytes

    def _open_reply(self, dst: str, raw: bytes) -> bytes:
        try:
            sender, payload = self.keyring.open(raw)
        except RemoteProtocolError as exc:
            raise RemoteProtocolError(f"the reply from {dst!r} is refused: {exc}{_plain_reason(raw)}") from None
        if sender != dst:
            raise RemoteProtocolError(f"the reply to a request to {dst!r} was sealed by {sender!r}: refused")
        return payload

    def _refuse(self, data: bytes, exc: RemoteProtocolError) -> bytes:
        """Count and log a frame that did not open; a plain ``error`` naming why (no key, no secret in it)."""
        who = self.keyring.sender_of(data) or "?"
        reason = str(exc)
        with self._lock:
            self.refused[who] += 1
            while len(self.refused) > 4096:
                del self.refused[next(iter(self.refused))]
        ok, _ = self._throttle.hit(("refused", who))
        if ok:
            log.warning("%s: refused a frame claiming %r: %s", self.keyring.me, who, reason)
            hook = self.on_reject
            if hook is not None:
                try:
                    hook(who, "?", reason)
                except Exception:  # a broken log must not turn a refusal into a crash
                    log.exception("%s: on_reject hook failed", self.keyring.me)
        return encode(Message(kind="error", run=self.run, round=0, seq=0, sender=self.keyring.me,
                              body={"reason": reason[:1000]}))

    # -- the rest is the inner transport's ----------------------------------------------------------------
    def unregister(self, address: str) -> None:
        self._inner.unregister(address)

    def close(self) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def _plain_reason(raw: bytes) -> str:
    """What a plain ``error`` reply says (a peer that could not open our frame): shown, never acted on."""
    try:
        msg = decode(raw)
    except Exception:
        return ""
    if msg.kind != "error":
        return ""
    return f" (it said: {str(msg.body.get('reason', ''))[:300]})"
