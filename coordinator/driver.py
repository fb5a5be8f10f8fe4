"""The one round driver: ``simulate`` and the coordinator service run their rounds through it.

The ``Coordinator`` is a state machine that never waits (docs/method.md, "Rounds"). The driver
does one round around it the same way whatever the devices are:

1. ``begin_round`` at ``clock.now()`` for the scheduler's devices, then ``round_start`` to each
   over the Peer (a device it cannot reach fails, the round goes on);
2. the scheduler advances the devices until ``tick`` says the round is over (all done, or the
   deadline on the clock passed);
3. ``end_round`` (aggregation), the wire bytes each way, evaluation when
   ``t % eval_every == 0 or t == rounds``, the round's wall time;
4. after the last round, with ``--eval-holdout``, the final evaluation: an evaluation-only exchange
   (round ``rounds + 1``: round starts with ``evaluate_only``, the devices' held-out figures, no training)
   whose figures are the last round's ``fed_final``, so the final model has its own-data figure.

Every call into the Coordinator returns what it wants sent (``Outgoing``: device, message). The
round starts are new messages (``peer.send``); everything else answers a device's request. What a
device's message returns goes back to the Peer as the handler's result: the reply to that message is
sent as its reply, the others answer the open requests of other devices (MergeSFL's merged step,
released by this message); what ``tick``, ``fail`` and ``end_round`` return goes out through ``send``
(``Peer.answer``). So a held request always gets its gradient or, once the round is over, its refusal.

``run`` adds the run around the rounds: ``metrics.jsonl`` line by line, the checkpoint (after
every round when it is resumable, else once at the end) and ``summary.json``.

Two parameters make the difference between a simulation and a field run (coordinator/clock.py,
coordinator/scheduling.py): ``simulate`` passes a ``VirtualClock`` and an ``InProcessScheduler``
that steps its device roles; the service passes a ``MonotonicClock`` and a ``MessageScheduler``
that waits for the devices' messages.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from fedsga_edge.runfiles import JsonLog, RunFiles
from fedsga_edge.transport import Peer
from fedsga_edge.wire import Outgoing

from .checkpoint import CheckpointWriter
from .clock import Clock
from .scheduling import Scheduler

__all__ = ["CoordinatorBug", "Driven", "RoundDriver", "Summarize"]

Summarize = Callable[[list[dict[str, Any]], float], dict[str, Any]]


class CoordinatorBug(BaseException):
    """An exception of ours out of the Coordinator while it handled a device's message. In ``simulate``
    the device's own code sits between the coordinator and the driver (a loopback call runs the handler
    in the device's step) and takes any ``Exception`` for the device's failure; this carries the error
    past it, and ``run_round`` raises the original: the run fails with it instead of refusing anyone."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class Driven(Protocol):
    """What the driver needs of a Coordinator (coordinator/server.py); the checkpoint writer also
    reads ``model``, ``state_dict()`` and ``checkpoint_state()``."""

    cfg: Any  # RunConfig: rounds, eval_every, round_timeout
    clients: dict[str, int]  # device -> partition size, in partition order
    round: Any  # RoundState: calibrate, waiting

    def begin_round(self, t: int, now: float | None = None, devices: list[str] | None = None,
                    evaluate_only: bool = False) -> Outgoing: ...
    def receive(self, msg: Any, now: float | None = None) -> Outgoing: ...
    def tick(self, now: float | None = None) -> Outgoing: ...
    def fail(self, device: str, reason: str) -> Outgoing: ...
    def await_held(self) -> Outgoing: ...
    def end_round(self, now: float | None = None) -> tuple[dict[str, Any], Outgoing]: ...
    @property
    def round_complete(self) -> bool: ...
    def evaluate(self, images: Any, mean: tuple, std: tuple) -> dict[str, Any]: ...


