"""Handlers of registered addresses: one worker thread and queue each, fed by inbound dispatch.

Handlers never run on paho's network thread, so one may block, train, or itself send a request.
Requests to one address are handled one at a time, in arrival order. The bytes queued for
handlers count against ``max_buffer_bytes``; a request that would pass it is refused.

A handler that leaves a request open returns an ``OpenRequest`` token: the pool keeps the request's
reply topic and correlation id under it (the requester's ``request`` keeps waiting), and ``reply``
publishes the reply there when the handler's owner releases it (MergeSFL's merged step).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import OrderedDict
from dataclasses import dataclass, field

from ...logthrottle import ThrottledLog
from ..base import Handler, OpenRequest, TransportError, TransportStats
from .frames import Frame, as_bytes_view
from .health import Health
from .outbound import Publisher
from .topics import BROADCAST

__all__ = ["HandlerPool", "Job", "SeenRequests", "Worker"]

log = logging.getLogger(__name__)

JOB_COST = 256  # a queued job's bookkeeping, counted with its payload against max_buffer_bytes
SEEN_PER_TOPIC = 1024  # request cids remembered per topic (QoS 1 redeliveries), so floods stay their own
SEEN_TOPICS = 4096
OPEN = 4096  # requests left open, and replies that came before their token was seen, kept at most


@dataclass(slots=True)
class Job:
    src: str  # observed sender (from the topic)
    op: str  # "req" or "send"
    cid: str
    payload: bytes
    reply_topic: str


@dataclass(slots=True, eq=False)
class Worker:
    """One address's handler, the queue that feeds it and the thread that runs it."""

    address: str
    handler: Handler
    queue: queue.Queue[Job | None] = field(default_factory=queue.Queue)
    thread: threading.Thread | None = None


class SeenRequests:
    """Request cids already queued or handled, per topic, so a QoS 1 redelivery runs its handler once;
    kept per topic so one publisher's flood evicts only its own."""

    def __init__(self) -> None:
        self._seen: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()

    def first_time(self, topic: str, cid: str) -> bool:
        """Remember ``cid`` on ``topic``; False if it was already there. Call under the transport's lock."""
        seen = self._seen.get(topic)
        if seen is None:
            seen = self._seen[topic] = OrderedDict()
            while len(self._seen) > SEEN_TOPICS:
                self._seen.popitem(last=False)
        self._seen.move_to_end(topic)
        if cid in seen:
            return False
        seen[cid] = None
        while len(seen) > SEEN_PER_TOPIC:
            seen.popitem(last=False)
        return True


