"""How a round's devices make progress: a scheduler advances them until the round is over.

The round driver (coordinator/driver.py) starts a round and closes it; between the two it hands
over to its scheduler:

- ``InProcessScheduler`` (``simulate``): the devices live in this process; each turn advances one
  device by one request (one local batch) in ``round_robin``, ``random`` or ``sequential`` order,
  so the coordinator answers activations interleaved as it would from real devices. A device whose
  request the coordinator holds (``waiting``: MergeSFL's merged step) takes no turn until its reply
  is released. The devices take their turns in a permutation drawn per round from the run's seed
  (``--device-order shuffled``), or in partition order every round (``fixed``): with a fixed order
  client-000 always steps the shared server copy first and the last device always last
  (docs/method.md, "Rounds").
- ``MessageScheduler`` (the coordinator service): the devices are elsewhere and their messages
  arrive on transport threads; it waits on the service's Condition, which updates and errors
  notify, so a round ends as soon as its last device is done, or at the deadline.

Either way the scheduler calls ``Coordinator.tick(clock.now())``, which applies the deadline, reads
``round_complete``, and hands what ``tick`` and ``fail`` return to the driver's ``send`` (the replies
to held requests they released); its ``lock`` is held around every call into the Coordinator (which
is not thread-safe).
"""

from __future__ import annotations

import contextlib
import heapq
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, ContextManager, Protocol

import numpy as np

from fedsga_edge.runfiles import device_timing
from fedsga_edge.transport import PendingReply
from fedsga_edge.wire import Outgoing

from .clock import Clock

__all__ = ["Scheduler", "InProcessScheduler", "MessageScheduler", "FleetScheduler", "DEVICE_ORDER_STREAM",
           "FLEET_STREAM", "Send", "round_order", "step_flops", "server_flops"]

Send = Callable[[Outgoing], None]  # the driver's: replies the coordinator emitted outside a device's message

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

    def advance(self, co: Any, clock: Clock, send: Send) -> None:
        """Advance devices until the round is over (``co.round_complete`` after ``co.tick(clock.now())``),
        handing what ``tick`` and ``fail`` return to ``send`` (called under ``lock``)."""


def over(co: Any, now: float, send: Send) -> bool:
    """Apply the deadline at ``now`` (its refusals of held requests go to ``send``): whether the round is over."""
    send(co.tick(now))
    return co.round_complete


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

    def advance(self, co: Any, clock: Clock, send: Send) -> None:
        active = [c for c in self.turn_order(co.round.t) if c.busy]
        while active and not over(co, clock.now(), send):
            # a device whose request the coordinator holds (MergeSFL's merged step) waits for its reply:
            # it takes no turn until the step's last device has sent
            ready = [c for c in active if not getattr(c, "waiting", False)]
            if not ready and (released := co.await_held()):  # a step out on another rank came back
                send(released)
                continue
            if not ready:  # the coordinator releases a step once every training device holds one
                raise RuntimeError("every running device waits for a reply the coordinator holds: "
                                   f"{[c.cid for c in active]}")
            if self.schedule == "sequential":
                client = ready[0]
            elif self.schedule == "random":
                client = ready[int(self.rng.integers(len(ready)))]
            else:  # round-robin: one request per device in turn
                client = ready[0]
                active.remove(client)
                active.append(client)
            started = time.perf_counter()
            more = self._step(co, client, send)
            clock.advance(time.perf_counter() - started)
            if not more:
                active.remove(client)
        for client in active:  # the deadline passed: what they still hold is dropped
            client.abort()

    @staticmethod
    def _step(co: Any, client: Any, send: Send) -> bool:
        try:
            more = client.step()
        except Exception as exc:  # a broken device must not stop the round
            client.abort()
            send(co.fail(client.cid, f"{type(exc).__name__}: {exc}"))
            return False
        if not more and client.last_error:
            send(co.fail(client.cid, client.last_error))
        return more


class MessageScheduler:
    """Waits for remote devices' messages; ``ready`` and ``devices`` come from whoever registers them."""

    def __init__(self, cond: threading.Condition, stop: threading.Event, *, ready: Callable[[int], None],
                 devices: Callable[[int], list[str]], poll_s: float = 0.05) -> None:
        self.lock: ContextManager[Any] = cond
        self._cond, self._stop, self.poll_s = cond, stop, poll_s
        self.ready, self.devices = ready, devices

    def advance(self, co: Any, clock: Clock, send: Send) -> None:
        while not over(co, clock.now(), send):
            if self._stop.is_set():
                for d in co.round.waiting:
                    send(co.fail(d, "coordinator stopped"))
                break
            self._cond.wait(self.poll_s)


