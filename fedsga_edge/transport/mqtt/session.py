"""One broker connection: whether it is up, the topics we want and those the broker acknowledged.

paho reconnects by itself; on every (re)connect the session resubscribes everything wanted and
announces ``online``, so callers only ever ask for topics once and wait for their SUBACK.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from ..base import TransportError
from .connection import ReturnCodes
from .presence import Presence

__all__ = ["Session"]

log = logging.getLogger(__name__)


class Session:
    """Connection and subscription state, kept by paho's callbacks (network thread).

    ``lock`` is the transport's, so subscription changes are atomic with the rest of its state
    (which addresses are registered, whether it is closed); ``cond`` wakes those waiting for a SUBACK.
    """

    def __init__(self, client: Any, codes: ReturnCodes, presence: Presence, lock: threading.RLock,
                 client_id: str) -> None:
        self.client = client
        self.codes = codes
        self.presence = presence
        self.client_id = client_id
        self.lock = lock
        self.cond = threading.Condition(lock)
        self.closed = False
        self.connected = False
        self.connect_error: str | None = None
        self.ever_connected = threading.Event()
        self.subs: set[str] = set()  # topics we want
        self.acked: set[str] = set()  # ... and the broker confirmed on this connection
        self.sub_mids: dict[int, list[str]] = {}
        self.sub_failed: dict[str, str] = {}
        presence.arm(client)
        client.on_connect = self._on_connect
        client.on_connect_fail = self._on_connect_fail
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe

    def connect(self, host: str, port: int, keepalive: int, timeout: float) -> None:
        """Start paho's network thread and wait up to ``timeout`` for the first connection."""
        self.client.connect_async(host, port, keepalive=keepalive)
        self.client.loop_start()
        if not self.ever_connected.wait(timeout) or self.connect_error and not self.connected:
            why = self.connect_error or "no answer"
            self.client.loop_stop()
            raise TransportError(f"could not connect to mqtt broker {host}:{port} within {timeout:g} s: {why}")

    def check_open(self) -> None:
        if self.closed:
            raise TransportError("transport is closed")

    def subscribe(self, topics: list[str], deadline: float) -> None:
        """Make sure ``topics`` are subscribed on this connection; wait for the SUBACK."""
        with self.lock:
            new = [t for t in topics if t not in self.subs]
            self.subs.update(new)
            if new and self.connected:
                # Under our lock, so the SUBACK (handled under it too) cannot beat the mid's record.
                # Safe: paho calls no callback from a caller's thread while its loop thread runs.
                rc, mid = self.client.subscribe([(t, 1) for t in new])
                if rc == self.codes.ok and mid is not None:
                    self.sub_mids[mid] = new
        with self.cond:
            while not set(topics) <= self.acked:
                failed = [f"{t}: {self.sub_failed[t]}" for t in topics if t in self.sub_failed]
                if failed:
                    raise TransportError(f"broker refused subscription {'; '.join(failed)}")
                left = deadline - time.monotonic()
                if self.closed:
                    raise TransportError("transport is closed")
                if left <= 0:
                    state = "connected" if self.connected else "not connected"
                    raise TransportError(f"no SUBACK for {topics} in time ({state})")
                self.cond.wait(left)

    def forget(self, topics: list[str]) -> None:
        """Stop wanting ``topics`` (the caller unsubscribes once its other state is consistent)."""
        with self.lock:
            self.subs.difference_update(topics)
            self.acked.difference_update(topics)

    def unsubscribe(self, topics: list[str]) -> None:
        self.client.unsubscribe(topics)

    def wait_ready(self, timeout: float) -> bool:
        """Wait until connected and every wanted subscription is acknowledged (e.g. after a reconnect)."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while not (self.connected and self.subs <= self.acked):
                left = deadline - time.monotonic()
                if left <= 0 or self.closed:
                    return False
                self.cond.wait(left)
            return True

    def begin_close(self) -> tuple[list[str], bool] | None:
        """Mark closed and wake every waiter; (wanted topics, connected), or None if already closed."""
        with self.cond:
            if self.closed:
                return None
            self.closed = True
            self.cond.notify_all()
            return sorted(self.subs), self.connected

    def shutdown(self, subs: list[str], connected: bool) -> None:
        """Unsubscribe, publish ``offline`` and disconnect cleanly; stop paho's network thread."""
        if connected:
            try:
                if subs:  # a persistent session would otherwise keep queueing for us
                    self.client.unsubscribe(subs)
                self.presence.offline(self.client)
            except (RuntimeError, ValueError) as e:  # lost the connection while closing
                log.debug("%s: offline not confirmed: %s", self.client_id, e)
        self.client.disconnect()
        self.client.loop_stop()

    # ------------------------------------------------------------- paho callbacks (network thread)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        try:
            if reason.is_failure:
                self.connect_error = f"broker refused the connection: {reason}"
                log.error("%s: %s", self.client_id, self.connect_error)
                self.ever_connected.set()  # wake the constructor: retrying will not fix credentials
                return
            _no_delay(client)
            with self.cond:
                self.connected = True
                self.connect_error = None
                self.acked.clear()
                self.sub_failed.clear()
                self.sub_mids.clear()
                topics = sorted(self.subs)
                if topics:
                    rc, mid = client.subscribe([(t, 1) for t in topics])
                    if rc == self.codes.ok and mid is not None:
                        self.sub_mids[mid] = topics
                self.cond.notify_all()
            self.presence.online(client)
            self.ever_connected.set()
            log.info("%s: connected (session present: %s)", self.client_id, flags.session_present)
        except Exception:
            log.exception("%s: on_connect failed", self.client_id)

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        self.connect_error = "connection failed (broker down or unreachable, or TLS handshake failed?)"

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        with self.cond:
            self.connected = False
            self.acked.clear()
            self.cond.notify_all()
        if not self.closed:
            log.warning("%s: disconnected (%s); reconnecting", self.client_id, reason)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, properties: Any) -> None:
        with self.cond:
            topics = self.sub_mids.pop(mid, [])
            for t, rc in zip(topics, reasons):
                if rc.is_failure:
                    self.sub_failed[t] = str(rc)
                elif t in self.subs:
                    self.acked.add(t)
            self.cond.notify_all()


def _no_delay(client: Any) -> None:
    """TCP_NODELAY: paho leaves Nagle on, and a small PUBACK followed by a reply then waits for
    the peer's delayed ACK (~40 ms per hop; a 100-byte round trip took 88 ms instead of ~1)."""
    sock = client.socket()
    try:
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    except OSError as e:  # pragma: no cover - e.g. a proxy socket
        log.debug("TCP_NODELAY not set: %s", e)
