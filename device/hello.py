"""The device's hellos: registering with the coordinator, and asking its round after a far-ahead round_start.

Registration (``backend``, ``num_samples``, capabilities, rounds done, a latency profile) is retried while the coordinator
is unreachable (a hello sent before it subscribed is lost, not late), until acked, refused or out of
time. The ack may name the coordinator's round, which the device takes as confirmed (``device.guard``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from fedsga_edge.runfiles import JsonLog
from fedsga_edge.transport import Peer, TransportError
from fedsga_edge.wire import RemoteProtocolError

from .orders import OrderCheck
from .progress import Progress

__all__ = ["Hello", "RegistrationRefused"]


class RegistrationRefused(Exception):
    """The coordinator answered the hello with an error: retrying would not change its answer."""


class Hello:
    """Who to greet and how: the peer and coordinator, the body to send, where acks and errors are recorded."""

    def __init__(self, peer: Peer, server: str, log: JsonLog, progress: Progress, orders: OrderCheck,
                 body: Callable[[], dict[str, Any]], stop: threading.Event) -> None:
        self.peer = peer
        self.server = server
        self.log = log
        self.progress = progress
        self.orders = orders
        self.body = body
        self.stop = stop

    def register(self, timeout: float, retry_s: float) -> dict[str, Any]:
        """Say hello until acked; RegistrationRefused on an error reply, TimeoutError when out of time."""
        deadline = time.monotonic() + timeout
        body = self.body()
        wait, attempts = retry_s, 0
        while True:
            attempts += 1
            left = deadline - time.monotonic()
            try:
                # 10 s a try: a hello sent before the coordinator subscribed is lost, not late
                reply = self.peer.call(self.server, "hello", 0, body, timeout=max(min(left, 10.0), 0.1))
            except (TransportError, RemoteProtocolError) as exc:  # coordinator not up yet, or a blip
                last = f"{type(exc).__name__}: {exc}"
            else:
                if reply.kind == "ack":
                    self.progress.registered = True
                    self.orders.confirm_from_ack(reply)
                    self.log.info("registered", attempts=attempts, ack=reply.body)
                    return dict(reply.body)
                reason = str(reply.body.get("reason", reply.kind))
                self.progress.last_error = f"registration refused: {reason}"
                self.log.error("registration_refused", reason=reason)
                raise RegistrationRefused(reason)
            if self.stop.is_set() or time.monotonic() + wait > deadline:
                self.progress.last_error = f"not registered after {attempts} attempts: {last}"
                self.log.error("registration_timeout", attempts=attempts, error=last[:300])
                raise TimeoutError(self.progress.last_error)
            if attempts == 1:
                self.log.warning("hello_retry", error=last[:300])
            time.sleep(wait)
            wait = min(wait * 2, 5.0)

    def verify(self, t: int) -> None:
        """After a far-ahead round_start for ``t``, ask the coordinator (hello) which round it is in. A real one
        moves the bound, so a device that lagged that far takes part again from the next round_start on; a
        forged one changes nothing (its body was never decoded, so it is not run either way)."""
        try:
            reply = self.peer.call(self.server, "hello", 0, self.body(), timeout=10.0)
        except (TransportError, RemoteProtocolError) as exc:
            self.log.warning("round_start_unconfirmed", round=t, error=f"{type(exc).__name__}: {exc}"[:300])
            return
        now = self.orders.confirm_from_ack(reply) if reply.kind == "ack" else None
        if now is None or now < t:
            self.log.warning("round_start_unconfirmed", round=t, coordinator_round=now, reply=str(reply.kind)[:40])
        else:
            self.log.info("round_start_confirmed", round=t, coordinator_round=now)
