"""The clock a round driver reads deadlines and round durations from.

A field run lives in real time (``MonotonicClock``). A simulation runs its devices one request at
a time in one process, so real time would charge each device for the others' work; it keeps a
``VirtualClock`` that the scheduler advances by the work each device step did (measured, or a
fixed cost per step when a test wants deadlines that fall at the same request every run). With a
fleet (``simulate --fleet``) the scheduler instead ``set``s it to each request's arrival time.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "MonotonicClock", "VirtualClock"]


class Clock(Protocol):
    def now(self) -> float:
        """Seconds on this clock (only differences mean anything)."""

    def advance(self, seconds: float) -> None:
        """``seconds`` of device work were just done (a real clock has already moved)."""


class MonotonicClock:
    """Real time: ``time.monotonic``; ``advance`` does nothing."""

    def now(self) -> float:
        return time.monotonic()

    def advance(self, seconds: float) -> None:
        pass


class VirtualClock:
    """Time that passes only when the scheduler says work was done.

    ``per_step=None`` advances by the measured seconds of each device step; a number advances by
    that much per step instead, whatever the step took (deterministic deadlines).
    """

    def __init__(self, start: float = 0.0, *, per_step: float | None = None) -> None:
        self.t = float(start)
        self.per_step = per_step

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds if self.per_step is None else self.per_step

    def set(self, t: float) -> None:
        """Jump to virtual time ``t``: the next event of a discrete-event schedule (``FleetScheduler``,
        coordinator/scheduling.py), whose time comes from the fleet's model, not from measured work."""
        if t < self.t:
            raise ValueError(f"a virtual clock does not go back ({t} < {self.t})")
        self.t = float(t)