class RoundDriver:
    """Runs rounds of one Coordinator over ``peer``, on ``clock``, with devices advanced by ``scheduler``."""

    def __init__(self, co: Driven, peer: Peer, clock: Clock, scheduler: Scheduler, *,
                 test: tuple[Any, tuple, tuple] | None = None, log: JsonLog | None = None,
                 checkpoints: CheckpointWriter | None = None) -> None:
        """``test`` is ``(images, mean, std)`` for ``Coordinator.evaluate`` (None: no evaluation);
        ``log`` gets round_begin / round_start_failed / round_end / checkpoint events."""
        self.co, self.peer, self.clock, self.scheduler = co, peer, clock, scheduler
        self.test = test
        self.log = log if log is not None else JsonLog(None)
        self.checkpoints = checkpoints
        self.records: list[dict[str, Any]] = []
        self.started = time.perf_counter()
        self.elapsed0 = 0.0  # wall seconds of the run before this process took it over (resume)

    def elapsed(self) -> float:
        """Wall seconds of the whole run so far, including a resumed run's earlier processes."""
        return self.elapsed0 + time.perf_counter() - self.started

    def receive(self, msg: Any) -> Outgoing:
        """A device's message into the Coordinator at this clock's time (the Peer's handler, or the
        service's for round messages): the deadline is applied on the same clock as it was set. What it
        returns goes back to the Peer, which sends the reply to ``msg`` and answers the other requests.
        Any exception is our bug: it leaves as a ``CoordinatorBug``."""
        try:
            return self.co.receive(msg, self.clock.now())
        except Exception as exc:
            raise CoordinatorBug(exc) from exc

    def send(self, out: Outgoing) -> None:
        """Replies the coordinator emitted outside a device's message (a deadline, a failure, the round's
        close): each answers its device's open request (call under the scheduler's lock).

        A reply that cannot be delivered is logged: the device's own request times out, as for any
        reply lost on the way."""
        for device, reply in out:
            try:
                self.peer.answer(device, reply)
            except Exception as exc:
                self.log.warning("reply_not_delivered", device=device, round=reply.round, kind=reply.kind,
                                 error=f"{type(exc).__name__}: {exc}"[:300])

    # -- one round ----------------------------------------------------------------------------------
    def run_round(self, t: int, devices: list[str] | None = None) -> dict[str, Any]:
        """Start ``devices`` (default: the scheduler's), advance them, close and evaluate: the round's record.
        A bug of ours while the coordinator handled a device's message fails the round with that error."""
        try:
            return self._round(t, devices)
        except CoordinatorBug as bug:
            raise bug.error from None

    def _round(self, t: int, devices: list[str] | None) -> dict[str, Any]:
        co, lock, cfg = self.co, self.scheduler.lock, self.co.cfg
        devices = self.scheduler.devices(t) if devices is None else devices
        stats = self.peer.transport.stats
        started = time.perf_counter()
        up0 = {c: stats.bytes_sent(src=c) for c in co.clients}
        down0 = stats.bytes_sent(src=self.peer.me)
        rec = self._exchange(t, devices)
        # bytes each device sent this round: a failed device's partial work shows here (docs/protocol.md, "Faults")
        up_by = {c: stats.bytes_sent(src=c) - up0[c] for c in co.clients}
        rec["bytes_up"] = sum(up_by.values())
        rec["bytes_down"] = stats.bytes_sent(src=self.peer.me) - down0
        if self.test is not None and (t % cfg.eval_every == 0 or t == cfg.rounds):
            images, mean, std = self.test
            with lock:
                rec.update(co.evaluate(images, mean, std))
        if t == cfg.rounds and cfg.eval_holdout > 0:  # the final model's own-data figure, beside its test figure
            rec["fed_final"] = self._exchange(t + 1, self.scheduler.devices(t + 1), evaluate_only=True)
        rec["wall_s"] = time.perf_counter() - started
        self.log.log("round_end", "warning" if rec["failures"] else "info", round=t, updates=sorted(rec["splits"]),
                     failures=rec["failures"], train_loss=rec["train_loss"], test_acc=rec.get("test_acc"),
                     wall_s=rec["wall_s"], bytes_up_by_device={c: n for c, n in up_by.items() if n > 0},
                     **({"quarantined": rec["quarantined"]} if rec.get("quarantined") else {}))  # device -> why
        return rec

    def _exchange(self, t: int, devices: list[str], evaluate_only: bool = False) -> dict[str, Any]:
        """Round ``t`` with ``devices``, from its round starts to its close: its record. ``evaluate_only``: the
        final evaluation after the last round (the devices' figures of the model as the run ends; its record is
        the ``fed_final`` of the last round's)."""
        co, lock = self.co, self.scheduler.lock
        with lock:
            starts = co.begin_round(t, self.clock.now(), devices=devices, evaluate_only=evaluate_only)
            calibrate = co.round.calibrate
            self.peer.formats = dict(getattr(co, "wire_formats", {}))  # each device's gradients in its own format
        self.log.info("round_begin", round=t, devices=devices, calibrate=calibrate,
                      round_timeout=co.cfg.round_timeout, **({"evaluate_only": True} if evaluate_only else {}))
        self._start_devices(starts)
        with lock:
            self.scheduler.advance(co, self.clock, self.send)
            rec, out = co.end_round(self.clock.now())
            self.send(out)  # what the closed round still held: refused, not left waiting
            fields = getattr(self.scheduler, "round_fields", None)  # a fleet's fleet_s and per-device timing
            if fields is not None and not evaluate_only:
                rec.update(fields())
        return rec

    def _start_devices(self, starts: Outgoing) -> None:
        """Each ``round_start`` (new messages: this Peer numbers them), never under the lock: a loopback
        send runs the device's handler."""
        for cid, msg in starts:
            try:
                self.peer.send(cid, msg.kind, msg.round, msg.body)
            except Exception as exc:  # an unreachable device must not stop the round
                reason = f"round_start not delivered: {type(exc).__name__}: {exc}"
                with self.scheduler.lock:
                    self.send(self.co.fail(cid, reason))
                self.log.warning("round_start_failed", round=msg.round, device=cid, reason=reason[:300])

    # -- the run ------------------------------------------------------------------------------------
    def rounds(self, first: int = 1, last: int | None = None, files: RunFiles | None = None) -> Iterator[dict[str, Any]]:
        """Rounds ``first..last`` (default: the config's), until the scheduler has no devices; each
        record is kept, checkpointed when resumable (before its metrics line: the checkpoint holds
        the records, so a kill between the two loses none) and appended to ``files``' metrics."""
        last = self.co.cfg.rounds if last is None else last
        for t in range(first, last + 1):
            devices = self.scheduler.devices(t)
            if not devices:
                break
            rec = self.run_round(t, devices)
            self.records.append(rec)
            if self.checkpoints is not None and self.checkpoints.resumable:
                self._checkpoint(t)
            if files is not None:
                files.append_metrics(rec)
            yield rec

    def run(self, summarize: Summarize, *, first: int = 1, files: RunFiles | None = None,
            started: float | None = None, on_round: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
        """Every round from ``first`` on, then the summary (written to ``files``); a checkpoint that is
        not resumable is written once here, after the last round. ``started``: the run's
        ``time.perf_counter()`` at its start, if before this call (its wall time counts from there)."""
        if started is not None:
            self.started = started
        self.scheduler.ready(first)
        if files is not None:
            files.open_metrics(append=first > 1)  # a resume rewrote the earlier rounds' lines
        try:
            for rec in self.rounds(first, files=files):
                if on_round is not None:
                    on_round(rec)
        finally:
            if files is not None:
                files.close_metrics()
        summary = summarize(self.records, self.elapsed())
        if self.checkpoints is not None and not self.checkpoints.resumable and self.records:
            self._checkpoint(self.records[-1]["round"])
        if files is not None:
            files.write_summary(summary)
        return summary

    def _checkpoint(self, t: int) -> None:
        assert self.checkpoints is not None
        with self.scheduler.lock:
            self.checkpoints.write(self.co, t, self.records, self.elapsed())
        self.log.info("checkpoint", round=t, path=str(self.checkpoints.path))
