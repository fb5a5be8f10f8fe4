"""``MqttTransport``: the Transport API over one MQTT connection, wired from the package's parts."""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any
from urllib.parse import unquote, urlsplit

from ..base import Handler, OpenRequest, Transport, TransportError, TransportStats, check_address
from .connection import Login, import_paho, new_client
from .frames import Frame, as_bytes_view
from .handlers import HandlerPool
from .health import Health
from .inbound import Inbound
from .outbound import Publisher
from .pending import PendingReplies
from .presence import Presence
from .session import Session
from .topics import Topics

__all__ = ["MqttTransport"]

log = logging.getLogger(__name__)


def _check_settings(run: str, coordinator: str, client_id: str | None, username: str | None, max_packet: int,
                    timeouts: tuple[float, ...]) -> str:
    """Refuse settings that cannot work before touching the network; the client id to use.

    Without one, a login connects as itself: a broker-config Mosquitto replaces every client id by the
    login anyway (``use_username_as_clientid``), and its ACL grants ``status/<login>`` only."""
    for name, value in (("run", run), ("coordinator", coordinator)):
        try:
            check_address(value)
        except TransportError as e:
            raise TransportError(f"{name}: {e}") from None
    if not client_id and username and _is_address(username):
        client_id = username
    client_id = client_id or f"{run}-{os.urandom(6).hex()}"
    check_address(client_id)
    if max_packet < 4096:
        raise TransportError(f"max_packet={max_packet} is too small (at least 4096)")
    if any(t <= 0 for t in timeouts):
        raise TransportError("timeouts must be positive")
    return client_id


def _is_address(name: str) -> bool:
    try:
        check_address(name)
    except TransportError:
        return False
    return True


