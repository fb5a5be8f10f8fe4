"""The round as a state machine with no I/O (after h11): who is in it, what each has sent, when it ends.

Drivers (the simulation's scheduler, a network transport) feed it events; it never waits. The
allowed transitions sit in one table, so an illegal event is a lookup miss turned into an error
that names the device and the phase.

    phase      event        -> phase
    idle       begin           training
    training   request         training      (activation, probe, fetch from a device still training)
    training   update          training      (closed once every device has sent or failed)
    training   fail            training
    training   expire          closed        (deadline passed: missing devices become failures)
    training   close           closed
    closed     begin           training

Inside a training round each device walks its own sequence (``DEVICE_STEPS``): the weights it
lacks (``fetch``), one ``activation`` per local batch, at most one ``probe`` after training (FedSGA's
calibration rounds), then its ``update``; ``error`` (it gives up) is allowed at any step. A request
out of that order is the device's fault: a ``RoundError``, refused without touching any state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedsga_edge.wire import RemoteProtocolError

__all__ = ["RoundState", "RoundError"]

_TRANSITIONS: dict[tuple[str, str], str] = {
    ("idle", "begin"): "training",
    ("closed", "begin"): "training",
    ("training", "request"): "training",
    ("training", "update"): "training",
    ("training", "fail"): "training",
    ("training", "expire"): "closed",
    ("training", "close"): "closed",
}


# (device's step, request kind) -> its next step. "done" and "failed" are final for the round.
DEVICE_STEPS: dict[tuple[str, str], str] = {
    ("started", "fetch"): "fetched",
    ("started", "activation"): "training",
    ("fetched", "activation"): "training",
    ("training", "activation"): "training",
    # federated evaluation (device/evaluate.py): after the weights, before training, one request per batch
    ("started", "evaluate"): "evaluating",
    ("fetched", "evaluate"): "evaluating",
    ("evaluating", "evaluate"): "evaluating",
    ("evaluating", "activation"): "training",
    ("evaluating", "probe"): "probed",
    ("evaluating", "update"): "done",
    ("started", "probe"): "probed",  # a device with nothing to train may still be probed
    ("fetched", "probe"): "probed",
    ("training", "probe"): "probed",
    ("started", "update"): "done",
    ("fetched", "update"): "done",
    ("training", "update"): "done",
    ("probed", "update"): "done",
    **{(step, "error"): "failed" for step in ("started", "fetched", "evaluating", "training", "probed")},
}


DEVICE_KINDS = ("hello", "describe", "bye", "fetch", "activation", "evaluate", "probe", "update", "error")  # what a device may send
ROUND_KINDS = ("fetch", "activation", "evaluate", "probe", "update", "error")  # only inside the round they name


class RoundError(RemoteProtocolError):
    """An event that the round's phase, membership or the device's sequence does not allow (the sender's fault)."""


@dataclass
class RoundState:
    t: int = 0
    phase: str = "idle"
    assigned: dict[str, int | None] = field(default_factory=dict)  # device -> split (None: it chooses)
    calibrate: bool = False
    deadline: float | None = None
    updates: dict[str, dict[str, Any]] = field(default_factory=dict)
    failures: dict[str, str] = field(default_factory=dict)
    steps: dict[str, str] = field(default_factory=dict)  # device -> its step in DEVICE_STEPS

    def _move(self, event: str) -> None:
        nxt = _TRANSITIONS.get((self.phase, event))
        if nxt is None:
            raise RoundError(f"{event!r} is not allowed while the round is {self.phase}")
        self.phase = nxt

    def begin(self, t: int, assigned: dict[str, int | None], calibrate: bool, deadline: float | None) -> None:
        self._move("begin")
        self.t, self.assigned, self.calibrate, self.deadline = t, dict(assigned), calibrate, deadline
        self.updates, self.failures = {}, {}
        self.steps = dict.fromkeys(self.assigned, "started")

    def check_request(self, device: str, round: int, kind: str) -> None:
        """A request is allowed from a device of this round that has not finished it, in its sequence."""
        if self.phase != "training":
            raise RoundError(f"no round is running (round {self.t} is {self.phase})")
        if round != self.t:
            raise RoundError(f"message for round {round}, but round {self.t} is running")
        if device not in self.assigned:
            raise RoundError(f"{device!r} is not a device of round {self.t}")
        if device in self.updates:
            raise RoundError(f"{device!r} already sent its update for round {self.t}")
        if device in self.failures:
            raise RoundError(f"{device!r} was dropped from round {self.t}: {self.failures[device]}")
        step = self.steps.get(device, "started")
        if (step, kind) not in DEVICE_STEPS:
            raise RoundError(f"{kind!r} is not allowed after {device!r}'s {step!r} step in round {self.t}")
        self._move("request")

    def check_envelope(self, sender: str, kind: str, round: int, devices: Any) -> None:
        """What an envelope alone can tell, before its body (its tensors) is decoded: a device of the
        run, a kind a device sends, a round message for the running round. ``check_request`` checks
        again, with the device's sequence, once the body is there."""
        if sender not in devices:
            raise RoundError(f"unknown device {sender!r:.140}: not a device of this run")
        if kind not in DEVICE_KINDS:
            raise RoundError(f"a device does not send {kind!r:.40}")
        if kind in ROUND_KINDS and self.phase != "training":
            raise RoundError(f"no round is running (round {self.t} is {self.phase})")
        if kind in ROUND_KINDS and round != self.t:
            raise RoundError(f"message for round {round}, but round {self.t} is running")

    def advance(self, device: str, kind: str) -> None:
        """The device's request was answered: move it along its sequence."""
        nxt = DEVICE_STEPS.get((self.steps.get(device, "started"), kind))
        if nxt is not None:
            self.steps[device] = nxt

    def accept_update(self, device: str, body: dict[str, Any]) -> None:
        self._move("update")
        self.updates[device] = body

    def fail(self, device: str, reason: str) -> None:
        if self.phase == "training" and device in self.assigned and device not in self.updates:
            self._move("fail")
            self.failures.setdefault(device, reason)

    @property
    def waiting(self) -> list[str]:
        return [d for d in self.assigned if d not in self.updates and d not in self.failures]

    @property
    def complete(self) -> bool:
        return self.phase == "training" and not self.waiting

    def expire(self, now: float) -> bool:
        """Close the round if its deadline has passed; True when it did."""
        if self.phase != "training" or self.deadline is None or now < self.deadline:
            return False
        for d in self.waiting:
            self.failures[d] = "missed the round deadline"
        self._move("expire")
        return True

    def close(self) -> None:
        self._move("close")
