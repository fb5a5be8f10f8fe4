"""The coordinator as a long-lived service: drives a ``Coordinator`` in real time over a ``Peer``.

The ``Coordinator`` is a state machine that never waits (docs/method.md, "Rounds"); its rounds
run through the one round driver (coordinator/driver.py, which ``simulate`` uses too) on the
monotonic clock, with a scheduler that waits for the devices' messages. This service adds what a
field run needs around it, over whichever transport the Peer sits on:

1. Devices register with ``hello`` and get ``ack`` or ``error`` (coordinator/registry.py says what a
   hello must carry and who is registered).
2. Once ``min_devices`` have registered (or ``register_timeout`` passed with at least one), each
   round starts every registered device at once (``round_start`` by ``peer.send``), then waits,
   applying the deadline with ``tick``, until every device has sent its update or failed.
3. After each round: aggregate (``end_round``), evaluate, replace ``checkpoint.pt``, then append
   to ``metrics.jsonl``; ``config.json`` at the start and ``summary.json`` at the end, the same files
   ``fedsga-edge simulate`` writes, plus ``coordinator.log`` (JSON lines) and ``devices.json`` (who
   registered, rewritten on every hello and bye).
4. ``resume=True`` continues a run from its checkpoint after the coordinator died (docs/protocol.md,
   "Faults"): the checkpoint holds everything the next round needs (weights, optimizers, estimator,
   prototypes, phi_s, calibration pairs, random generators, the records so far), ``metrics.jsonl``
   is rewritten from its records, so a round is never listed twice, and the devices of
   ``devices.json`` count as registered: they need not restart or say hello again.

The Coordinator is not thread-safe and the transport calls ``receive`` from its own threads (the
loopback from each device's worker, MQTT from its handler thread), so every call into it goes
through one lock; the service loop waits on a Condition of that lock, which updates and errors
notify, so a round ends as soon as its last device is done rather than at the next poll.

The service is a role: it may not import the wiring (``fedsga_edge.simulation``), so the run's
``config.json`` contents come in from whoever builds it (``fedsga_edge.runbuild``); the summary
is ``fedsga_edge.runfiles.summarize``, as simulate's. The checkpoint's format and the resume checks are
coordinator/checkpoint.py's.
"""

from __future__ import annotations

import contextlib
import threading
import time
from pathlib import Path
from typing import Any

from fedsga_edge.logthrottle import ThrottledEvents
from fedsga_edge.runfiles import JsonLog, RunFiles, summarize
from fedsga_edge.transport import Peer
from fedsga_edge.wire import Message, Outgoing

from .checkpoint import RESUMABLE, CheckpointWriter, load_resume
from .clock import MonotonicClock
from .driver import CoordinatorBug, RoundDriver
from .fieldtiming import FieldTiming, timed_scheduler
from .registry import Registry
from .scheduling import MessageScheduler
from .server import Coordinator

__all__ = ["RESUMABLE", "CoordinatorService"]


