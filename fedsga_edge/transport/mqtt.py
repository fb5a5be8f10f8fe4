"""MQTT transport: the Transport ABC over an MQTT 3.1.1 broker (paho-mqtt 2), for field trials.

Topics, frames and the rules behind them are in ``docs/protocol.md``; in short:

* ``fedsga/<run>/up/<device>``   device -> coordinator (requests, one-way sends, replies)
* ``fedsga/<run>/down/<device>`` coordinator -> device (requests such as round_start, replies)
* ``fedsga/<run>/bcast``         coordinator -> every device, one-way
* ``fedsga/<run>/status/<client id>`` retained ``online`` / ``offline`` (the last will)

Every MQTT payload is one *frame*, a small msgpack map that carries the
request/reply correlation id and either the whole payload or one chunk of it
(``wire.chunking``) when it would not fit ``max_packet``. The handler always
gets the original payload bytes.

The sender of an inbound payload is the topic it arrived on, never what the
payload claims: ``observed_sender()`` returns it to the handler's thread, and
``Peer.serve`` rejects a message whose ``sender`` differs. With broker ACLs
that tie ``up/<id>`` to the login ``<id>``, the topic is the login.

Handlers run on one worker thread per registered address (never on paho's
network thread), so a handler may block, train, or itself call ``request``.
Requests to one address are handled one at a time, in arrival order.

paho-mqtt is optional (``pip install "fedsga-edge[device]"``): it is imported
when a transport is built, not when this module is.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import socket
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote, urlsplit

import msgpack

from ..wire import Reassembler, RemoteProtocolError, max_chunk_for, split_message
from ..wire.errors import LocalProtocolError
from .base import Handler, Transport, TransportError, TransportStats, check_address

__all__ = ["FRAME_VERSION", "MqttTransport", "TOPIC_ROOT"]

log = logging.getLogger(__name__)

TOPIC_ROOT = "fedsga"
FRAME_VERSION = 1
_OPS = frozenset({"req", "rep", "send", "err"})
_FRAME_KEYS_WHOLE = frozenset({"tf", "op", "cid", "p"})
_FRAME_KEYS_CHUNK = frozenset({"tf", "op", "cid", "chunk"})
_MAX_CID = 64
# Every chunk but a message's last must carry at least this much, so a message of `total` bytes
# has at most ceil(total / _MIN_PART) parts. The Reassembler reserves the declared total, which
# bounds the part bytes it holds; this bounds the per-part Python overhead (~150 bytes) too,
# so a peer cannot pin 100x its reservation with 1-byte chunks. Honest chunks are >= 2.9 KiB.
_MIN_PART = 1024
_MAX_REASON = 1000
_JOB_COST = 256  # a queued job's bookkeeping, counted with its payload against max_buffer_bytes
_SEEN_PER_TOPIC = 1024  # request cids remembered per topic (QoS 1 redeliveries), so floods stay their own
_SEEN_TOPICS = 4096
_MAX_PARTIAL_PER_SENDER = 64  # chunked messages one sender may have half-sent at once
_ONLINE, _OFFLINE = b"online", b"offline"
_BROADCAST = "*"  # the dst recorded in stats for a broadcast


def _as_bytes_view(payload: Any) -> memoryview:
    """A byte view of ``payload`` so lengths are bytes, not elements (memoryview of float32...)."""
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TransportError(f"payload must be bytes, got {type(payload).__name__}")
    view = memoryview(payload)
    if view.format == "B" and view.ndim == 1:
        return view
    return view.cast("B") if view.c_contiguous else memoryview(view.tobytes())


def _pack_frame(op: str, cid: str, *, p: Any = None, chunk: Any = None) -> bytes:
    d: dict[str, Any] = {"tf": FRAME_VERSION, "op": op, "cid": cid}
    if chunk is not None:
        d["chunk"] = chunk
    else:
        d["p"] = p
    return msgpack.packb(d, use_bin_type=True)


@dataclass(slots=True)
class _Frame:
    op: str
    cid: str
    p: bytes | None
    chunk: bytes | None


def _parse_frame(data: bytes) -> _Frame:
    """Validate one MQTT payload as a frame; anything else is RemoteProtocolError."""
    try:  # a frame is one flat map: no arrays or big maps, so a hostile one cannot expand in memory
        d = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0, max_array_len=0, max_map_len=8)
    except Exception as e:  # msgpack's ValueError zoo
        raise RemoteProtocolError(f"not a frame ({len(data)} bytes of non-msgpack)") from e
    if not isinstance(d, dict) or d.get("tf") != FRAME_VERSION or isinstance(d.get("tf"), bool):
        raise RemoteProtocolError(f"not a version-{FRAME_VERSION} frame")
    if d.keys() not in (_FRAME_KEYS_WHOLE, _FRAME_KEYS_CHUNK):
        raise RemoteProtocolError(f"frame keys {sorted(map(repr, d.keys()))} are not a whole or a chunk frame")
    op, cid = d["op"], d["cid"]
    if op not in _OPS:
        raise RemoteProtocolError(f"unknown frame op {op!r:.40}")
    if not isinstance(cid, str) or not 0 < len(cid) <= _MAX_CID:
        raise RemoteProtocolError(f"frame cid must be a str of 1-{_MAX_CID} chars")
    body = d.get("p", d.get("chunk"))
    if not isinstance(body, bytes):
        raise RemoteProtocolError(f"frame body must be bin, got {type(body).__name__}")
    return _Frame(op, cid, d.get("p"), d.get("chunk"))


def _check_chunk_head(chunk: bytes, want_id: str) -> None:
    """What the Reassembler does not check: whose chunk this is, and that its parts are not tiny."""
    try:
        head = msgpack.unpackb(chunk, raw=False, strict_map_key=True, max_ext_len=0, max_array_len=0, max_map_len=16)
    except Exception as e:
        raise RemoteProtocolError("chunk is not msgpack") from e
    if not isinstance(head, dict) or head.get("id") != want_id:
        raise RemoteProtocolError(f"chunk id must be {want_id!r}")
    i, n, total, part = head.get("i"), head.get("n"), head.get("total"), head.get("part")
    if not all(isinstance(v, int) for v in (i, n, total)) or not isinstance(part, bytes):
        return  # malformed: the Reassembler says why
    if n > max(1, -(-total // _MIN_PART)) or (i < n - 1 and len(part) < _MIN_PART):
        raise RemoteProtocolError(f"chunks must carry >= {_MIN_PART} bytes each but the last (n={n}, total={total})")


@dataclass(slots=True)
class _Pending:
    """One request waiting for its reply; only a frame on ``reply_topic`` may answer it."""

    reply_topic: str
    event: threading.Event = field(default_factory=threading.Event)
    reply: bytes | None = None
    error: str | None = None


@dataclass(slots=True)
class _Job:
    src: str  # observed sender (from the topic)
    op: str  # "req" or "send"
    cid: str
    payload: bytes
    reply_topic: str


@dataclass(slots=True, eq=False)
class _Worker:
    """One address's handler, the queue that feeds it and the thread that runs it."""

    address: str
    handler: Handler
    queue: queue.Queue[_Job | None] = field(default_factory=queue.Queue)
    thread: threading.Thread | None = None