# -- a fleet on a virtual clock (docs/fleet.md) -------------------------------------------------------------

# The availability draws' own random stream: np.random.default_rng([seed, t, FLEET_STREAM]).
FLEET_STREAM = 20


class _Dropped(BaseException):
    """Unwinds a device thread whose request the deadline overtook (not an ``Exception``: no device or
    scheduler handler may take it for the device's own failure)."""


class _Lane:
    """One device's round on its own thread, run only while the scheduler waits for it.

    A device step computes and then sends its request in one call (``SplitClient.step``); a
    discrete-event schedule must deliver requests in arrival order, which is known only once each
    request is computed. So each device steps on its own thread and stops at its transport (the
    gate) until the scheduler delivers it: exactly one thread runs at any time, in an order that
    depends only on the virtual times (deterministic)."""

    def __init__(self, client: Any, step: Callable[[Any], bool]) -> None:
        self.client, self._step = client, step
        self._go, self._back = threading.Semaphore(0), threading.Semaphore(0)
        self.kind: str | None = None
        self.body: dict[str, Any] | None = None
        self.up = self.down = 0
        self.state = "idle"  # idle -> computing -> gated -> delivered -> stepped | dropped
        self.more = True
        self.held: PendingReply | None = None  # its request's reply, when the coordinator holds it (MergeSFL)
        self.error: BaseException | None = None  # anything but a device's failure (_step takes those): re-raised
        self._drop = False
        self.thread = threading.Thread(target=self._run, name=f"fleet-{client.cid}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            if self._drop:
                return
            try:
                self.more = self._step(self.client)
            except _Dropped:
                self.state = "dropped"
                self._back.release()
                return
            except BaseException as exc:  # never leave the scheduler waiting on a dead thread
                self.error, self.more, self.state = exc, False, "stepped"
                self._back.release()
                return
            self.state = "stepped"
            self._back.release()
            if not self.more:
                return

    def compute(self) -> None:
        """Run the device until its next request is at the gate (or its round ended without one)."""
        self.kind, self.body, self.up, self.down, self.state = None, None, 0, 0, "computing"
        self.held = None
        self._go.release()
        self._back.acquire()
        self._raise()

    def deliver(self) -> None:
        """Let the gated request through; back once the reply is in."""
        self._go.release()
        self._back.acquire()
        self._raise()

    def _raise(self) -> None:
        if self.error is not None:
            raise self.error

    def drop(self) -> None:
        """End the thread (the round closed): a gated request raises ``_Dropped`` inside the device."""
        gated = self.state == "gated"
        self._drop = True
        if self.thread.is_alive():
            self._go.release()
            if gated:
                self._back.acquire()
        self.thread.join()

    # the device thread's side, called from its peer and transport
    def note(self, kind: str, body: dict[str, Any] | None) -> None:
        self.kind, self.body = kind, body or {}

    def gate(self, nbytes: int) -> None:
        self.up, self.state = nbytes, "gated"
        self._back.release()
        self._go.acquire()
        if self._drop:
            raise _Dropped
        self.state = "delivered"


class _NotingPeer:
    """A device's Peer that tells its lane which request it is about to send (the FLOPs depend on it)."""

    def __init__(self, peer: Any, sched: "FleetScheduler", cid: str) -> None:
        self._peer, self._sched, self._cid = peer, sched, cid

    def call(self, dst: str, kind: str, round: int, body: dict[str, Any] | None = None, **kw: Any) -> Any:
        self._sched._note(self._cid, kind, body)
        return self._peer.call(dst, kind, round, body, **kw)

    def send(self, dst: str, kind: str, round: int, body: dict[str, Any] | None = None) -> None:
        self._sched._note(self._cid, kind, body)
        self._peer.send(dst, kind, round, body)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peer, name)