class HandlerPool:
    """The registered addresses' workers, the bytes queued for them, and the sender each handler sees."""

    def __init__(self, lock: threading.RLock, coordinator: str, max_buffer_bytes: int, publisher: Publisher,
                 stats: TransportStats, local: set[str], health: Health, client_id: str) -> None:
        self._lock = lock
        self._coordinator = coordinator
        self._max_buffer_bytes = max_buffer_bytes
        self._out = publisher
        self._stats = stats
        self._local = local  # addresses this transport speaks for: their payloads were counted when sent
        self._health = health
        self._client_id = client_id
        self.workers: dict[str, Worker] = {}
        self.queued_bytes = 0
        self._seen = SeenRequests()
        # (address, sender, seq) -> (reply topic, cid, observed sender) of a request left open
        self._open: OrderedDict[tuple[str, str, int], tuple[str, str, str]] = OrderedDict()
        self._early: OrderedDict[tuple[str, str, int], bytes] = OrderedDict()
        self._thread_state = threading.local()
        # A handler that raises is our bug (roles answer bad input with an error reply), but bad input
        # triggers it: its tracebacks are throttled like lines about hostile input.
        self.noise = ThrottledLog(log)

    # ------------------------------------------------------------- the table (under the transport's lock)

    def add(self, address: str, handler: Handler) -> Worker:
        """A worker for ``address``, its thread not yet started."""
        w = Worker(address, handler)
        w.thread = threading.Thread(target=self._work, args=(w,), name=f"mqtt-handler-{address}", daemon=True)
        with self._lock:
            if address in self.workers:
                raise TransportError(f"address {address!r} is already registered; unregister it first")
            self.workers[address] = w
        return w

    def pop(self, address: str) -> Worker:
        with self._lock:
            w = self.workers.pop(address, None)
            if w is None:
                raise TransportError(f"address {address!r} is not registered")
            return w

    def take_all(self) -> list[Worker]:
        with self._lock:
            workers = list(self.workers.values())
            self.workers.clear()
            return workers

    @staticmethod
    def stop(workers: list[Worker]) -> None:
        """Let each worker finish the job at hand and exit."""
        for w in workers:
            w.queue.put(None)

    @staticmethod
    def join(workers: list[Worker], timeout: float = 2.0) -> None:
        me = threading.current_thread()
        for w in workers:
            if w.thread is not me and w.thread is not None:
                w.thread.join(timeout=timeout)

    def observed_sender(self) -> str | None:
        """Inside a handler: the address the payload came from, read off its topic (else None)."""
        return getattr(self._thread_state, "sender", None)

    # ------------------------------------------------------------- inbound (paho's network thread)

    def dispatch(self, src: str, dst: str, frame: Frame, payload: bytes, topic: str, reply_topic: str) -> None:
        """Queue a whole request or one-way payload for ``dst``'s handler (every device's, for a broadcast);
        refuse it with an error reply when nobody serves ``dst`` or the queues are full."""
        refuse = None
        cost = len(payload) + JOB_COST
        with self._lock:
            if not self._seen.first_time(topic, frame.cid):  # QoS 1 redelivery of a request queued or handled
                self._health.count("duplicates")
                return
            if dst == BROADCAST:
                workers = [w for a, w in self.workers.items() if a != self._coordinator]
            else:
                workers = [self.workers[dst]] if dst in self.workers else []
            if not workers:
                self._health.count("no_handler")
                refuse = f"no handler registered at {dst!r}"
            elif self.queued_bytes + cost * len(workers) > self._max_buffer_bytes:
                self._health.count("rejected")
                refuse = f"{dst!r} is busy: its handler queue holds over {self._max_buffer_bytes} bytes"
            else:
                self.queued_bytes += cost * len(workers)
                if src not in self._local:
                    self._stats.record(src, dst, len(payload))
        if refuse is not None:
            if frame.op == "req":
                self._out.publish_error(reply_topic, frame.cid, refuse)
            return
        for w in workers:
            w.queue.put(Job(src, frame.op, frame.cid, payload, reply_topic))

    # ------------------------------------------------------------- worker threads

    def _work(self, w: Worker) -> None:
        while True:
            job = w.queue.get()
            if job is None:
                return
            with self._lock:
                self.queued_bytes -= len(job.payload) + JOB_COST
                current = self.workers.get(w.address) is w
            if not current:  # unregistered while this waited
                if job.op == "req":
                    self._out.publish_error(job.reply_topic, job.cid, f"{w.address!r} left")
                continue
            self._handle(w, job)

    def _handle(self, w: Worker, job: Job) -> None:
        self._thread_state.sender = job.src
        try:
            out = w.handler(job.payload)
        except Exception as e:
            self._health.count("handler_errors")
            ok, due = self.noise.throttle.hit(("handler errors of", w.address))
            self.noise.write(due)
            if ok:
                log.exception("%s: handler of %r raised", self._client_id, w.address)
            if job.op == "req":
                reason = f"handler of {w.address!r} raised {type(e).__name__}: {e}"
                self._out.publish_error(job.reply_topic, job.cid, reason)
            return
        finally:
            self._thread_state.sender = None
        if job.op != "req":
            return  # one-way: a reply goes nowhere and is not counted
        if isinstance(out, OpenRequest):
            self._keep_open(w.address, out, job)
            return
        if out is None:
            self._out.publish_error(job.reply_topic, job.cid, f"{w.address!r} sent no reply")
            return
        if not isinstance(out, (bytes, bytearray, memoryview)):
            self._out.publish_error(job.reply_topic, job.cid, f"handler of {w.address!r} returned {type(out).__name__}")
            return
        self._publish_reply(w.address, job.src, job.reply_topic, job.cid, out)

    def _publish_reply(self, address: str, src: str, topic: str, cid: str, out: bytes | bytearray | memoryview) -> None:
        data = as_bytes_view(out)
        self._stats.record(address, src, data.nbytes)
        try:
            self._out.publish(topic, "rep", cid, address, data)
        except TransportError as e:
            log.error("%s: could not publish the reply of %r: %s", self._client_id, address, e)

    # ------------------------------------------------------------- replies to open requests

    def _keep_open(self, address: str, token: OpenRequest, job: Job) -> None:
        """Keep where the reply to ``job`` goes until ``reply`` (or publish it now if it came first)."""
        key = (address, token.sender, token.seq)
        evicted = None
        with self._lock:
            early = self._early.pop(key, None)
            if early is None:
                self._open[key] = (job.reply_topic, job.cid, job.src)
                if len(self._open) > OPEN:
                    evicted = self._open.popitem(last=False)[1]
        if early is not None:
            self._publish_reply(address, job.src, job.reply_topic, job.cid, early)
        if evicted is not None:  # never answered: its requester hears so rather than timing out
            self._out.publish_error(evicted[0], evicted[1], f"{address!r} holds too many requests")

    def reply(self, address: str, token: OpenRequest, payload: bytes | bytearray | memoryview) -> None:
        """The reply to the request ``address``'s handler answered with ``token``."""
        key = (address, token.sender, token.seq)
        with self._lock:
            entry = self._open.pop(key, None)
            if entry is None:  # the handler has not returned its token yet: published when it does
                self._early[key] = bytes(payload)
                while len(self._early) > OPEN:
                    self._early.popitem(last=False)
                return
        topic, cid, src = entry
        self._publish_reply(address, src, topic, cid, payload)