class MqttTransport(Transport):
    """Coordinator <-> device traffic over one MQTT connection; see the module doc.

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
        try:
            import paho.mqtt.client as mqtt
            from paho.mqtt.enums import CallbackAPIVersion
        except ImportError as e:  # pragma: no cover - paho is installed wherever the tests run
            raise TransportError('MQTT needs paho-mqtt >= 2: pip install "fedsga-edge[device]"') from e
        for name, value in (("run", run), ("coordinator", coordinator)):
            try:
                check_address(value)
            except TransportError as e:
                raise TransportError(f"{name}: {e}") from None
        client_id = client_id or f"{run}-{os.urandom(6).hex()}"
        check_address(client_id)
        if max_packet < 4096:
            raise TransportError(f"max_packet={max_packet} is too small (at least 4096)")
        if request_timeout <= 0 or connect_timeout <= 0 or reassembly_timeout <= 0:
            raise TransportError("timeouts must be positive")

        self.stats = TransportStats()
        self.run = run
        self.client_id = client_id
        self.coordinator = coordinator
        self.max_packet = max_packet
        self.max_buffer_bytes = max_buffer_bytes
        self.request_timeout = request_timeout
        self.connect_timeout = connect_timeout
        self.status_topic = f"{TOPIC_ROOT}/{run}/status/{client_id}"
        # Health counters: garbage (undecodable frames), spoofed (replies on the wrong topic),
        # duplicates (QoS 1 redeliveries), rejected (too big / over the buffer cap), no_handler,
        # handler_errors (a handler raised), late_replies (reply after its request gave up).
        self.counters: Counter[str] = Counter()
        self._count_lock = threading.Lock()

        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._closed = False
        self._connected = False
        self._connect_error: str | None = None
        self._ever_connected = threading.Event()
        self._subs: set[str] = set()  # topics we want
        self._acked: set[str] = set()  # ... and the broker confirmed on this connection
        self._sub_mids: dict[int, list[str]] = {}
        self._sub_failed: dict[str, str] = {}
        self._workers: dict[str, _Worker] = {}
        self._local: set[str] = set()  # addresses this instance speaks for
        self._pending: dict[str, _Pending] = {}
        # topic -> cids of requests queued or handled, per topic so one publisher's flood evicts only its own
        self._seen: OrderedDict[str, OrderedDict[str, None]] = OrderedDict()
        self._queued_bytes = 0
        self._cids = itertools.count(1)
        self._cid_prefix = os.urandom(4).hex()
        self._thread_state = threading.local()
        # Only paho's network thread touches the reassembler. It counts the part bytes it holds, per
        # sender too (a flooder is evicted before a sender within its fair share is refused).
        self.reassembler = Reassembler(max_buffer_bytes, reassembly_timeout,
                                       max_owner_pending=_MAX_PARTIAL_PER_SENDER)

        self._client = mqtt.Client(
            callback_api_version=CallbackAPIVersion.VERSION2,
            client_id=client_id,
            clean_session=clean_session,
            protocol=mqtt.MQTTv311,
            reconnect_on_failure=True,
        )
        self._mqtt_ok = mqtt.MQTT_ERR_SUCCESS
        self._mqtt_no_conn = mqtt.MQTT_ERR_NO_CONN
        if username is not None:
            self._client.username_pw_set(username, password)
        if tls or ca or certfile:
            self._client.tls_set(ca_certs=ca, certfile=certfile, keyfile=keyfile)
        self._client.will_set(self.status_topic, _OFFLINE, qos=1, retain=True)
        self._client.reconnect_delay_set(reconnect_min, reconnect_max)  # type: ignore[arg-type]  # floats work
        self._client.on_connect = self._on_connect
        self._client.on_connect_fail = self._on_connect_fail
        self._client.on_disconnect = self._on_disconnect
        self._client.on_subscribe = self._on_subscribe
        self._client.on_message = self._on_message
        self._client.connect_async(host, port, keepalive=keepalive)
        self._client.loop_start()
        if not self._ever_connected.wait(connect_timeout) or self._connect_error and not self._connected:
            why = self._connect_error or "no answer"
            self._client.loop_stop()
            raise TransportError(f"could not connect to mqtt broker {host}:{port} within {connect_timeout:g} s: {why}")

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

    # ------------------------------------------------------------- topics

    def _base(self) -> str:
        return f"{TOPIC_ROOT}/{self.run}"

    def topic(self, src: str, dst: str) -> str:
        """The topic a payload from ``src`` to ``dst`` travels on."""
        check_address(src)
        check_address(dst)
        if dst == self.coordinator and src != self.coordinator:
            return f"{self._base()}/up/{src}"
        if src == self.coordinator and dst != self.coordinator:
            return f"{self._base()}/down/{dst}"
        raise TransportError(f"MQTT carries coordinator <-> device traffic only, not {src!r} -> {dst!r}")

    def _inbound(self, address: str) -> list[str]:
        """Topics on which payloads for ``address`` arrive."""
        if address == self.coordinator:
            return [f"{self._base()}/up/+"]
        return [f"{self._base()}/down/{address}", f"{self._base()}/bcast"]

    def _classify(self, topic: str) -> tuple[str, str] | None:
        """(observed sender, destination) of an inbound topic; None if it is not ours."""
        parts = topic.split("/")
        if len(parts) < 3 or parts[0] != TOPIC_ROOT or parts[1] != self.run:
            return None
        if len(parts) == 3 and parts[2] == "bcast":
            return self.coordinator, _BROADCAST
        if len(parts) == 4 and parts[3] != self.coordinator:
            try:
                check_address(parts[3])
            except TransportError:
                return None
            if parts[2] == "up":
                return parts[3], self.coordinator
            if parts[2] == "down":
                return self.coordinator, parts[3]
        return None

    # ------------------------------------------------------------- the Transport API

    def register(self, address: str, handler: Handler) -> None:
        check_address(address)
        if not callable(handler):
            raise TransportError(f"handler for {address!r} is not callable")
        w = _Worker(address, handler)
        w.thread = threading.Thread(target=self._work, args=(w,), name=f"mqtt-handler-{address}", daemon=True)
        with self._lock:
            self._check_open()
            if address in self._workers:
                raise TransportError(f"address {address!r} is already registered; unregister it first")
            self._workers[address] = w
            self._local.add(address)
        w.thread.start()
        try:
            self._subscribe(self._inbound(address), time.monotonic() + self.connect_timeout)
        except TransportError as e:  # the broker is away: on_connect subscribes once it is back
            log.warning("%s: registered %r but not yet subscribed: %s", self.client_id, address, e)

    def unregister(self, address: str) -> None:
        with self._lock:
            w = self._workers.pop(address, None)
            if w is None:
                raise TransportError(f"address {address!r} is not registered")
            still = {t for a in self._workers for t in self._inbound(a)}
            drop = [t for t in self._inbound(address) if t not in still]
            self._subs.difference_update(drop)
            self._acked.difference_update(drop)
        w.queue.put(None)
        if drop:
            self._client.unsubscribe(drop)

    def request(self, src: str, dst: str, payload: bytes, *, timeout: float | None = None) -> bytes:
        """Publish ``payload`` and block until the reply; ``timeout=None`` means ``request_timeout``."""
        if timeout is not None and timeout <= 0:
            raise TransportError(f"timeout must be positive, got {timeout}")
        wait = self.request_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        data = _as_bytes_view(payload)
        out_topic, reply_topic = self.topic(src, dst), self.topic(dst, src)
        with self._lock:
            self._check_open()
            self._local.add(src)
        self._subscribe(self._inbound(src), deadline)  # replies must have somewhere to land
        cid = self._new_cid()
        pending = _Pending(reply_topic)
        with self._lock:
            self._check_open()
            self._pending[cid] = pending
        try:
            self.stats.record(src, dst, data.nbytes)
            self._publish(out_topic, "req", cid, src, data)
            if not pending.event.wait(max(0.0, deadline - time.monotonic())):
                raise TransportError(f"no reply from {dst!r} to {src!r} within {wait:g} s")
        finally:
            with self._lock:
                self._pending.pop(cid, None)
        if pending.error is not None:
            raise TransportError(f"{dst!r} could not answer {src!r}: {pending.error}")
        assert pending.reply is not None
        return pending.reply

    def send(self, src: str, dst: str, payload: bytes) -> None:
        data = _as_bytes_view(payload)
        topic = self.topic(src, dst)
        with self._lock:
            self._check_open()
            self._local.add(src)
        self.stats.record(src, dst, data.nbytes)
        self._publish(topic, "send", self._new_cid(), src, data)

    def broadcast(self, src: str, payload: bytes) -> None:
        """One-way payload from the coordinator to every device of the run (``bcast`` topic)."""
        if src != self.coordinator:
            raise TransportError(f"only the coordinator ({self.coordinator!r}) broadcasts, not {src!r}")
        data = _as_bytes_view(payload)
        with self._lock:
            self._check_open()
            self._local.add(src)
        self.stats.record(src, _BROADCAST, data.nbytes)
        self._publish(f"{self._base()}/bcast", "send", self._new_cid(), src, data)

    def observed_sender(self) -> str | None:
        """Inside a handler: the address the payload came from, read off its topic (else None)."""
        return getattr(self._thread_state, "sender", None)

    @property
    def connected(self) -> bool:
        return self._connected

    def wait_ready(self, timeout: float) -> bool:
        """Wait until connected and every wanted subscription is acknowledged (e.g. after a reconnect)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not (self._connected and self._subs <= self._acked):
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        """Fail pending requests, stop the handlers, publish ``offline`` and disconnect cleanly."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pendings = list(self._pending.values())
            workers = list(self._workers.values())
            self._workers.clear()
            subs = sorted(self._subs)
            connected = self._connected
            self._cond.notify_all()
        for p in pendings:
            p.error = "transport closed"
            p.event.set()
        for w in workers:
            w.queue.put(None)
        if connected:
            try:
                if subs:  # a persistent session would otherwise keep queueing for us
                    self._client.unsubscribe(subs)
                info = self._client.publish(self.status_topic, _OFFLINE, qos=1, retain=True)
                info.wait_for_publish(timeout=2.0)
            except (RuntimeError, ValueError) as e:  # lost the connection while closing
                log.debug("%s: offline not confirmed: %s", self.client_id, e)
        self._client.disconnect()
        self._client.loop_stop()
        me = threading.current_thread()
        for w in workers:
            if w.thread is not me:
                w.thread.join(timeout=2.0)

    # ------------------------------------------------------------- outgoing

    def _new_cid(self) -> str:
        return f"{self._cid_prefix}-{next(self._cids):x}"

    def _payload_limit(self) -> int:
        return max_chunk_for(self.max_packet)  # room for fixed header, topic and packet id

    def _publish(self, topic: str, op: str, cid: str, src: str, data: memoryview) -> None:
        """Publish one whole frame, or chunk frames when it would not fit ``max_packet``."""
        limit = self._payload_limit()
        overhead = len(_pack_frame(op, cid, p=b"")) + 3  # bin8 -> bin32 length prefix
        if data.nbytes + overhead <= limit:
            frames = [_pack_frame(op, cid, p=data)]
        else:
            try:
                chunks = split_message(data, max_chunk=limit - overhead, msg_id=f"{src}#{cid}")
            except LocalProtocolError as e:
                raise TransportError(f"cannot chunk for max_packet={self.max_packet}: {e}") from e
            frames = [_pack_frame(op, cid, chunk=c) for c in chunks]
        for f in frames:
            info = self._client.publish(topic, f, qos=1)
            # NO_CONN: paho keeps QoS 1 messages and sends them after reconnecting.
            if info.rc not in (self._mqtt_ok, self._mqtt_no_conn):
                raise TransportError(f"publish to {topic} failed: rc={info.rc}")

    def _publish_error(self, topic: str, cid: str, reason: str) -> None:
        try:
            self._client.publish(topic, _pack_frame("err", cid, p=reason[:_MAX_REASON].encode()), qos=1)
        except Exception:  # never let an error reply take a thread down
            log.exception("%s: could not publish an error reply", self.client_id)

    def _subscribe(self, topics: list[str], deadline: float) -> None:
        """Make sure ``topics`` are subscribed on this connection; wait for the SUBACK."""
        with self._lock:
            new = [t for t in topics if t not in self._subs]
            self._subs.update(new)
            if new and self._connected:
                # Under our lock, so the SUBACK (handled under it too) cannot beat the mid's record.
                # Safe: paho calls no callback from a caller's thread while its loop thread runs.
                rc, mid = self._client.subscribe([(t, 1) for t in new])
                if rc == self._mqtt_ok and mid is not None:
                    self._sub_mids[mid] = new
        with self._cond:
            while not set(topics) <= self._acked:
                failed = [f"{t}: {self._sub_failed[t]}" for t in topics if t in self._sub_failed]
                if failed:
                    raise TransportError(f"broker refused subscription {'; '.join(failed)}")
                left = deadline - time.monotonic()
                if self._closed:
                    raise TransportError("transport is closed")
                if left <= 0:
                    state = "connected" if self._connected else "not connected"
                    raise TransportError(f"no SUBACK for {topics} in time ({state})")
                self._cond.wait(left)

    # ------------------------------------------------------------- paho callbacks (network thread)

    def _on_connect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        try:
            if reason.is_failure:
                self._connect_error = f"broker refused the connection: {reason}"
                log.error("%s: %s", self.client_id, self._connect_error)
                self._ever_connected.set()  # wake the constructor: retrying will not fix credentials
                return
            self._no_delay(client)
            with self._cond:
                self._connected = True
                self._connect_error = None
                self._acked.clear()
                self._sub_failed.clear()
                self._sub_mids.clear()
                topics = sorted(self._subs)
                if topics:
                    rc, mid = client.subscribe([(t, 1) for t in topics])
                    if rc == self._mqtt_ok and mid is not None:
                        self._sub_mids[mid] = topics
                self._cond.notify_all()
            client.publish(self.status_topic, _ONLINE, qos=1, retain=True)
            self._ever_connected.set()
            log.info("%s: connected (session present: %s)", self.client_id, flags.session_present)
        except Exception:
            log.exception("%s: on_connect failed", self.client_id)

    @staticmethod
    def _no_delay(client: Any) -> None:
        """TCP_NODELAY: paho leaves Nagle on, and a small PUBACK followed by a reply then waits for
        the peer's delayed ACK (~40 ms per hop; a 100-byte round trip took 88 ms instead of ~1)."""
        sock = client.socket()
        try:
            if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:  # pragma: no cover - e.g. a proxy socket
            log.debug("TCP_NODELAY not set: %s", e)

    def _on_connect_fail(self, client: Any, userdata: Any) -> None:
        self._connect_error = "connection failed (broker down or unreachable, or TLS handshake failed?)"

    def _on_disconnect(self, client: Any, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        with self._cond:
            self._connected = False
            self._acked.clear()
            self._cond.notify_all()
        if not self._closed:
            log.warning("%s: disconnected (%s); reconnecting", self.client_id, reason)

    def _on_subscribe(self, client: Any, userdata: Any, mid: int, reasons: Any, properties: Any) -> None:
        with self._cond:
            topics = self._sub_mids.pop(mid, [])
            for t, rc in zip(topics, reasons):
                if rc.is_failure:
                    self._sub_failed[t] = str(rc)
                elif t in self._subs:
                    self._acked.add(t)
            self._cond.notify_all()

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        try:
            self._receive(message.topic, message.payload, bool(message.retain))
        except Exception:  # a bug here must not kill paho's network thread
            log.exception("%s: failed to handle a message on %s", self.client_id, message.topic)

    def _count(self, key: str) -> None:
        with self._count_lock:
            self.counters[key] += 1

    def _receive(self, topic: str, data: bytes, retained: bool) -> None:
        route = self._classify(topic)
        if route is None or retained:  # not ours, or a stale retained copy: never replay requests
            self._count("garbage")
            return
        src, dst = route
        try:
            frame = _parse_frame(data)
        except RemoteProtocolError as e:
            self._count("garbage")
            log.warning("%s: dropped garbage on %s: %s", self.client_id, topic, e)
            return
        reply_topic = topic if dst == _BROADCAST else self.topic(dst, src)
        payload = frame.p
        if frame.chunk is not None:
            payload = self._reassemble(src, frame, topic, reply_topic)
            if payload is None:
                return
        assert payload is not None
        if frame.op in ("rep", "err"):
            self._answer(topic, frame, payload)
        else:
            self._dispatch(src, dst, frame, payload, topic, reply_topic)

    def _reassemble(self, src: str, frame: _Frame, topic: str, reply_topic: str) -> bytes | None:
        """Feed one chunk; the whole payload once complete. Chunk ids must be ``<sender>#<cid>``
        with the sender read off the topic, so one peer cannot collide with another's chunks."""
        assert frame.chunk is not None
        self.reassembler.expire()
        try:
            _check_chunk_head(frame.chunk, f"{src}#{frame.cid}")
            return self.reassembler.feed(frame.chunk, owner=src)
        except RemoteProtocolError as e:
            # Raised once per bad message (later chunks of a rejected one are dropped quietly),
            # except for chunks that contradict their siblings: then the requester hears it more
            # than once, and every answer after the first is a late reply.
            self._count("rejected")
            log.warning("%s: dropped a chunk of %s on %s: %s", self.client_id, frame.cid, topic, e)
            if frame.op == "req":
                self._publish_error(reply_topic, frame.cid, f"rejected: {e}")
            return None

    def _answer(self, topic: str, frame: _Frame, payload: bytes) -> None:
        with self._lock:
            pending = self._pending.get(frame.cid)
            if pending is None:
                self._count("late_replies")
                return
            if pending.reply_topic != topic:  # someone else answering our request
                self._count("spoofed")
                return
            del self._pending[frame.cid]
        src, dst = self._classify(topic) or ("?", "?")
        if frame.op == "err":
            pending.error = payload.decode("utf-8", "replace")
        else:
            pending.reply = payload
            if src not in self._local:  # our own replies were counted when published
                self.stats.record(src, dst, len(payload))
        pending.event.set()

    def _dispatch(self, src: str, dst: str, frame: _Frame, payload: bytes, topic: str, reply_topic: str) -> None:
        refuse = None
        cost = len(payload) + _JOB_COST
        with self._lock:
            seen = self._seen.get(topic)
            if seen is None:
                seen = self._seen[topic] = OrderedDict()
                while len(self._seen) > _SEEN_TOPICS:
                    self._seen.popitem(last=False)
            self._seen.move_to_end(topic)
            if frame.cid in seen:  # QoS 1 redelivery of a request already queued or handled
                self._count("duplicates")
                return
            seen[frame.cid] = None
            while len(seen) > _SEEN_PER_TOPIC:
                seen.popitem(last=False)
            if dst == _BROADCAST:
                workers = [w for a, w in self._workers.items() if a != self.coordinator]
            else:
                workers = [self._workers[dst]] if dst in self._workers else []
            if not workers:
                self._count("no_handler")
                refuse = f"no handler registered at {dst!r}"
            elif self._queued_bytes + cost * len(workers) > self.max_buffer_bytes:
                self._count("rejected")
                refuse = f"{dst!r} is busy: its handler queue holds over {self.max_buffer_bytes} bytes"
            else:
                self._queued_bytes += cost * len(workers)
                if src not in self._local:
                    self.stats.record(src, dst, len(payload))
        if refuse is not None:
            if frame.op == "req":
                self._publish_error(reply_topic, frame.cid, refuse)
            return
        for w in workers:
            w.queue.put(_Job(src, frame.op, frame.cid, payload, reply_topic))

    # ------------------------------------------------------------- handler workers

    def _work(self, w: _Worker) -> None:
        while True:
            job = w.queue.get()
            if job is None:
                return
            with self._lock:
                self._queued_bytes -= len(job.payload) + _JOB_COST
                current = self._workers.get(w.address) is w
            if not current:  # unregistered while this waited
                if job.op == "req":
                    self._publish_error(job.reply_topic, job.cid, f"{w.address!r} left")
                continue
            self._handle(w, job)

    def _handle(self, w: _Worker, job: _Job) -> None:
        self._thread_state.sender = job.src
        try:
            out = w.handler(job.payload)
        except Exception as e:
            self._count("handler_errors")
            log.exception("%s: handler of %r raised", self.client_id, w.address)
            if job.op == "req":
                reason = f"handler of {w.address!r} raised {type(e).__name__}: {e}"
                self._publish_error(job.reply_topic, job.cid, reason)
            return
        finally:
            self._thread_state.sender = None
        if job.op != "req":
            return  # one-way: a reply goes nowhere and is not counted
        if out is None:
            self._publish_error(job.reply_topic, job.cid, f"{w.address!r} sent no reply")
            return
        if not isinstance(out, (bytes, bytearray, memoryview)):
            self._publish_error(job.reply_topic, job.cid, f"handler of {w.address!r} returned {type(out).__name__}")
            return
        data = _as_bytes_view(out)
        self.stats.record(w.address, job.src, data.nbytes)
        try:
            self._publish(job.reply_topic, "rep", job.cid, w.address, data)
        except TransportError as e:
            log.error("%s: could not publish the reply of %r: %s", self.client_id, w.address, e)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")
