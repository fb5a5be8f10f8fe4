"""The device as a long-lived agent: a device role (``SplitClient``) and its ``Peer``, kept alive across rounds.

The role is stepped (docs/method.md, "Rounds"): ``handle(round_start)`` arms a round and
``step()`` advances it one request at a time. The agent is the driver for a real device:

* it registers with ``hello`` (backend, ``num_samples``, capabilities) and retries while the
  coordinator is unreachable, until acked, refused or out of time;
* a ``round_start`` is queued by the transport's delivery thread and run on the agent's own worker
  thread (``while client.step(): pass``). Never on the delivery thread: on MQTT that thread also
  delivers to this address, and a round takes minutes; on the loopback it is the coordinator's
  service loop, which must go on starting the other devices;
* after every finished round it saves the client's private state (prompts, r_prev, the last two
  descriptors, the last interface mean, round count, its random generators) to ``state_dir``
  atomically, as an ``.npz`` of plain arrays (no pickle, no torch: the ONNX backend reads and writes
  the same file), and reloads it on start: a device that reboots keeps its own prompts and r and does
  not replay the first round's batch order. The data never needs saving: both sides rebuild the
  partition from the run's seeded config (``fedsga_edge.runbuild``).
  A round that fails, is refused or is overtaken rolls the agent back to the state it had before
  the round (kept in memory, so a fresh device without a state file is rolled back too): only a
  round whose update the coordinator acked is saved, and a half-done round leaves no trace
  (docs/protocol.md, "Faults").
* it takes orders only from the coordinator (the claimed sender and, where the transport observes
  one, the real sender), and a ``round_start`` or ``bye`` only within ``MAX_ROUNDS_AHEAD`` of the
  newest round the coordinator confirmed (``device.guard``); refusals go to ``agent.log``, throttled.

``health()`` is what an operator (or a watchdog) reads: registered, rounds done, busy, last error.
"""

from __future__ import annotations

import copy
import io
import json
import queue
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from fedsga_edge.logthrottle import Throttle, describe
from fedsga_edge.runfiles import JsonLog, atomic_write
from fedsga_edge.transport import Peer, TransportError
from fedsga_edge.wire import Envelope, Message, RemoteProtocolError

from .guard import VERIFY_EVERY_S, RoundGuard
from .role import PrivateState, SplitClient, check_round_start

__all__ = ["DeviceAgent", "RegistrationRefused", "STATE_FILE"]

STATE_FILE = "state.npz"
STATE_VERSION = 2
_ARRAYS = ("prompts", "m_prev", "m_last", "H_prev")


# What a round may change and a failed round must put back (state, batch order, the backend's generator).
_Snapshot = tuple[PrivateState, Any, Any]


class RegistrationRefused(Exception):
    """The coordinator answered the hello with an error: retrying would not change its answer."""


