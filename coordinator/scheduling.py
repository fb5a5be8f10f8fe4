"""How a round's devices make progress: a scheduler advances them until the round is over.

The round driver (coordinator/driver.py) starts a round and closes it; between the two it hands
over to its scheduler:

- ``InProcessScheduler`` (``simulate``): the devices live in this process; each turn advances one
  device by one request (one local batch) in ``round_robin``, ``random`` or ``sequential`` order,
  so the coordinator answers activations interleaved as it would from real devices. The devices
  take their turns in a permutation drawn per round from the run's seed (``--device-order
  shuffled``), or in partition order every round (``fixed``): with a fixed order client-000 always
  steps the shared server copy first and the last device always last (docs/method.md, "Rounds").
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

__all__ = ["Scheduler", "InProcessScheduler", "MessageScheduler", "DEVICE_ORDER_STREAM", "round_order"]

# The device order's own random stream: np.random.default_rng([seed, t, DEVICE_ORDER_STREAM]). Its
# own stream, so drawing an order moves no other random draw (the random schedule's, the strategies').
DEVICE_ORDER_STREAM = 19


def round_order(n: int, t: int, seed: int, order: str = "shuffled") -> list[int]:
    """Indices (into partition order) of the ``n`` devices in the order they take round ``t``'s turns:
    a permutation that depends only on ``(seed, t)`` for ``shuffled``, ``0..n-1`` for ``fixed``."""
    if order == "fixed":
        return list(range(n))
    if order != "shuffled":
        raise ValueError(f"device order must be shuffled or fixed, got {order!r}")
    return [int(i) for i in np.random.default_rng([seed, t, DEVICE_ORDER_STREAM]).permutation(n)]


class Scheduler(Protocol):
    lock: ContextManager[Any]  # held around every call into the Coordinator

    def ready(self, first: int) -> None:
        """Before round ``first``, the first this process runs: have devices to start."""

    def devices(self, t: int) -> list[str]:
        """The devices to start in round ``t``, in partition order; none ends the run."""

    def advance(self, co: Any, clock: Clock) -> None:
        """Advance devices until ``co.tick(clock.now())`` says round is over (called under ``lock``)."""


class InProcessScheduler:
    """Steps in-process device roles (``step``, ``abort``, ``busy``, ``cid``, ``last_error``) in turn.

    ``order``/``seed``: the round's device order (``round_order``). It only orders the turns: the
    devices started, and so the strategy's assignment, stay the partition-ordered list of ``devices``.
    """

    def __init__(self, clients: Sequence[Any], schedule: str, rng: np.random.Generator, *,
                 order: str = "fixed", seed: int = 0) -> None:
        self.clients = list(clients)
        self.schedule = schedule
        self.rng = rng
        self.order, self.seed = order, seed
        round_order(len(self.clients), 1, seed, order)  # refuse an unknown order now, not at round 1
        self.lock: ContextManager[Any] = contextlib.nullcontext()  # one thread: nothing to exclude

    def turn_order(self, t: int) -> list[Any]:
        """The device roles in the order they take round ``t``'s turns."""
        return [self.clients[i] for i in round_order(len(self.clients), t, self.seed, self.order)]

    def ready(self, first: int) -> None:
        pass

    def devices(self, t: int) -> list[str]:
        return [c.cid for c in self.clients]

    def advance(self, co: Any, clock: Clock) -> None:
        active = [c for c in self.turn_order(co.round.t) if c.busy]
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
