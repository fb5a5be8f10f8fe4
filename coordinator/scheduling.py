"""How a round's devices make progress: a scheduler advances them until the round is over.

The round driver (coordinator/driver.py) starts a round and closes it; between the two it hands
over to its scheduler:

- ``InProcessScheduler`` (``simulate``): the devices live in this process; each turn advances one
  device by one request (one local batch) in ``round_robin``, ``random`` or ``sequential`` order,
  so the coordinator answers activations interleaved as it would from real devices.
- ``MessageScheduler`` (the coordinator service): the devices are elsewhere and their messages
  arrive on transport threads; it waits on the service's Condition, which updates and errors
  notify, so a round ends as soon as its last device is done, or at the deadline.

Either way the scheduler reads ``Coordinator.tick(clock.now())``, which applies the deadline, and
its ``lock`` is held around every call into the Coordinator (which is not thread-safe).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ContextManager, Protocol

import numpy as np

from .clock import Clock

__all__ = ["Scheduler", "InProcessScheduler", "MessageScheduler"]


class Scheduler(Protocol):
    lock: ContextManager[Any]  # held around every call into the Coordinator

    def ready(self, first: int) -> None:
        """Before round ``first``, the first this process runs: have devices to start."""

    def devices(self, t: int) -> list[str]:
        """The devices to start in round ``t``, in partition order; none ends the run."""

    def advance(self, co: Any, clock: Clock) -> None:
        """Advance devices until ``co.tick(clock.now())`` says round is over (called under ``lock``)."""


class InProcessScheduler:
    """Steps in-process device roles (``step``, ``abort``, ``busy``, ``cid``, ``last_error``) in turn."""

    def __init__(self, clients: Sequence[Any], schedule: str, rng: np.random.Generator) -> None:
        self.clients = list(clients)
        self.schedule = schedule
        self.rng = rng
        self.lock: ContextManager[Any] = contextlib.nullcontext()  # one thread: nothing to exclude

    def ready(self, first: int) -> None:
        pass

    def devices(self, t: int) -> list[str]:
        return [c.cid for c in self.clients]

    def advance(self, co: Any, clock: Clock) -> None:
        active = [c for c in self.clients if c.busy]
        while active and not co.tick(clock.now()):
            if self.schedule == "sequential":
                client = active[0]
            elif self.schedule == "random":
                client = active[int(self.rng.integers(len(active)))]
            else:  # round-robin: one request per device in turn
                client = active.pop(0)
                active.append(client)
            started = time.perf_counter()
            more = self._step(co, client)
            clock.advance(time.perf_counter() - started)
            if not more:
                active.remove(client)
        for client in active:  # the deadline passed: what they still hold is dropped
            client.abort()

    @staticmethod
    def _step(co: Any, client: Any) -> bool:
        try:
            more = client.step()
        except Exception as exc:  # a broken device must not stop the round
            client.abort()
            co.fail(client.cid, f"{type(exc).__name__}: {exc}")
            return False
        if not more and client.last_error:
            co.fail(client.cid, client.last_error)
        return more


class MessageScheduler:
    """Waits for remote devices' messages; ``ready`` and ``devices`` come from whoever registers them."""

    def __init__(self, cond: threading.Condition, stop: threading.Event, *, ready: Callable[[int], None],
                 devices: Callable[[int], list[str]], poll_s: float = 0.05) -> None:
        self.lock: ContextManager[Any] = cond
        self._cond, self._stop, self.poll_s = cond, stop, poll_s
        self.ready, self.devices = ready, devices

    def advance(self, co: Any, clock: Clock) -> None:
        while not co.tick(clock.now()):
            if self._stop.is_set():
                for d in co.round.waiting:
                    co.fail(d, "coordinator stopped")
                break
            self._cond.wait(self.poll_s)
