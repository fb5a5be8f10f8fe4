"""How far ahead of what the coordinator confirmed a device takes a round.

A ``round_start`` is a one-way message: on an open broker (or with a stolen coordinator login) anybody
can publish one on a device's down topic. A reply to the device's own request is stronger evidence: it
answers a request id the device chose, on the topic only the coordinator's login may write. So the
device bounds how far a round_start may lead the newest round the coordinator *confirmed* (answered a
request of, acked at hello, or completed): a forged round 2^64-1 is refused instead of making every
real round look stale (docs/protocol.md, "Faults").
"""

from __future__ import annotations

__all__ = ["MAX_ROUNDS_AHEAD", "VERIFY_EVERY_S", "RoundGuard"]

# How far a round_start may lead the newest confirmed round. An honest coordinator sends round t+1
# after round t, and a device confirms a round as soon as its first request is answered; it lags more
# only when it got no answer for many rounds in a row (its uplink down while round_starts still arrive).
# 100 rounds is hours of that at any useful deadline, yet far below 2^64; a device past it asks the
# coordinator (hello), and once the ack names that round it takes the next round_start.
MAX_ROUNDS_AHEAD = 100
VERIFY_EVERY_S = 30.0  # at most one such hello per this many seconds: forged round_starts cannot flood the coordinator


class RoundGuard:
    """The newest round the coordinator confirmed, and the furthest round a round_start may name."""

    def __init__(self, confirmed: int = 0, ahead: int = MAX_ROUNDS_AHEAD) -> None:
        self.confirmed = confirmed
        self.ahead = ahead

    def confirm(self, t: int) -> None:
        self.confirmed = max(self.confirmed, int(t))

    @property
    def horizon(self) -> int:
        return self.confirmed + self.ahead

    def too_far(self, t: int, kind: str = "round_start") -> str | None:
        """Why a ``kind`` for round ``t`` is refused (None: within the bound)."""
        if t <= self.horizon:
            return None
        return (f"{kind} for round {t} is more than {self.ahead} rounds ahead of round {self.confirmed}, the newest "
                "the coordinator confirmed to this device")