class _GatedTransport:
    """A device's view of the shared transport: each request or one-way message waits at its lane's gate."""

    def __init__(self, inner: Any, sched: "FleetScheduler", cid: str) -> None:
        self._inner, self._sched, self._cid = inner, sched, cid

    def request(self, src: str, dst: str, payload: bytes, *, timeout: float | None = None) -> bytes:
        lane = self._sched._lanes.get(self._cid)
        if lane is not None:
            lane.gate(len(payload))
        reply = self._inner.request(src, dst, payload, timeout=timeout)
        if lane is not None:
            if isinstance(reply, PendingReply):  # held by the coordinator: its bytes come when it is released
                lane.held = reply
            else:
                lane.down = len(reply)
        return reply

    def send(self, src: str, dst: str, payload: bytes) -> None:
        lane = self._sched._lanes.get(self._cid)
        if lane is not None:
            lane.gate(len(payload))
        self._inner.send(src, dst, payload)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def step_flops(kind: str | None, body: dict[str, Any] | None, costs: Any, train: Any) -> float:
    """The device FLOPs behind one request (docs/fleet.md, "The time model"): an activation is one batch's
    forward and backward at its split, an evaluation or a probe a forward of its samples, a whole-model
    update its local training (FedAvg trains without a request per batch); fetches and split updates
    cost nothing. FedSGA's observation forward (one batch at round start) is not counted."""
    if not kind or not body:
        return 0.0
    n = len(body["y"]) if body.get("y") is not None else 0
    if kind == "activation":
        return float(n * costs.train(int(body.get("split") or 0)))
    if kind == "evaluate":
        return float(n * costs.prefix_fwd(int(body.get("split") or 0)))
    if kind == "probe":
        from fedsga_edge.method.policy import reference_index

        return float(n * costs.prefix_fwd(reference_index(max(costs.prefix))))
    if kind == "update" and body.get("split") is None and "num_samples" in body:
        from .server import samples_per_epoch

        seen = train.local_epochs * samples_per_epoch(int(body["num_samples"]), train.batch_size, train.max_batches,
                                                     train.batching)
        return float(seen * costs.train(0))
    return 0.0


def server_flops(kind: str | None, body: dict[str, Any] | None, costs: Any) -> float:
    """The coordinator's FLOPs for a request: the rest of the model on an activation (forward and backward,
    about three forwards), nothing else (probes, evaluations and aggregation are not modelled)."""
    if kind != "activation" or not body or body.get("y") is None:
        return 0.0
    return float(3 * len(body["y"]) * costs.suffix_fwd(int(body.get("split") or 0)))


