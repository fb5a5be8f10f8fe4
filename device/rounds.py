"""The device's round loop: round_starts queued by the delivery thread, run one at a time on the agent's worker.

The role is stepped (docs/method.md, "Rounds"): ``handle(round_start)`` arms a round and ``step()``
advances it one request at a time. Never on the delivery thread: on MQTT that thread also delivers to
this address, and a round takes minutes; on the loopback it is the coordinator's service loop, which
must go on starting the other devices. A newer round_start supersedes the running round (a later
round, or the same round again from a resumed coordinator). Only a round whose update the coordinator
acked is saved; any other is rolled back to the snapshot taken before it (docs/protocol.md, "Faults").
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

from fedsga_edge.runfiles import JsonLog
from fedsga_edge.transport import Peer
from fedsga_edge.wire import Message, RemoteProtocolError

from .orders import OrderCheck
from .progress import Progress
from .role import SplitClient
from .statefile import Snapshot

__all__ = ["RoundLoop"]


class RoundLoop:
    """The queued round_starts, the newest one announced, and the round running now."""

    def __init__(self, client: SplitClient, peer: Peer, server: str, log: JsonLog, progress: Progress,
                 orders: OrderCheck, *, step: Callable[[], bool], save: Callable[[], None],
                 verify: Callable[[], None], stop: threading.Event) -> None:
        self.client = client
        self.peer = peer
        self.server = server
        self.log = log
        self.progress = progress
        self.orders = orders
        self.step = step  # one request of the running round (the agent's seam for tests)
        self.save = save
        self.verify = verify
        self.stop = stop
        self.queue: queue.Queue[Message] = queue.Queue()
        self.latest = 0  # newest round announced; an older running round is abandoned for it
        self.newest: Message | None = None  # the last round_start (a resumed coordinator sends a round again)
        self.current: int | None = None
        self._lock = threading.Lock()

    def offer(self, msg: Message) -> None:
        """Queue a checked round_start (delivery thread): it supersedes any older round from now on."""
        with self._lock:
            self.latest = max(self.latest, msg.round)
            self.newest = msg
        self.queue.put(msg)

    def work(self) -> None:
        """The worker thread: run queued rounds until stopped; the agent outlives any one round."""
        while not self.stop.is_set():
            if self.orders.pending is not None:
                self.verify()
            try:
                msg = self.queue.get(timeout=0.2)
            except queue.Empty:
                continue
            if self.superseded(msg):
                self.log.warning("round_skipped", round=msg.round, newer=self.latest)
                continue
            try:
                self.run_round(msg)
            except Exception as exc:  # the agent outlives any one round
                self.progress.last_error = f"{type(exc).__name__}: {exc}"
                self.log.error("round_crash", round=msg.round, error=self.progress.last_error[:500])

    def run_round(self, msg: Message) -> None:
        """Arm, drive and settle one round, logging its begin and end."""
        t = msg.round
        try:
            self.client.handle(msg)
        except RemoteProtocolError as exc:
            self.progress.last_error = f"bad round_start: {exc}"
            self.log.error("round_refused", round=t, error=self.progress.last_error[:500])
            self.report(t, self.progress.last_error)
            return
        before = Snapshot.take(self.client)
        self.current = t
        started = time.perf_counter()
        self.log.info("round_begin", round=t, split=msg.body.get("split"), calibrate=bool(msg.body.get("calibrate")))
        try:
            outcome = self._drive(msg)
            if outcome is None:
                return  # like a power loss: nothing saved
            outcome = self._settle(msg, outcome, before)
        finally:
            self.current = None
        level = "info" if outcome == "done" else "warning"
        self.log.log("round_end", level, round=t, outcome=outcome, wall_s=time.perf_counter() - started,
                     r_prev=self.client.state.r_prev, error=self.progress.last_error if outcome != "done" else None)

    def _drive(self, msg: Message) -> str | None:
        """Step the armed round to its end: "done", "superseded" or "failed"; None when the agent stopped."""
        client = self.client
        while True:
            if self.stop.is_set():
                client.abort()
                self.log.warning("round_abandoned", round=msg.round, reason="agent stopped")
                return None
            if self.superseded(msg):
                client.abort()
                return "superseded"
            try:
                more = self.step()
            except Exception as exc:  # transport down, reply timeout, a bug in a step
                client.abort()
                if self.superseded(msg):  # waited on a coordinator that has restarted: nothing to report
                    return "superseded"
                self.progress.last_error = f"{type(exc).__name__}: {exc}"
                self.report(msg.round, self.progress.last_error)
                return "failed"
            if not more:
                return "done"

    def _settle(self, msg: Message, outcome: str, before: Snapshot) -> str:
        """Save a round the coordinator acked; roll any other back (an unfinished round leaves no trace)."""
        client, progress = self.client, self.progress
        if outcome == "done" and client.last_error:  # the coordinator refused a request or the update
            outcome, progress.last_error = "refused", client.last_error
            # a refused request was reported already; a round that a resumed coordinator sent again is not
            if client.last_error.startswith("update refused") and not self.superseded(msg):
                self.report(msg.round, client.last_error)
        progress.last_round = msg.round
        if outcome == "done":
            progress.rounds_done += 0 if msg.body.get("evaluate_only") else 1  # the final evaluation trains nothing
            progress.last_error = None
            self.save()
        else:
            before.restore(client)
            self._forget_unconfirmed(msg)
        return outcome

    def superseded(self, msg: Message) -> bool:
        """A newer round_start arrived: a later round, or this round again from a resumed coordinator."""
        newest = self.newest
        return msg.round < self.latest or (newest is not None and newest is not msg and newest.round >= msg.round)

    def _forget_unconfirmed(self, msg: Message) -> None:
        """A failed round the coordinator never answered a request of may not exist (a forged round_start
        within the bound): it must not make the real rounds up to it look stale."""
        if self.orders.confirmed() >= msg.round:
            return
        with self._lock:
            if self.newest is msg:
                self.newest = None
                self.latest = min(self.latest, self.orders.guard.confirmed)

    def report(self, t: int, reason: str) -> None:
        """Tell the coordinator this device gives up round t, so the round need not wait for its deadline."""
        try:
            self.peer.send(self.server, "error", t, {"reason": reason[:500]})
        except Exception as exc:
            self.log.warning("error_not_delivered", round=t, error=f"{type(exc).__name__}: {exc}"[:300])
