"""The device's checks of the orders it gets: only its coordinator gives them, and only within the bound.

On an open broker (or with a stolen login) anybody can publish on a device's down topic. So an order
must come from the coordinator (the claimed sender and, where the transport observes one, the real
sender), be a ``round_start`` or a ``bye``, and name a round within ``MAX_ROUNDS_AHEAD`` of the newest
round the coordinator confirmed (``device.guard``). The checks run as the Peer's admit hook, on the
envelope, so a forged far-ahead round_start is refused before its weights are decoded. Refusals are
counted (``health()``) and logged to ``agent.log``, throttled per event and sender.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import NoReturn

from fedsga_edge.logthrottle import Throttle, describe
from fedsga_edge.runfiles import JsonLog
from fedsga_edge.transport import Peer
from fedsga_edge.wire import Envelope, Message, RemoteProtocolError

from .guard import VERIFY_EVERY_S, RoundGuard
from .role import SplitClient

__all__ = ["OrderCheck"]


class OrderCheck:
    """The round guard, refusal counts and log throttle, and the far-ahead round still to ask the coordinator about."""

    def __init__(self, client: SplitClient, peer: Peer, server: str, log: JsonLog) -> None:
        self.client = client
        self.peer = peer
        self.server = server
        self.log = log
        self.guard = RoundGuard()
        self.refused: Counter[str] = Counter()  # orders refused, by event (health() reports them)
        self.pending: int | None = None  # the round of a round_start too far ahead, to check with the coordinator
        self._verify_after = 0.0
        self._throttle = Throttle()  # which refusals reach agent.log: per event and sender, per minute
        self._lock = threading.Lock()
        self._tls = threading.local()

    def check(self, msg: Envelope | Message) -> None:
        """Only the coordinator (claimed and, where the transport observes one, real sender) gives orders:
        a ``round_start`` or a ``bye``, for a round within the bound (``device.guard``)."""
        cid = self.client.cid
        seen = self._observed_sender()
        if msg.sender != self.server or (seen is not None and seen != self.server):
            came = f" (arrived from {seen!r:.140})" if seen is not None and seen != msg.sender else ""
            self.refuse("order_refused", msg,
                        f"{cid} takes orders only from {self.server!r}, not {msg.sender!r:.140}{came}")
        if msg.kind not in ("round_start", "bye"):
            self.refuse("order_refused", msg, f"device {cid} does not accept {msg.kind!r:.40}")
        problem = self.guard.too_far(msg.round, msg.kind) if msg.round > self.confirmed() else None
        if problem is not None:  # a forged round_start would make every real round look stale
            if msg.kind == "round_start":
                self._ask_coordinator(msg.round)
            self.refuse(f"{msg.kind}_refused", msg, problem)

    def refuse(self, event: str, msg: Envelope | Message, reason: str) -> NoReturn:
        """Count, log (throttled) and raise: the Peer answers with an error, or drops it when it came one-way."""
        sender = str(msg.sender)[:140]
        with self._lock:
            self.refused[event] += 1
            n = self.refused[event]
        ok, due = self._throttle.hit((event, sender))
        for summary in due:
            self.log.warning("refusals_not_logged", what=describe(summary.key)[:200], count=summary.suppressed,
                             seconds=round(summary.seconds))
        if ok:
            self.log.warning(event, round=msg.round, kind=str(msg.kind)[:40], sender=sender, reason=reason[:300],
                             count=n)
        self._tls.logged = reason  # the Peer reports this refusal to peer_rejected too: logged once
        raise RemoteProtocolError(reason)

    def peer_rejected(self, sender: str, kind: str, reason: str) -> None:
        """The Peer's refusals (throttled by the Peer): undecodable, another run, a sender not its topic."""
        logged, self._tls.logged = getattr(self._tls, "logged", None), None
        if logged is not None and reason.startswith(logged[:200]):
            return
        self.log.warning("message_rejected", sender=str(sender)[:140], kind=str(kind)[:40], reason=reason[:300])

    def confirmed(self) -> int:
        """The newest round the coordinator confirmed: acked at hello, answered a request of, or completed."""
        self.guard.confirm(self.client.confirmed_round)
        return self.guard.confirmed

    def confirm_from_ack(self, reply: Message) -> int | None:
        """The coordinator's round in a hello ack (None when it names none)."""
        t = reply.body.get("round")
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            return None
        self.guard.confirm(t)
        return t

    def take_pending(self) -> int | None:
        """The far-ahead round to ask the coordinator about, once (None when there is none)."""
        with self._lock:
            t, self.pending = self.pending, None
        return t

    def _ask_coordinator(self, t: int) -> None:
        """Have the worker ask the coordinator's round after a far-ahead round_start (at most every VERIFY_EVERY_S)."""
        with self._lock:
            now = time.monotonic()
            if self.pending is None and now >= self._verify_after:
                self.pending, self._verify_after = t, now + VERIFY_EVERY_S

    def _observed_sender(self) -> str | None:
        """Who the transport saw send the message being handled (MQTT: its topic); None where it cannot tell."""
        observed = getattr(self.peer.transport, "observed_sender", None)
        return observed() if callable(observed) else None