class FleetScheduler:
    """``simulate --fleet``: the in-process devices on a discrete-event schedule of virtual time.

    A device's step takes its FLOPs over its class's speed, its bytes over its link and half its
    round trip each way; the coordinator serves requests in the order they would arrive, at that
    time on the clock (so ``--round-timeout`` and dropouts act on the fleet's time, not the host's).
    Ties go to the round's device order (``round_order``), so a run is a function of its seed. The
    coordinator's own compute is free unless the fleet has ``[server] gflops`` (then it serves one
    request at a time, FIFO). A request the coordinator holds (MergeSFL) parks its device until the
    step's last device has sent: its reply then leaves when that request's service ends.
    ``round_fields`` gives the round's ``fleet_s`` and per-device ``timing``
    (docs/fleet.md, "Per-device timing").
    """

    def __init__(self, clients: Sequence[Any], classes: dict[str, Any], costs: Any, train: Any, *,
                 order: str = "shuffled", seed: int = 0, server_gflops: float | None = None,
                 server: str = "coordinator") -> None:
        self.clients = list(clients)
        missing = [c.cid for c in self.clients if c.cid not in classes]
        if missing:
            raise ValueError(f"no fleet class for device(s) {missing}")
        self.classes, self.costs, self.train = classes, costs, train
        self.order, self.seed, self.server_gflops, self.server = order, seed, server_gflops, server
        round_order(len(self.clients), 1, seed, order)
        self.lock: ContextManager[Any] = contextlib.nullcontext()
        self._lanes: dict[str, _Lane] = {}
        self._warm: set[str] = set()  # devices past their first step (a class's warmup_s is paid once)
        self._down_seen: dict[str, int] = {c.cid: 0 for c in self.clients}
        self._fields: dict[str, Any] = {}
        for c in self.clients:  # each device's requests stop at its gate; the coordinator's peer is untouched
            c.peer.transport = _GatedTransport(c.peer.transport, self, c.cid)
            c.peer = _NotingPeer(c.peer, self, c.cid)

    def ready(self, first: int) -> None:
        pass

    def devices(self, t: int) -> list[str]:
        return [c.cid for c in self.clients]

    def missed(self, t: int) -> set[str]:
        """The devices that miss round ``t`` (each with its class's 1 - availability), from the seed alone."""
        u = np.random.default_rng([self.seed, t, FLEET_STREAM]).random(len(self.clients))
        return {c.cid for c, x in zip(self.clients, u) if x >= self.classes[c.cid].availability}

    def _note(self, cid: str, kind: str, body: dict[str, Any] | None) -> None:
        lane = self._lanes.get(cid)
        if lane is not None:
            lane.note(kind, body)

    def round_fields(self) -> dict[str, Any]:
        """The last round's ``fleet_s`` and ``timing`` (added to its metrics record by the driver)."""
        return self._fields

    def advance(self, co: Any, clock: Clock, send: Send) -> None:
        t0 = clock.now()
        t = co.round.t
        rank = {c.cid: i for i, c in enumerate(self.turn_order(t))}
        started = {c.cid for c in self.clients if c.busy}
        timing: dict[str, dict[str, Any]] = {}
        events: list[tuple[float, int, int, str]] = []  # (time, 0 arrival | 1 compute start, rank, device)
        self._start_lanes(co, send, t0, started, rank, timing, events)
        server_free = t0
        pending: dict[str, tuple[float, float, float, int]] = {}  # device -> its request in flight
        held: set[str] = set()  # devices whose request the coordinator holds (MergeSFL's merged step)
        try:
            while events and not over(co, clock.now(), send):
                when, kind, _, cid = heapq.heappop(events)
                lane, cls, tm = self._lanes[cid], self.classes[cid], timing[cid]
                if kind == 1:  # the device computes its next request from ``when`` on
                    lane.compute()
                    self._wake(held, when, events, timing, rank)  # a device that failed releases a step
                    if lane.state != "gated":  # its round ended without another message
                        tm["done_s"] = when - t0
                        continue
                    c = cls.compute_s(step_flops(lane.kind, lane.body, self.costs, self.train))
                    if cid not in self._warm:  # a fresh device process's one-time work, before its first request
                        self._warm.add(cid)
                        c += getattr(cls, "warmup_s", 0.0)
                    up = cls.up_s(lane.up) + cls.rtt_ms / 2e3
                    if lane.kind in ("activation", "evaluate", "update") and lane.body:
                        split = lane.body.get("split")
                        tm["split"] = 0 if split is None and lane.kind == "update" else split
                    pending[cid] = (when, c, up, lane.up)  # counted once it arrives (or clipped at the close)
                    heapq.heappush(events, (when + c + up, 0, rank[cid], cid))
                    continue
                dl = co.round.deadline
                if dl is not None and when >= dl:  # it would arrive too late: the round closes at its deadline
                    clock.set(dl)
                    send(co.tick(dl))
                    break
                clock.set(when)  # the request arrives: the coordinator sees it at this time
                _, c, up, nbytes = pending.pop(cid)
                tm["compute_s"] += c
                tm["wire_s"] += up
                tm["bytes_up"] += nbytes
                serve = 0.0
                if self.server_gflops:
                    serve = server_flops(lane.kind, lane.body, self.costs) / (self.server_gflops * 1e9)
                    server_free = max(server_free, when) + serve
                    serve = server_free - when  # queueing behind earlier requests, then its own compute
                lane.deliver()
                if lane.held is not None and lane.held.ready:  # answered at once after all
                    lane.down, lane.held = lane.held.nbytes, None
                self._wake(held, when + serve, events, timing, rank)  # the step this request completed
                if lane.held is not None:  # held: its reply comes when the step's last device has sent
                    held.add(cid)
                    continue
                if lane.kind == "error" or lane.state == "stepped" and not lane.more and lane.down == 0:
                    tm["done_s"] = when - t0
                    continue
                down = cls.down_s(lane.down) + cls.rtt_ms / 2e3
                tm["wire_s"] += down
                tm["bytes_down"] += lane.down
                self._down_seen[cid] += lane.down
                if lane.state == "stepped" and not lane.more:
                    tm["done_s"] = when + serve + down - t0
                    tm["tail"] = down  # its last reply (the update's ack): may come after the round closed
                    continue
                heapq.heappush(events, (when + serve + down, 1, rank[cid], cid))
            if not over(co, clock.now(), send) and co.round.deadline is not None:  # only silent devices left
                clock.set(max(clock.now(), co.round.deadline))
                send(co.tick(clock.now()))
        finally:
            for cid, lane in self._lanes.items():
                if lane.thread.is_alive():
                    lane.drop()
                    lane.client.abort()
            self._lanes = {}
        self._fields = _round_timing(timing, pending, t0, clock.now())

    def turn_order(self, t: int) -> list[Any]:
        return [self.clients[i] for i in round_order(len(self.clients), t, self.seed, self.order)]

    def _start_lanes(self, co: Any, send: Send, t0: float, started: set[str], rank: dict[str, int],
                     timing: dict[str, dict[str, Any]], events: list[tuple[float, int, int, str]]) -> None:
        """Each started device's round start crosses its link (a device that misses the round never hears
        it) and its lane is ready to compute its first request."""
        missed = self.missed(co.round.t) & started
        for client in self.clients:
            cid = client.cid
            if cid not in started:
                continue
            cls = self.classes[cid]
            rs = self._round_start_bytes(client)
            timing[cid] = {"class": cls.name, "compute_s": 0.0, "wire_s": 0.0, "wait_s": 0.0, "bytes_up": 0,
                           "bytes_down": rs, "split": None}
            if cid in missed:
                timing[cid]["missed"] = True
                client.abort()  # it never heard the round start: silent until the deadline
                if co.cfg.round_timeout <= 0:  # nobody would ever close the round: the coordinator is told at once
                    send(co.fail(cid, "missed the round (fleet availability)"))
                continue
            wire = cls.down_s(rs) + cls.rtt_ms / 2e3
            timing[cid]["wire_s"] = wire
            self._lanes[cid] = _Lane(client, lambda c, co=co: InProcessScheduler._step(co, c, send))
            heapq.heappush(events, (t0 + wire, 1, rank[cid], cid))

    def _wake(self, held: set[str], at: float, events: list[tuple[float, int, int, str]],
              timing: dict[str, dict[str, Any]], rank: dict[str, int]) -> None:
        """Held devices whose reply was released: it leaves the coordinator at ``at`` and crosses their link."""
        for cid in sorted(held, key=rank.__getitem__):
            lane, cls, tm = self._lanes[cid], self.classes[cid], timing[cid]
            if lane.held is not None and not lane.held.ready:
                continue
            held.discard(cid)
            nbytes = lane.held.nbytes if lane.held is not None else 0
            lane.held = None
            down = cls.down_s(nbytes) + cls.rtt_ms / 2e3
            tm["wire_s"] += down
            tm["bytes_down"] += nbytes
            self._down_seen[cid] += nbytes
            heapq.heappush(events, (at + down, 1, rank[cid], cid))

    def _round_start_bytes(self, client: Any) -> int:
        """What the round start to ``client`` weighed: the coordinator's bytes to it not yet accounted."""
        stats = getattr(client.peer.transport, "stats", None)
        if stats is None:
            return 0
        total = stats.bytes_sent(src=self.server, dst=client.cid)
        rs = total - self._down_seen[client.cid]
        self._down_seen[client.cid] = total
        return rs