class MqttTransport(Transport):
    """Coordinator <-> device traffic over one MQTT connection; see the package doc.

    One instance may serve several addresses (a coordinator, or several
    simulated devices). Thread-safe. ``stats`` counts each payload once per
    instance, as handed to the transport (before framing and chunking): what
    it publishes, plus what it receives from addresses that are not its own.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 1883,
        *,
        run: str,
        client_id: str | None = None,
        coordinator: str = "coordinator",
        username: str | None = None,
        password: str | None = None,
        tls: bool = False,
        ca: str | None = None,
        certfile: str | None = None,
        keyfile: str | None = None,
        max_packet: int = 256 * 1024,
        max_buffer_bytes: int = 128 * 1024 * 1024,
        reassembly_timeout: float = 60.0,
        keepalive: int = 30,
        reconnect_min: float = 1.0,
        reconnect_max: float = 30.0,
        request_timeout: float = 60.0,
        connect_timeout: float = 10.0,
        clean_session: bool = False,
    ) -> None:
        """Connect (waiting up to ``connect_timeout``) and announce ``online``.

        ``max_packet`` must not exceed the broker's packet limit: larger
        payloads are chunked to fit it. ``max_buffer_bytes`` caps both the
        bytes held by partly reassembled messages and the bytes queued for
        handlers. ``clean_session=False`` keeps the broker session (and the
        QoS 1 messages queued for us) across a network blip; the client id
        must then be unique per process.
        """
        paho = import_paho()
        client_id = _check_settings(run, coordinator, client_id, username, max_packet,
                                    (request_timeout, connect_timeout, reassembly_timeout))
        self.stats = TransportStats()
        self.run = run
        self.client_id = client_id
        self.coordinator = coordinator
        self.max_packet = max_packet
        self.max_buffer_bytes = max_buffer_bytes
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self._topics = Topics(run, coordinator)
        self.status_topic = self._topics.status(client_id)
        health = Health()
        self.counters = health.counters  # see Health for what each one counts
        self._lock = threading.RLock()  # one lock for the session, the pending table and the handlers
        self._local: set[str] = set()  # addresses this instance speaks for

        client = new_client(paho, client_id, Login(username, password, tls, ca, certfile, keyfile),
                            clean_session=clean_session, reconnect_min=reconnect_min, reconnect_max=reconnect_max)
        self._session = Session(client, paho.codes, Presence(self.status_topic), self._lock, client_id)
        self._out = Publisher(client, paho.codes, max_packet, client_id)
        self._pending = PendingReplies(self._lock, self._topics, self.stats, self._local, health)
        self._handlers = HandlerPool(self._lock, coordinator, max_buffer_bytes, self._out, self.stats, self._local,
                                     health, client_id)
        self._inbound = inbound = Inbound(self._topics, self._out, health, client_id, max_buffer_bytes=max_buffer_bytes,
                                          reassembly_timeout=reassembly_timeout, answer=self._pending.answer,
                                          dispatch=self._dispatch)
        self.reassembler = inbound.reassembler
        client.on_message = inbound.on_message
        self._session.connect(host, port, keepalive, connect_timeout)

    @classmethod
    def from_url(cls, url: str, *, run: str, **kwargs: Any) -> MqttTransport:
        """``mqtt://[user[:pass]@]host[:port]`` or ``mqtts://...`` (TLS, default port 8883)."""
        u = urlsplit(url)
        if u.scheme not in ("mqtt", "mqtts") or not u.hostname:
            raise TransportError(f"broker url must look like mqtt://host:1883 or mqtts://host:8883, got {url!r}")
        tls = u.scheme == "mqtts"
        try:
            port = u.port or (8883 if tls else 1883)
        except ValueError as e:
            raise TransportError(f"bad port in broker url {url!r}") from e
        kwargs.setdefault("username", unquote(u.username) if u.username else None)
        kwargs.setdefault("password", unquote(u.password) if u.password else None)
        kwargs["tls"] = kwargs.get("tls", False) or tls
        return cls(u.hostname, port, run=run, **kwargs)

    def topic(self, src: str, dst: str) -> str:
        """The topic a payload from ``src`` to ``dst`` travels on."""
        return self._topics.route(src, dst)

    # ------------------------------------------------------------- the Transport API

    def register(self, address: str, handler: Handler) -> None:
        check_address(address)
        if not callable(handler):
            raise TransportError(f"handler for {address!r} is not callable")
        with self._lock:
            self._session.check_open()
            worker = self._handlers.add(address, handler)
            self._local.add(address)
        assert worker.thread is not None
        worker.thread.start()
        try:
            self._session.subscribe(self._topics.inbound(address), time.monotonic() + self.connect_timeout)
        except TransportError as e:  # the broker is away: on_connect subscribes once it is back
            log.warning("%s: registered %r but not yet subscribed: %s", self.client_id, address, e)

    def unregister(self, address: str) -> None:
        with self._lock:
            worker = self._handlers.pop(address)
            still = {t for a in self._handlers.workers for t in self._topics.inbound(a)}
            drop = [t for t in self._topics.inbound(address) if t not in still]
            self._session.forget(drop)
        HandlerPool.stop([worker])
        if drop:
            self._session.unsubscribe(drop)

    def request(self, src: str, dst: str, payload: bytes, *, timeout: float | None = None) -> bytes:
        """Publish ``payload`` and block until the reply; ``timeout=None`` means ``request_timeout``."""
        if timeout is not None and timeout <= 0:
            raise TransportError(f"timeout must be positive, got {timeout}")
        wait = self.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        data = as_bytes_view(payload)
        out_topic, reply_topic = self.topic(src, dst), self.topic(dst, src)
        self._speak_for(src)
        self._session.subscribe(self._topics.inbound(src), deadline)  # replies must have somewhere to land
        cid = self._out.new_cid()
        with self._lock:
            self._session.check_open()
            pending = self._pending.open(cid, reply_topic)
        try:
            self.stats.record(src, dst, data.nbytes)
            self._out.publish(out_topic, "req", cid, src, data)
            if not pending.event.wait(max(0.0, deadline - time.monotonic())):
                raise TransportError(f"no reply from {dst!r} to {src!r} within {wait:g} s")
        finally:
            self._pending.drop(cid)
        if pending.error is not None:
            raise TransportError(f"{dst!r} could not answer {src!r}: {pending.error}")
        assert pending.reply is not None
        return pending.reply

    def send(self, src: str, dst: str, payload: bytes) -> None:
        data = as_bytes_view(payload)
        topic = self.topic(src, dst)
        self._speak_for(src)
        self.stats.record(src, dst, data.nbytes)
        self._out.publish(topic, "send", self._out.new_cid(), src, data)

    def reply(self, src: str, token: OpenRequest, payload: bytes) -> None:
        """Publish the reply to the request ``src``'s handler answered with ``token``, on that request's
        reply topic under its correlation id: the requester's ``request`` has been waiting for it."""
        with self._lock:
            self._session.check_open()
        self._handlers.reply(src, token, payload)

    def observed_sender(self) -> str | None:
        """Inside a handler: the address the payload came from, read off its topic (else None)."""
        return self._handlers.observed_sender()

    @property
    def connected(self) -> bool:
        return self._session.connected

    def wait_ready(self, timeout: float) -> bool:
        """Wait until connected and every wanted subscription is acknowledged (e.g. after a reconnect)."""
        return self._session.wait_ready(timeout)

    def close(self) -> None:
        """Fail pending requests, stop the handlers, publish ``offline`` and disconnect cleanly."""
        with self._lock:
            state = self._session.begin_close()
            if state is None:
                return
            pendings = self._pending.waiting()
            workers = self._handlers.take_all()
        PendingReplies.fail(pendings, "transport closed")
        HandlerPool.stop(workers)
        self._session.shutdown(*state)
        HandlerPool.join(workers)
        self._inbound.noise.flush()  # the summaries of throttled lines about bad frames still owed
        self._handlers.noise.flush()

    # ------------------------------------------------------------- internals

    def _speak_for(self, src: str) -> None:
        """Record that this instance sends as ``src`` (its inbound payloads are then counted when sent)."""
        with self._lock:
            self._session.check_open()
            self._local.add(src)

    def _dispatch(self, src: str, dst: str, frame: Frame, payload: bytes, topic: str, reply_topic: str) -> None:
        """Inbound requests and one-way payloads to the handlers. A method here, not a direct hook, so
        benchmarks/hostile.py can sample ``_queued_bytes`` after each dispatch by wrapping it."""
        self._handlers.dispatch(src, dst, frame, payload, topic, reply_topic)

    @property
    def _queued_bytes(self) -> int:
        """Payload bytes (plus bookkeeping) queued for handlers; read by benchmarks/hostile.py."""
        return self._handlers.queued_bytes
