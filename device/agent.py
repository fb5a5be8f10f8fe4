"""The device as a long-lived agent: a device role (``SplitClient``) and its ``Peer``, kept alive across rounds.

The agent is the driver for a real device, assembled from parts that each hold one concern:

* ``device.hello.Hello``: it registers with ``hello`` (backend, ``num_samples``, capabilities, its
  measured latency ``profile`` when given one) and retries while the coordinator is unreachable, until
  acked, refused or out of time;
* ``device.rounds.RoundLoop``: a ``round_start`` is queued by the transport's delivery thread and run on
  the agent's own worker thread (``while client.step(): pass``); a newer one supersedes it;
* ``device.statefile``: after every round the coordinator acked, the client's private state is saved
  to ``state_dir`` (an ``.npz`` of plain arrays, no pickle, no torch) and reloaded on start; a round
  that fails, is refused or is overtaken is rolled back to an in-memory snapshot;
* ``device.orders.OrderCheck``: it takes orders only from the coordinator, and a ``round_start`` or
  ``bye`` only within ``MAX_ROUNDS_AHEAD`` of the newest round it confirmed (``device.guard``);
  refusals go to ``agent.log``, throttled;
* ``device.progress.Progress``: registered, rounds done, the last round and error, shared by all.

``health()`` is what an operator (or a watchdog) reads: registered, rounds done, busy, last error.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from fedsga_edge.runfiles import JsonLog
from fedsga_edge.transport import Peer, TransportError
from fedsga_edge.wire import Message, RemoteProtocolError

from .hello import Hello, RegistrationRefused
from .orders import OrderCheck
from .progress import Progress
from .role import SplitClient, check_round_start
from .rounds import RoundLoop
from .statefile import STATE_FILE, StateFile

__all__ = ["STATE_FILE", "DeviceAgent", "RegistrationRefused"]


class _Field:
    """An agent attribute that one of its parts holds: read and written there, so the two never disagree."""

    def __init__(self, part: str, name: str) -> None:
        self.part, self.name = part, name

    def __get__(self, agent: Any, owner: type | None = None) -> Any:
        return self if agent is None else getattr(getattr(agent, self.part), self.name)

    def __set__(self, agent: Any, value: Any) -> None:
        setattr(getattr(agent, self.part), self.name, value)


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
        profile: dict[str, Any] | None = None,
        hello_timeout: float = 300.0,
        retry_s: float = 0.5,
    ) -> None:
        """``profile``: this device's measured latency per split, as its hello reports it
        (``fedsga_edge.latency.hello_profile``; ``device --latency-profile``); None: none reported."""
        self.client = client
        self.peer = peer
        self.server = server
        self.backend = client.backend.name
        # What a coordinator may want to know when it plans splits (logged; not used by the rounds yet).
        self.capabilities = capabilities if capabilities is not None else client.backend.capabilities()
        self.profile = profile  # its speed, for a coordinator that plans splits by it (--strategy resource)
        self.hello_timeout = hello_timeout
        self.retry_s = retry_s
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.log = JsonLog(self.state_dir / "agent.log")
        self.finished = threading.Event()  # the coordinator said bye: the run is over
        self._stop = threading.Event()
        self._worker: threading.Thread | None = None
        self._serving = False
        self._progress = Progress()
        self._file = StateFile(self.state_dir, client.cid, peer.run, self.backend)
        self._orders = OrderCheck(client, peer, server, self.log)
        self.guard = self._orders.guard
        self.refused = self._orders.refused  # orders refused, by event (health() reports them)
        self._hello = Hello(peer, server, self.log, self._progress, self._orders, self._hello_body, self._stop)
        self._rounds = RoundLoop(client, peer, server, self.log, self._progress, self._orders, step=self._step,
                                 save=self.save_state, verify=self._verify_round, stop=self._stop)
        if peer.on_reject is None:  # what the Peer refuses before _handle (a sender that is not its topic)
            peer.on_reject = self._orders.peer_rejected
        if getattr(peer, "admit", None) is None:  # the same checks on the envelope, before any tensor is built
            peer.admit = self._orders.check
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
        return self._file.path

    # -- lifecycle --------------------------------------------------------------------------------
    def start(self, *, register: bool = True, timeout: float | None = None) -> None:
        """Serve the device's address, start the worker and (by default) register before returning."""
        self.peer.register(self._handle)
        self._serving = True
        self._worker = threading.Thread(target=self._rounds.work, name=f"agent-{self.cid}", daemon=True)
        self._worker.start()
        self.log.info("agent_start", device=self.cid, run=self.peer.run, restored=self.restored,
                      rounds_done=self.rounds_done, state_rounds=self.client.state.rounds)
        if register:
            self.register(timeout)

    def register(self, timeout: float | None = None) -> dict[str, Any]:
        """Say hello until acked; RegistrationRefused on an error reply, TimeoutError when out of time."""
        return self._hello.register(self.hello_timeout if timeout is None else timeout, self.retry_s)

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
            "confirmed_round": self._orders.confirmed(),
            "refused": dict(self.refused),
        }

    @property
    def busy(self) -> bool:
        return self._current is not None or not self._queue.empty()

    # -- private state on disk ----------------------------------------------------------------------
    def save_state(self) -> None:
        """Everything private the next round needs (docs/method.md), replaced atomically."""
        self._file.save(self.client, self._progress)

    def load_state(self) -> bool:
        """Restore the state a previous agent of this device saved; False when there is none."""
        if not self._file.load(self.client, self._progress):
            return False
        self.guard.confirm(self.last_round)  # saved only after the coordinator acked that round
        return True

    # -- delivery thread ----------------------------------------------------------------------------
    def _handle(self, msg: Message) -> Message | None:
        """Queue work and return at once: the delivery thread must never train."""
        self._orders.check(msg)  # the Peer ran it on the envelope already (admit); again for a Peer without one
        if msg.kind == "round_start":
            try:
                check_round_start(msg.body)  # a malformed one must not supersede the round running now
            except RemoteProtocolError as exc:
                self._orders.refuse("round_start_refused", msg, str(exc))
            self._rounds.offer(msg)
            return None
        # a bye
        self.log.info("run_over", round=msg.round, reason=str(msg.body.get("reason", ""))[:200])
        self.finished.set()
        return None

    # -- worker thread ------------------------------------------------------------------------------
    def _step(self) -> bool:
        """One request of the running round (a seam for tests that need to freeze a device mid-round)."""
        return self.client.step()

    def _verify_round(self) -> None:
        """Ask the coordinator's round after a far-ahead round_start, if one is pending (``Hello.verify``)."""
        t = self._orders.take_pending()
        if t is not None:
            self._hello.verify(t)

    def _hello_body(self) -> dict[str, Any]:
        body = {"backend": self.backend, "num_samples": len(self.client.data), "capabilities": self.capabilities,
                "rounds_done": self.rounds_done, "state_rounds": self.client.state.rounds}
        held = getattr(self.client.data, "eval_indices", None)
        if held is not None and len(held):  # the held-out slice's size: the weight of its federated evaluation
            body["eval_samples"] = len(held)
        if self.profile is not None:
            body["profile"] = self.profile
        return body

    # -- what the parts hold, under the names callers and tests use ----------------------------------
    registered = _Field("_progress", "registered")
    rounds_done = _Field("_progress", "rounds_done")
    last_round = _Field("_progress", "last_round")
    last_error = _Field("_progress", "last_error")
    _queue = _Field("_rounds", "queue")
    _latest = _Field("_rounds", "latest")
    _newest = _Field("_rounds", "newest")
    _current = _Field("_rounds", "current")
    _verify = _Field("_orders", "pending")