class DeviceAgent:
    """Registers, runs each round on a worker thread, persists private state, reports health."""

    def __init__(
        self,
        client: SplitClient,
        peer: Peer,
        state_dir: str | Path,
        *,
        server: str = "coordinator",
        capabilities: dict[str, Any] | None = None,
        hello_timeout: float = 300.0,
        retry_s: float = 0.5,
    ) -> None:
        self.client = client
        self.peer = peer
        self.server = server
        self.backend = client.backend.name
        # What a coordinator may want to know when it plans splits (logged; not used by the rounds yet).
        self.capabilities = capabilities if capabilities is not None else client.backend.capabilities()
        self.hello_timeout = hello_timeout
        self.retry_s = retry_s
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log = JsonLog(self.state_dir / "agent.log")
        self.registered = False
        self.finished = threading.Event()  # the coordinator said bye: the run is over
        self.rounds_done = 0
        self.last_round = 0
        self.last_error: str | None = None
        self._current: int | None = None
        self._latest = 0  # newest round announced; an older running round is abandoned for it
        self._newest: Message | None = None  # the last round_start (a resumed coordinator sends a round again)
        self._lock = threading.Lock()
        self._queue: queue.Queue[Message] = queue.Queue()
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._serving = False
        self.guard = RoundGuard()
        self.refused: Counter[str] = Counter()  # orders refused, by event (health() reports them)
        self._throttle = Throttle()  # which refusals reach agent.log: per event and sender, per minute
        self._verify: int | None = None  # the round of a round_start too far ahead, to check with the coordinator
        self._verify_after = 0.0
        self._tls = threading.local()
        if peer.on_reject is None:  # what the Peer refuses before _handle (a sender that is not its topic)
            peer.on_reject = self._peer_rejected
        if getattr(peer, "admit", None) is None:  # the same checks on the envelope, before any tensor is built
            peer.admit = self._admit
        try:
            self.restored = self.load_state()
        except BaseException:
            self.log.close()
            raise

    @property
    def cid(self) -> str:
        return self.client.cid

    @property
    def state_path(self) -> Path:
        return self.state_dir / STATE_FILE

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, *, register: bool = True, timeout: float | None = None) -> None:
        """Serve the device's address, start the worker and (by default) register before returning."""
        self.peer.register(self._handle)
        self._serving = True
        self._worker = threading.Thread(target=self._work, name=f"agent-{self.cid}", daemon=True)
        self._worker.start()
        self.log.info("agent_start", device=self.cid, run=self.peer.run, restored=self.restored,
                      rounds_done=self.rounds_done, state_rounds=self.client.state.rounds)
        if register:
            self.register(timeout)

    def register(self, timeout: float | None = None) -> dict[str, Any]:
        """Say hello until acked; RegistrationRefused on an error reply, TimeoutError when out of time."""
        timeout = self.hello_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        body = {"backend": self.backend, "num_samples": len(self.client.data), "capabilities": self.capabilities,
                "rounds_done": self.rounds_done, "state_rounds": self.client.state.rounds}
        wait, attempts = self.retry_s, 0
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
                    self.registered = True
                    self._confirm_from_ack(reply)
                    self.log.info("registered", attempts=attempts, ack=reply.body)
                    return dict(reply.body)
                reason = str(reply.body.get("reason", reply.kind))
                self.last_error = f"registration refused: {reason}"
                self.log.error("registration_refused", reason=reason)
                raise RegistrationRefused(reason)
            if self._stop.is_set() or time.monotonic() + wait > deadline:
                self.last_error = f"not registered after {attempts} attempts: {last}"
                self.log.error("registration_timeout", attempts=attempts, error=last[:300])
                raise TimeoutError(self.last_error)
            if attempts == 1:
                self.log.warning("hello_retry", error=last[:300])
            time.sleep(wait)
            wait = min(wait * 2, 5.0)

    def stop(self, timeout: float = 30.0) -> None:
        """Leave abruptly, like a device that loses power: no bye, the running round is dropped unsaved.

        The coordinator learns of it only by the round's deadline (or a failed send), which is what
        a field run must survive. The state on disk is the one saved after the last finished round.
        """
        self._stop.set()
        if self._serving:
            try:
                self.peer.transport.unregister(self.peer.me)
            except TransportError:
                pass
            self._serving = False
        if self._worker is not None and self._worker is not threading.current_thread():
            self._worker.join(timeout)
        self.log.info("agent_stop", rounds_done=self.rounds_done, current_round=self._current)
        self.log.close()

    def leave(self, reason: str = "leaving") -> None:
        """Leave politely: tell the coordinator (bye) so its round need not wait for the deadline, then stop."""
        try:
            self.peer.send(self.server, "bye", self._current or self.last_round, {"reason": reason})
        except Exception as exc:
            self.log.warning("bye_not_delivered", error=f"{type(exc).__name__}: {exc}"[:300])
        self.stop()

    def health(self) -> dict[str, Any]:
        worker = self._worker
        return {
            "device": self.cid,
            "registered": self.registered,
            "alive": worker is not None and worker.is_alive(),
            "busy": self.busy,
            "current_round": self._current,
            "last_round": self.last_round,
            "rounds_done": self.rounds_done,
            "state_rounds": self.client.state.rounds,
            "last_error": self.last_error,
            "restored": self.restored,
            "finished": self.finished.is_set(),
            "confirmed_round": self._confirmed(),
            "refused": dict(self.refused),
        }

    @property
    def busy(self) -> bool:
        return self._current is not None or not self._queue.empty()

    # -- delivery thread ----------------------------------------------------------------------------
    def _handle(self, msg: Message) -> Message | None:
        """Queue work and return at once: the delivery thread must never train."""
        self._check_order(msg)  # the Peer ran it on the envelope already (admit); again for a Peer without one
        if msg.kind == "round_start":
            try:
                check_round_start(msg.body)  # a malformed one must not supersede the round running now
            except RemoteProtocolError as exc:
                self._refuse("round_start_refused", msg, str(exc))
            with self._lock:
                self._latest = max(self._latest, msg.round)
                self._newest = msg
            self._queue.put(msg)
            return None
        # a bye
        self.log.info("run_over", round=msg.round, reason=str(msg.body.get("reason", ""))[:200])
        self.finished.set()
        return None

    def _admit(self, env: Envelope) -> None:
        """The Peer's check of an envelope before its body (the round's weights) is decoded."""
        self._check_order(env)

    def _check_order(self, msg: Envelope | Message) -> None:
        """Only the coordinator (claimed and, where the transport observes one, real sender) gives orders:
        a ``round_start`` or a ``bye``, for a round within the bound (``device.guard``)."""
        seen = self._observed_sender()
        if msg.sender != self.server or (seen is not None and seen != self.server):
            came = f" (arrived from {seen!r:.140})" if seen is not None and seen != msg.sender else ""
            self._refuse("order_refused", msg,
                         f"{self.cid} takes orders only from {self.server!r}, not {msg.sender!r:.140}{came}")
        if msg.kind not in ("round_start", "bye"):
            self._refuse("order_refused", msg, f"device {self.cid} does not accept {msg.kind!r:.40}")
        problem = self.guard.too_far(msg.round, msg.kind) if msg.round > self._confirmed() else None
        if problem is not None:  # a forged round_start would make every real round look stale
            if msg.kind == "round_start":
                self._ask_coordinator(msg.round)
            self._refuse(f"{msg.kind}_refused", msg, problem)

    def _observed_sender(self) -> str | None:
        """Who the transport saw send the message being handled (MQTT: its topic); None where it cannot tell."""
        observed = getattr(self.peer.transport, "observed_sender", None)
        return observed() if callable(observed) else None

    def _refuse(self, event: str, msg: Envelope | Message, reason: str) -> None:
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
        self._tls.logged = reason  # the Peer reports this refusal to _peer_rejected too: logged once
        raise RemoteProtocolError(reason)

    def _peer_rejected(self, sender: str, kind: str, reason: str) -> None:
        """The Peer's refusals (throttled by the Peer): undecodable, another run, a sender not its topic."""
        logged, self._tls.logged = getattr(self._tls, "logged", None), None
        if logged is not None and reason.startswith(logged[:200]):
            return
        self.log.warning("message_rejected", sender=str(sender)[:140], kind=str(kind)[:40], reason=reason[:300])

    def _confirmed(self) -> int:
        """The newest round the coordinator confirmed: acked at hello, answered a request of, or completed."""
        self.guard.confirm(self.client.confirmed_round)
        return self.guard.confirmed

    def _confirm_from_ack(self, reply: Message) -> int | None:
        """The coordinator's round in a hello ack (None when it names none)."""
        t = reply.body.get("round")
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            return None
        self.guard.confirm(t)
        return t

    def _ask_coordinator(self, t: int) -> None:
        """Have the worker ask the coordinator's round after a far-ahead round_start (at most every VERIFY_EVERY_S)."""
        with self._lock:
            now = time.monotonic()
            if self._verify is None and now >= self._verify_after:
                self._verify, self._verify_after = t, now + VERIFY_EVERY_S

    # -- worker thread ------------------------------------------------------------------------------
    def _work(self) -> None:
        while not self._stop.is_set():
            if self._verify is not None:
                self._verify_round()
            try:
                msg = self._queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if self._superseded(msg):
                self.log.warning("round_skipped", round=msg.round, newer=self._latest)
                continue
            try:
                self._run_round(msg)
            except Exception as exc:  # the agent outlives any one round
                self.last_error = f"{type(exc).__name__}: {exc}"
                self.log.error("round_crash", round=msg.round, error=self.last_error[:500])

    def _verify_round(self) -> None:
        """After a far-ahead round_start, ask the coordinator (hello) which round it is in. A real one moves
        the bound, so a device that lagged that far takes part again from the next round_start on; a
        forged one changes nothing (its body was never decoded, so it is not run either way)."""
        with self._lock:
            t, self._verify = self._verify, None
        if t is None:
            return
        body = {"backend": self.backend, "num_samples": len(self.client.data), "capabilities": self.capabilities,
                "rounds_done": self.rounds_done, "state_rounds": self.client.state.rounds}
        try:
            reply = self.peer.call(self.server, "hello", 0, body, timeout=10.0)
        except (TransportError, RemoteProtocolError) as exc:
            self.log.warning("round_start_unconfirmed", round=t, error=f"{type(exc).__name__}: {exc}"[:300])
            return
        now = self._confirm_from_ack(reply) if reply.kind == "ack" else None
        if now is None or now < t:
            self.log.warning("round_start_unconfirmed", round=t, coordinator_round=now, reply=str(reply.kind)[:40])
        else:
            self.log.info("round_start_confirmed", round=t, coordinator_round=now)

    def _run_round(self, msg: Message) -> None:
        t = msg.round
        client = self.client
        try:
            client.handle(msg)
        except RemoteProtocolError as exc:
            self.last_error = f"bad round_start: {exc}"
            self.log.error("round_refused", round=t, error=self.last_error[:500])
            self._report(t, self.last_error)
            return
        before = self._snapshot()
        self._current = t
        started = time.perf_counter()
        self.log.info("round_begin", round=t, split=msg.body.get("split"), calibrate=bool(msg.body.get("calibrate")))
        outcome = "done"
        try:
            while True:
                if self._stop.is_set():
                    client.abort()
                    self.log.warning("round_abandoned", round=t, reason="agent stopped")
                    return  # like a power loss: nothing saved
                if self._superseded(msg):
                    client.abort()
                    outcome = "superseded"
                    break
                try:
                    more = self._step()
                except Exception as exc:  # transport down, reply timeout, a bug in a step
                    client.abort()
                    if self._superseded(msg):  # waited on a coordinator that has restarted: nothing to report
                        outcome = "superseded"
                        break
                    outcome, self.last_error = "failed", f"{type(exc).__name__}: {exc}"
                    self._report(t, self.last_error)
                    break
                if not more:
                    break
            if outcome == "done" and client.last_error:  # the coordinator refused a request or the update
                outcome, self.last_error = "refused", client.last_error
                # a refused request was reported already; a round that a resumed coordinator sent again is not
                if client.last_error.startswith("update refused") and not self._superseded(msg):
                    self._report(t, client.last_error)
            self.last_round = t
            if outcome == "done":
                self.rounds_done += 1
                self.last_error = None
                self.save_state()
            else:  # an unfinished round leaves no trace (docs/protocol.md, "Faults")
                self._restore(before)
                self._forget_unconfirmed(msg)
        finally:
            self._current = None
        level = "info" if outcome == "done" else "warning"
        self.log.log("round_end", level, round=t, outcome=outcome, wall_s=time.perf_counter() - started,
                     r_prev=client.state.r_prev, error=self.last_error if outcome != "done" else None)

    def _forget_unconfirmed(self, msg: Message) -> None:
        """A failed round the coordinator never answered a request of may not exist (a forged round_start
        within the bound): it must not make the real rounds up to it look stale."""
        if self._confirmed() >= msg.round:
            return
        with self._lock:
            if self._newest is msg:
                self._newest = None
                self._latest = min(self._latest, self.guard.confirmed)

    def _snapshot(self) -> _Snapshot:
        """What a round may change of the private state, copied before it starts."""
        return (copy.deepcopy(self.client.state), copy.deepcopy(self.client.rng.bit_generator.state),
                self.client.backend.rng_state())

    def _restore(self, snap: _Snapshot) -> None:
        state, rng, backend_rng = snap
        self.client.state = state
        self.client.rng.bit_generator.state = rng
        if backend_rng is not None:
            self.client.backend.set_rng_state(backend_rng)

    def _superseded(self, msg: Message) -> bool:
        """A newer round_start arrived: a later round, or this round again from a resumed coordinator."""
        newest = self._newest
        return msg.round < self._latest or (newest is not None and newest is not msg and newest.round >= msg.round)

    def _step(self) -> bool:
        """One request of the running round (a seam for tests that need to freeze a device mid-round)."""
        return self.client.step()

    def _report(self, t: int, reason: str) -> None:
        """Tell the coordinator this device gives up round t, so the round need not wait for its deadline."""
        try:
            self.peer.send(self.server, "error", t, {"reason": reason[:500]})
        except Exception as exc:
            self.log.warning("error_not_delivered", round=t, error=f"{type(exc).__name__}: {exc}"[:300])

    # -- private state on disk ----------------------------------------------------------------------
    def save_state(self) -> None:
        """Everything private the next round needs (docs/method.md), replaced atomically."""
        s = self.client.state
        meta = {
            "version": STATE_VERSION,
            "device": self.cid,
            "run": self.peer.run,
            "backend": self.backend,
            "rounds_done": self.rounds_done,
            "last_round": self.last_round,
            "r_prev": float(s.r_prev),
            "rounds": int(s.rounds),
            "extra": dict(s.extra),
            "rng": self.client.rng.bit_generator.state,
        }
        arrays = {k: np.asarray(getattr(s, k)) for k in _ARRAYS if getattr(s, k) is not None}
        backend_rng = self.client.backend.rng_state()
        if backend_rng is not None:
            arrays["backend_rng"] = np.asarray(backend_rng)
        buf = io.BytesIO()
        np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        atomic_write(self.state_path, buf.getvalue())

    def load_state(self) -> bool:
        """Restore the state a previous agent of this device saved; False when there is none."""
        if not self.state_path.exists():
            return False
        try:
            with np.load(self.state_path, allow_pickle=False) as npz:
                meta = json.loads(npz["meta"].tobytes().decode())
                arrays = {k: np.array(npz[k]) for k in npz.files if k != "meta"}
        except (OSError, ValueError, KeyError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.state_path} is not a device state file ({type(exc).__name__}: {exc}); "
                             "move it away or use another --state-dir") from None
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"{self.state_path}: state version {meta.get('version')!r}, expected {STATE_VERSION}")
        if meta.get("device") != self.cid or meta.get("run") != self.peer.run:
            raise ValueError(f"{self.state_path} holds device {meta.get('device')!r} of run {meta.get('run')!r}, "
                             f"not {self.cid!r} of run {self.peer.run!r}: use another --state-dir")
        self.client.state = PrivateState(
            r_prev=float(meta["r_prev"]), rounds=int(meta["rounds"]), extra=dict(meta["extra"]),
            **{k: arrays.get(k) for k in _ARRAYS},
        )
        self.client.rng.bit_generator.state = meta["rng"]
        if "backend_rng" in arrays and meta.get("backend") == self.backend:
            self.client.backend.set_rng_state(arrays["backend_rng"])
        self.rounds_done = int(meta["rounds_done"])
        self.last_round = int(meta["last_round"])
        self.guard.confirm(self.last_round)  # saved only after the coordinator acked that round
        return True