def _round_timing(timing: dict[str, dict[str, Any]], pending: dict[str, tuple[float, float, float, int]],
                  t0: float, end: float) -> dict[str, Any]:
    """The round's ``fleet_s`` and per-device ``timing`` once it ended at ``end``: requests the deadline cut
    count the part done before it; an ack still on its way at the close is not in the round."""
    for cid, (start, c, up, _) in pending.items():
        busy = max(0.0, end - start)
        timing[cid]["compute_s"] += min(c, busy)
        timing[cid]["wire_s"] += min(up, max(0.0, busy - c))
    for tm in timing.values():
        if "tail" in tm:
            tm["wire_s"] -= min(tm.pop("tail"), max(0.0, t0 + tm["done_s"] - end))
    out = {}
    for cid, tm in timing.items():
        missed = bool(tm.get("missed"))
        wait = 0.0 if missed else max(0.0, end - t0 - tm["compute_s"] - tm["wire_s"])
        out[cid] = device_timing(split=tm["split"], compute_s=tm["compute_s"], wire_s=tm["wire_s"], wait_s=wait,
                                 bytes_up=tm["bytes_up"], bytes_down=tm["bytes_down"], done_s=tm.get("done_s"),
                                 cls=tm["class"], missed=missed)
    return {"fleet_s": end - t0, "timing": out}
