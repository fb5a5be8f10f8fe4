"""The coordinator as a long-lived service: drives a ``Coordinator`` in real time over a ``Peer``.

The ``Coordinator`` is a state machine that never waits (docs/method.md, "Rounds"); this is the
driver that does the waiting for a field run, over whichever transport the Peer sits on:

1. Devices register with ``hello`` (``backend``, ``num_samples``, ``capabilities``) and get ``ack``
   or ``error``. ``num_samples`` must equal the size of that device's partition on this side: both
   sides derive partitions from the same seeded config, so a mismatch means a different config or
   data set and the device is refused before it can train on the wrong samples.
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
``config.json`` contents and the summary function come in from whoever builds it
(``fedsga_edge.runbuild``).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsga_edge.config import RunConfig
from fedsga_edge.runfiles import JsonLog, atomic_torch_save, atomic_write
from fedsga_edge.transport import Peer
from fedsga_edge.wire import Message

from .server import Coordinator

__all__ = ["RESUMABLE", "CoordinatorService"]

Summarize = Callable[[list[dict[str, Any]], float], dict[str, Any]]

RESUME_VERSION = 1
# Settings a resumed run may change: how long it goes on and how it waits, not what it computes.
RESUMABLE = ("rounds", "round_timeout", "eval_every", "device", "data_root")


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
        summarize: Summarize | None = None,
        resume: bool = False,
    ) -> None:
        """``test`` is ``(images, mean, std)`` for ``Coordinator.evaluate`` (None: no evaluation);
        ``resume`` continues the run in ``run_dir`` from its checkpoint (none there: from round 1)."""
        cfg = coordinator.cfg
        if not cfg.round_timeout > 0:
            raise ValueError("a field run needs a round deadline (--round-timeout > 0): without one a device "
                             "that goes silent stalls its round forever")
        self.co = coordinator
        self.cfg = cfg
        self.peer = peer
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.test = test
        self.min_devices = len(coordinator.clients) if min_devices is None else int(min_devices)
        if not 1 <= self.min_devices <= len(coordinator.clients):
            raise ValueError(f"min_devices must be in 1..{len(coordinator.clients)} (got {min_devices})")
        self.register_timeout = register_timeout
        self.poll_s = poll_s
        self.run_info = run_info if run_info is not None else cfg.to_dict()
        self._summarize = summarize
        self.log = JsonLog(self.run_dir / "coordinator.log")
        # Messages the Peer refuses before they reach _handle (undecodable, other run, spoofed sender,
        # replay): logged here too, throttled by the Peer (docs/protocol.md, "What is rejected").
        peer.on_reject = lambda sender, kind, reason: self.log.warning(
            "message_rejected", device=sender[:140], kind=kind, reason=reason[:300])
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # notified on hello, update, device error, bye
        self.registered: dict[str, dict[str, Any]] = {}  # device -> what its hello said
        self.records: list[dict[str, Any]] = []
        self.summary: dict[str, Any] | None = None
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._round = 0
        self.resumed_from = 0  # the round the checkpoint held when resuming (0: a fresh run)
        self._elapsed0 = 0.0  # wall seconds of the run before this process took it over
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
    def _handle(self, msg: Message) -> Message | None:
        """Every message for the coordinator's address; hello/bye are the service's, the rest the round's."""
        if msg.kind == "hello":
            return self._on_hello(msg)
        if msg.kind == "bye":
            return self._on_bye(msg)
        try:
            with self._cond:
                reply = self.co.receive(msg)
                if msg.kind in ("update", "error"):
                    self._cond.notify_all()
        except Exception as exc:  # our bug, not the device's: record it where the operator looks, then fail loudly
            self.log.error("handler_crash", device=msg.sender, kind=msg.kind, error=f"{type(exc).__name__}: {exc}")
            raise
        if msg.kind == "update" and reply is not None and reply.kind == "ack":
            self.log.info("update", round=msg.round, device=msg.sender, split=msg.body.get("split"),
                          train_loss=msg.body.get("train_loss"))
        elif msg.kind == "error":
            self.log.warning("device_gave_up", round=msg.round, device=msg.sender,
                             reason=str(msg.body.get("reason"))[:300])
        elif reply is not None and reply.kind == "error":
            self.log.warning("request_refused", round=msg.round, device=msg.sender, kind=msg.kind,
                             reason=str(reply.body.get("reason"))[:300])
        return reply

    def _on_hello(self, msg: Message) -> Message:
        body = msg.body
        expected = self.co.clients.get(msg.sender)
        problem = None
        if expected is None:
            problem = f"unknown device {msg.sender!r:.140}: this run has no partition for it"
        elif not isinstance(body.get("backend"), str) or not body["backend"]:
            problem = "hello must name the device's backend (a non-empty string)"
        elif not isinstance(body.get("num_samples"), int) or isinstance(body.get("num_samples"), bool):
            problem = "hello must carry num_samples (an integer)"
        elif body["num_samples"] != expected:
            problem = (f"num_samples {body['num_samples']} does not match this run's partition for {msg.sender} "
                       f"({expected}): the device was built from a different config or data set")
        elif not isinstance(body.get("capabilities", {}), dict):
            problem = "capabilities must be a map"
        if problem is not None:
            self.log.warning("hello_refused", device=str(msg.sender)[:140], reason=problem)
            return self.peer.reply(msg, "error", {"reason": problem})
        with self._cond:
            again = msg.sender in self.registered
            self.registered[msg.sender] = {"backend": body["backend"], "num_samples": expected, "since": time.time(),
                                           "capabilities": dict(body.get("capabilities", {}))}
            n = len(self.registered)
            self._save_devices()
            self._cond.notify_all()
        self.log.info("hello_ack", device=msg.sender, backend=body["backend"], again=again, registered=n,
                      capabilities=body.get("capabilities", {}))
        return self.peer.reply(msg, "ack", {"rounds": self.cfg.rounds, "round": self._round,
                                            "round_timeout": self.cfg.round_timeout, "registered": n})

    def _on_bye(self, msg: Message) -> Message | None:
        """A device leaving on purpose: out of the running round now (no need to wait for the deadline)."""
        with self._cond:
            if msg.sender not in self.registered:
                return self.peer.reply(msg, "error", {"reason": f"{msg.sender!r:.140} is not registered"})
            del self.registered[msg.sender]
            self.co.fail(msg.sender, "device left (bye)")
            self._save_devices()
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

    def run(self) -> dict[str, Any]:
        """Register devices, run every round, write the run files; the summary."""
        started = time.perf_counter()
        atomic_write(self.run_dir / "config.json", json.dumps(self.run_info, indent=2))
        first = self.resumed_from + 1
        if first <= self.cfg.rounds:
            self.wait_for_devices(self.min_devices, self.register_timeout)
        # A resumed run appends to the metrics _restore rewrote from the checkpoint; a new one starts afresh.
        with (self.run_dir / "metrics.jsonl").open("a" if self.resumed_from else "w") as metrics:
            for t in range(first, self.cfg.rounds + 1):
                if self._stop.is_set():
                    break
                if not self.registered and not self.wait_for_devices(1, self.register_timeout):
                    break
                rec = self.run_round(t)
                self.records.append(rec)
                # The checkpoint first: it holds the records, so a kill between the two writes loses no line.
                self._checkpoint(t, self._elapsed0 + time.perf_counter() - started)
                metrics.write(json.dumps(rec) + "\n")
                metrics.flush()
        summary = self._make_summary(self._elapsed0 + time.perf_counter() - started)
        atomic_write(self.run_dir / "summary.json", json.dumps(summary, indent=2))
        self.summary = summary
        self._say_bye()
        self.log.info("run_end", rounds=len(self.records), final_acc=summary.get("final_acc"),
                      failures=summary.get("failures"), wall_s=summary.get("wall_s"), resumed_from=self.resumed_from,
                      **self.counters())
        return summary

    def counters(self) -> dict[str, Any]:
        """What was refused or dropped over this process's life: requests the coordinator refused
        (``remote_errors``, the whole run's after a resume), messages its Peer rejected (undecodable,
        wrong run, spoofed sender) and the transport's health counters (MQTT: garbage, spoofed,
        duplicates, rejected, no_handler, handler_errors, late_replies)."""
        transport = self.peer.transport
        return {"remote_errors": self.co.remote_errors, "peer_errors": self.peer.errors,
                "transport_counters": dict(getattr(transport, "counters", {}) or {})}

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

    def run_round(self, t: int) -> dict[str, Any]:
        """One round in real time: start every registered device, wait for them or the deadline."""
        co, stats = self.co, self.peer.transport.stats
        started = time.perf_counter()
        up0_by = {c: stats.bytes_sent(src=c) for c in co.clients}
        up0 = sum(up0_by.values())
        down0 = stats.bytes_sent(src=self.peer.me)
        with self._cond:
            devices = [c for c in co.clients if c in self.registered]  # the partition order, as simulate
            bodies = co.begin_round(t, time.monotonic(), devices=devices)
            self._round = t
            calibrate = co.round.calibrate
        self.log.info("round_begin", round=t, devices=devices, calibrate=calibrate,
                      round_timeout=self.cfg.round_timeout)
        for cid, body in bodies.items():  # never under the lock: a loopback send runs the device's handler
            try:
                self.peer.send(cid, "round_start", t, body)
            except Exception as exc:  # an unreachable device must not stop the round
                reason = f"round_start not delivered: {type(exc).__name__}: {exc}"
                with self._cond:
                    co.fail(cid, reason)
                self.log.warning("round_start_failed", round=t, device=cid, reason=reason[:300])
        with self._cond:
            while not co.tick(time.monotonic()):
                if self._stop.is_set():
                    for d in co.round.waiting:
                        co.fail(d, "coordinator stopped")
                    break
                self._cond.wait(self.poll_s)
            rec = co.end_round(time.monotonic())
        rec["bytes_up"] = sum(stats.bytes_sent(src=c) for c in co.clients) - up0
        rec["bytes_down"] = stats.bytes_sent(src=self.peer.me) - down0
        ks = rec["splits"]
        if self.test is not None and (t % self.cfg.eval_every == 0 or t == self.cfg.rounds):
            images, mean, std = self.test
            with self._cond:
                rec.update(co.evaluate(images, mean, std))
        rec["wall_s"] = time.perf_counter() - started
        level = "warning" if rec["failures"] else "info"
        # bytes each device sent this round: a failed device's partial work shows here (docs/protocol.md, "Faults")
        up_by = {c: stats.bytes_sent(src=c) - up0_by[c] for c in co.clients if stats.bytes_sent(src=c) > up0_by[c]}
        self.log.log("round_end", level, round=t, updates=sorted(ks), failures=rec["failures"],
                     train_loss=rec["train_loss"], test_acc=rec.get("test_acc"), wall_s=rec["wall_s"],
                     bytes_up_by_device=up_by)
        return rec

    def _checkpoint(self, t: int, elapsed_s: float) -> None:
        """The same checkpoint simulate writes, plus the round it holds and what ``resume`` needs to
        go on as if never stopped, replaced atomically after every round."""
        co = self.co
        with self._cond:
            full = co.checkpoint_state()
            state = {"round": t, "model": co.model.state_dict(), "arch": self.cfg.model,
                     "coordinator": full.pop("coordinator"),
                     "resume": {"version": RESUME_VERSION, "config": self.cfg.to_dict(), "records": self.records,
                                "registered": self.registered, "elapsed_s": elapsed_s, **full,
                                "rng": _global_rngs()}}
            atomic_torch_save(state, self.run_dir / "checkpoint.pt")
        self.log.info("checkpoint", round=t, path=str(self.run_dir / "checkpoint.pt"))

    def _restore(self) -> None:
        """Load the checkpoint into the coordinator and this service; rewrite ``metrics.jsonl`` from it.

        A round that was running when the coordinator died was never checkpointed, so it is run
        again from its start with the same round number; its devices drop their half of it
        (docs/protocol.md, "Faults").
        """
        path = self.run_dir / "checkpoint.pt"
        metrics = self.run_dir / "metrics.jsonl"
        old_lines = _count_lines(metrics)
        if not path.exists():  # died before its first round ended: nothing to keep
            self.registered = self._load_devices({})
            atomic_write(metrics, "")
            self.log.warning("resume", from_round=0, reason=f"no checkpoint in {self.run_dir}: starting at round 1",
                             dropped_metrics_lines=old_lines, registered=sorted(self.registered))
            return
        try:
            ck = torch.load(path, map_location=self.co.device, weights_only=True)
        except Exception as exc:
            raise ValueError(f"cannot resume from {path}: {type(exc).__name__}: {exc}") from None
        state = ck.get("resume") if isinstance(ck, dict) else None
        if not isinstance(state, dict) or state.get("version") != RESUME_VERSION:
            raise ValueError(f"{path} holds no resume state of version {RESUME_VERSION} (written by simulate or "
                             "another version?): this run cannot be resumed")
        if ck.get("arch") != self.cfg.model:
            raise ValueError(f"{path} is a {ck.get('arch')!r} checkpoint, this run builds {self.cfg.model!r}")
        try:  # settings added since the checkpoint was written take their defaults, as the run then did
            saved = RunConfig.from_dict(state["config"]).to_dict()
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cannot resume from {path}: its settings do not load here: {exc}") from None
        changed = _changed(saved, self.cfg.to_dict())
        if changed:
            raise ValueError(f"cannot resume {self.run_dir}: its checkpoint was made with other settings "
                             f"({'; '.join(changed)}); only {', '.join(RESUMABLE)} may change")
        self.co.restore({**state, "coordinator": ck["coordinator"]})
        _set_global_rngs(state["rng"])
        self.records = list(state["records"])
        self.registered = self._load_devices(state["registered"])
        self._round = self.resumed_from = int(ck["round"])
        self._elapsed0 = float(state["elapsed_s"])
        atomic_write(metrics, "".join(json.dumps(r) + "\n" for r in self.records))
        self.log.info("resume", from_round=self.resumed_from, next_round=self.resumed_from + 1,
                      metrics_lines=len(self.records), dropped_metrics_lines=max(old_lines - len(self.records), 0),
                      registered=sorted(self.registered))

    def _save_devices(self) -> None:
        """``devices.json``: who is registered now (call under the lock); a resumed coordinator reads it."""
        atomic_write(self.run_dir / "devices.json", json.dumps(self.registered, indent=2, default=str))

    def _load_devices(self, fallback: dict[str, Any]) -> dict[str, dict[str, Any]]:
        """The devices registered when the last coordinator died (``devices.json``, else the checkpoint's):
        they are still running and listening, so the resumed rounds include them without a new hello."""
        try:
            saved = json.loads((self.run_dir / "devices.json").read_text())
        except (OSError, ValueError):
            saved = fallback
        if not isinstance(saved, dict):
            saved = fallback
        return {d: dict(info, restored=True) for d, info in saved.items()
                if d in self.co.clients and isinstance(info, dict)}

    def _make_summary(self, wall_s: float) -> dict[str, Any]:
        if self._summarize is not None and self.records:
            summary = dict(self._summarize(self.records, wall_s))
        else:
            accs = [r["test_acc"] for r in self.records if "test_acc" in r]
            summary = {"strategy": self.cfg.strategy, "rounds": len(self.records),
                       "final_acc": accs[-1] if accs else None, "best_acc": max(accs) if accs else None,
                       "failures": sum(len(r.get("failures", {})) for r in self.records), "wall_s": wall_s}
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
        try:
            self.peer.transport.unregister(self.peer.me)
        except Exception:
            pass
        self.log.close()


def _count_lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text().splitlines() if line.strip())
    except OSError:
        return 0


def _changed(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: saved -> now`` for every setting outside RESUMABLE that differs (nested configs by dotted key)."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if prefix == "" and key in RESUMABLE or a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and key != "model_args":
            out += _changed(a, b, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def _global_rngs() -> dict[str, Any]:
    """Python's, numpy's and torch's global generators, as plain values ``torch.load(weights_only=True)`` reads."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"python": random.getstate(), "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state(), "cuda": cuda}


def _set_global_rngs(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