class CoordinatorService:
    """Registration, real-time rounds, run files and logs around one Coordinator."""

    def __init__(
        self,
        coordinator: Coordinator,
        peer: Peer,
        run_dir: str | Path,
        *,
        test: tuple[Any, tuple, tuple] | None = None,
        min_devices: int | None = None,
        register_timeout: float = 300.0,
        poll_s: float = 0.05,
        run_info: dict[str, Any] | None = None,
        resume: bool = False,
        description: Any = None,
        local_data: bool = False,
    ) -> None:
        """``test`` is ``(images, mean, std)`` for ``Coordinator.evaluate`` (None: no evaluation);
        ``resume`` continues the run in ``run_dir`` from its checkpoint (none there: from round 1);
        ``description`` (a ``fedsga_edge.data.local.RunData``) answers a device's ``describe``;
        ``local_data``: the devices bring their own data, and each hello's ``num_samples`` is its size."""
        cfg = coordinator.cfg
        if not cfg.round_timeout > 0:
            raise ValueError("a field run needs a round deadline (--round-timeout > 0): without one a device "
                             "that goes silent stalls its round forever")
        self.co = coordinator
        self.cfg = cfg
        self.peer = peer
        self.description = description.to_wire() if description is not None else None
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.min_devices = len(coordinator.clients) if min_devices is None else int(min_devices)
        if not 1 <= self.min_devices <= len(coordinator.clients):
            raise ValueError(f"min_devices must be in 1..{len(coordinator.clients)} (got {min_devices})")
        self.register_timeout = register_timeout
        self.run_info = run_info if run_info is not None else cfg.to_dict()
        self.log = JsonLog(self.run_dir / "coordinator.log")
        # Messages the Peer refuses before they reach _handle (undecodable, other run, spoofed sender,
        # replay): logged here too, throttled by the Peer (docs/protocol.md, "What is rejected").
        peer.on_reject = lambda sender, kind, reason: self.log.warning(
            "message_rejected", device=sender[:140], kind=kind, reason=reason[:300])
        # The service's own lines about refused or failed requests: the first 10 per event and device a
        # minute, then one `log_suppressed` line with the count (fedsga_edge/logthrottle.py).
        self.events = ThrottledEvents(self.log)
        if peer.admit is None:  # who, what and which round, checked before a body (its tensors) is decoded
            peer.admit = lambda env: coordinator.round.check_envelope(env.sender, env.kind, env.round, coordinator.clients)
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # notified on hello, update, device error, bye
        self.registry = Registry(coordinator, self.run_dir, self.log, local_data=local_data)
        self.summary: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self.bug: Exception | None = None  # ours, while handling a device's message: the run stops and fails with it
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._round = 0
        self.resumed_from = 0  # the round the checkpoint held when resuming (0: a fresh run)
        self.files = RunFiles(self.run_dir)
        scheduler = MessageScheduler(self._cond, self._stop, ready=self._ready, devices=self._devices, poll_s=poll_s)
        # per-device timing from the devices' updates and this clock, in every field run (docs/fleet.md)
        classes: dict[str, Any] = {}
        if cfg.fleet:
            from fedsga_edge.fleet import load_fleet

            classes = load_fleet(cfg.fleet).assign(list(coordinator.clients))
        self.timing: FieldTiming = FieldTiming(classes, peer.transport.stats, peer.me, fleet=bool(cfg.fleet))
        scheduler = timed_scheduler(scheduler, self.timing)
        checkpoints = CheckpointWriter(self.run_dir / "checkpoint.pt", cfg, resumable=True,
                                       extra=lambda: {"registered": self.registered})
        self.driver = RoundDriver(coordinator, peer, MonotonicClock(), scheduler, test=test, log=self.log,
                                  checkpoints=checkpoints)
        try:
            if resume:
                self._restore()  # before serving: no message may see the state half restored
            peer.register(self._handle)
        except BaseException:
            self.log.close()
            raise
        self.log.info("service_open", address=peer.me, run=peer.run, clients=len(coordinator.clients),
                      min_devices=self.min_devices, device=str(coordinator.device), resumed_from=self.resumed_from)

    # -- transport side (any thread) --------------------------------------------------------------
    @property
    def registered(self) -> dict[str, dict[str, Any]]:
        """Device -> what its hello said (coordinator/registry.py)."""
        return self.registry.registered

    def _handle(self, msg: Message) -> Message | Outgoing | None:
        """hello/bye are the service's, the rest the round's (the reply and held requests' answers to the Peer)."""
        if msg.kind == "hello":
            return self._on_hello(msg)
        if msg.kind == "describe":
            if self.description is None:
                return self.peer.reply(msg, "error", {"reason": "this coordinator has no description of its data"})
            return self.peer.reply(msg, "description", dict(self.description))
        if msg.kind == "bye":
            return self._on_bye(msg)
        t_in = time.time()
        try:
            with self._cond:
                if self.bug is not None:  # the run is failing with our bug: a late request is nobody's fault
                    return None
                out = self.driver.receive(msg)
                self.timing.heard(msg, t_in, time.time())
                if msg.kind in ("update", "error"):
                    self._cond.notify_all()
        except (CoordinatorBug, Exception) as exc:  # our bug, not the device's: logged, then the run fails with it
            self.bug = exc.error if isinstance(exc, CoordinatorBug) else exc
            self.log.error("handler_crash", device=msg.sender, kind=msg.kind,
                           error=f"{type(self.bug).__name__}: {self.bug}")
            self.stop()
            raise self.bug from None
        reply = next((m for d, m in out if d == msg.sender and m.seq == msg.seq), None)  # None: held, or one-way
        if msg.kind == "update" and reply is not None and reply.kind == "ack":
            self.log.info("update", round=msg.round, device=msg.sender, split=msg.body.get("split"),
                          train_loss=msg.body.get("train_loss"))
        elif msg.kind == "error":
            self.events.warn("device_gave_up", msg.sender, round=msg.round, reason=str(msg.body.get("reason"))[:300])
        elif reply is not None and reply.kind == "error":
            self.events.warn("request_refused", msg.sender, round=msg.round, kind=msg.kind,
                       reason=str(reply.body.get("reason"))[:300])
        return out

    def _on_hello(self, msg: Message) -> Message:
        problem = self.registry.problem(msg.sender, msg.body)
        if problem is not None:
            self.events.warn("hello_refused", str(msg.sender)[:140], reason=problem)
            return self.peer.reply(msg, "error", {"reason": problem})
        with self._cond:
            again = self.registry.add(msg.sender, msg.body)
            n = len(self.registered)
            self._cond.notify_all()
        body = msg.body
        self.log.info("hello_ack", device=msg.sender, backend=body["backend"], again=again, registered=n,
                      capabilities=body.get("capabilities", {}), profile=body.get("profile"))
        return self.peer.reply(msg, "ack", {"rounds": self.cfg.rounds, "round": self._round,
                                            "round_timeout": self.cfg.round_timeout, "registered": n})

    def _on_bye(self, msg: Message) -> Message | None:
        """A device leaving on purpose: out of the running round now (no need to wait for the deadline)."""
        with self._cond:
            if msg.sender not in self.registered:
                return self.peer.reply(msg, "error", {"reason": f"{msg.sender!r:.140} is not registered"})
            self.registry.remove(msg.sender)
            self.driver.send(self.co.fail(msg.sender, "device left (bye)"))  # a merged step no longer waits for it
            self._cond.notify_all()
        self.log.info("bye", device=msg.sender, reason=str(msg.body.get("reason", ""))[:200])
        return None

    # -- service loop -------------------------------------------------------------------------------
    def start(self) -> threading.Thread:
        """Run in a background thread (``wait`` for the summary)."""
        self._thread = threading.Thread(target=self._run_safely, name="coordinator-service", daemon=True)
        self._thread.start()
        return self._thread

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """The summary once the background run ends; TimeoutError if it has not ended in time."""
        if self._thread is None:
            raise RuntimeError("start() was not called")
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"the run did not finish within {timeout} s")
        if self.error is not None:
            raise self.error
        assert self.summary is not None
        return self.summary

    def stop(self) -> None:
        """Finish the running round now (its waiting devices fail) and end the run."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()

    def _run_safely(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # surfaced by wait()
            self.error = exc
            self.log.error("run_failed", error=f"{type(exc).__name__}: {exc}")

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every round's record so far (a resumed run's earlier rounds first)."""
        return self.driver.records

    def run(self) -> dict[str, Any]:
        """Register devices, run every round, write the run files; the summary."""
        started = time.perf_counter()
        self.files.write_config(self.run_info)
        summary = self.driver.run(self._make_summary, first=self.resumed_from + 1, files=self.files, started=started)
        if self.bug is not None:
            raise self.bug
        self.summary = summary
        self._say_bye()
        self.peer.flush_log()  # the rejections the log throttle held back: one summary line per sender
        self.events.flush()
        self.log.info("run_end", rounds=len(self.records), final_acc=summary.get("final_acc"),
                      failures=summary.get("failures"), wall_s=summary.get("wall_s"), resumed_from=self.resumed_from,
                      **self.counters())
        return summary

    def _ready(self, first: int) -> None:
        """The scheduler's start: wait for ``min_devices`` (unless a resumed run has no round left)."""
        if first <= self.cfg.rounds:
            self.wait_for_devices(self.min_devices, self.register_timeout)

    def _devices(self, t: int) -> list[str]:
        """The scheduler's devices for round ``t``: the registered ones, in partition order, as simulate;
        none (the run ends) once stopped or when every device left and none came back in time."""
        if self._stop.is_set():
            return []
        if not self.registered and not self.wait_for_devices(1, self.register_timeout):
            return []
        with self._cond:
            self._round = t
            devices = [c for c in self.co.clients if c in self.registered]
            self.timing.begin(devices)
            return devices

    def counters(self) -> dict[str, Any]:
        """What was refused or dropped over this process's life: requests the coordinator refused
        (``remote_errors``, the whole run's after a resume), messages its Peer rejected (undecodable,
        wrong run, spoofed sender) and the transport's health counters (MQTT: garbage, spoofed,
        duplicates, rejected, no_handler, handler_errors, late_replies)."""
        return {"remote_errors": self.co.remote_errors, "peer_errors": self.peer.errors,
                "transport_counters": dict(getattr(self.peer.transport, "counters", {}) or {})}

    def wait_for_devices(self, n: int, timeout: float) -> bool:
        """Block until ``n`` devices registered; on timeout go on with those there are (False: none)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self.registered) < n and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(min(left, 1.0))
            have = sorted(self.registered)
        if len(have) >= n:
            self.log.info("registration_complete", devices=have)
        elif have:
            self.log.warning("registration_timeout", wanted=n, devices=have)
        else:
            self.log.error("no_devices", waited_s=timeout)
        if not have and not self._stop.is_set():
            raise TimeoutError(f"no device registered within {timeout:g} s")
        return bool(have)

    def _restore(self) -> None:
        """Load the checkpoint into the coordinator and this service; rewrite ``metrics.jsonl`` from it.

        A round that was running when the coordinator died was never checkpointed, so it is run
        again from its start with the same round number; its devices drop their half of it
        (docs/protocol.md, "Faults").
        """
        path = self.run_dir / "checkpoint.pt"
        old_lines = _count_lines(self.files.metrics_path)
        if not path.exists():  # died before its first round ended: nothing to keep
            self.registry.restore({})
            self.files.rewrite_metrics([])
            self.log.warning("resume", from_round=0, reason=f"no checkpoint in {self.run_dir}: starting at round 1",
                             dropped_metrics_lines=old_lines, registered=sorted(self.registered))
            return
        back = load_resume(path, self.co, self.cfg)
        self.driver.records = back.records
        self.driver.elapsed0 = back.elapsed_s
        self.registry.restore(back.registered)
        self._round = self.resumed_from = back.round
        self.files.rewrite_metrics(back.records)
        self.log.info("resume", from_round=self.resumed_from, next_round=self.resumed_from + 1,
                      metrics_lines=len(back.records), dropped_metrics_lines=max(old_lines - len(back.records), 0),
                      registered=sorted(self.registered))

    def _make_summary(self, records: list[dict[str, Any]], wall_s: float) -> dict[str, Any]:
        summary = summarize(records, self.cfg, wall_s)
        summary["devices"] = {c: dict(d) for c, d in sorted(self.registered.items())}
        return summary

    def _say_bye(self) -> None:
        """Tell registered devices the run is over, so their agents can exit (best effort)."""
        for cid in sorted(self.registered):
            try:
                self.peer.send(cid, "bye", self._round, {"reason": "run finished"})
            except Exception as exc:
                self.log.warning("bye_not_delivered", device=cid, error=f"{type(exc).__name__}: {exc}"[:300])

    def status(self) -> dict[str, Any]:
        """A health snapshot for an operator (or a test)."""
        with self._cond:
            rs = self.co.round
            return {"round": rs.t, "phase": rs.phase, "registered": sorted(self.registered),
                    "waiting": rs.waiting if rs.phase == "training" else [], "failures": dict(rs.failures),
                    "rounds_done": len(self.records)}

    def close(self) -> None:
        """Stop serving the coordinator's address and close the log."""
        self.stop()
        with contextlib.suppress(Exception):
            self.peer.transport.unregister(self.peer.me)
        self.log.close()


def _count_lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return 0
