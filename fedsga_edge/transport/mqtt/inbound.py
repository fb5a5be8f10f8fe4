"""The inbound path, on paho's network thread: route by topic, parse the frame, reassemble chunks,
then hand replies to the pending requests and requests to the handlers.

Nothing here may raise into paho: a bad frame is counted and dropped (a bad request refused),
and a bug is logged, so one hostile or broken publisher cannot stop the network thread. Lines about
bad frames go through a ``ThrottledLog`` (fedsga_edge/logthrottle.py), keyed by problem and topic,
so a flood of them is counted and summarised instead of written out one by one.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ...logthrottle import ThrottledLog
from ...wire import Reassembler, RemoteProtocolError
from .frames import Frame, check_chunk_head, parse_frame
from .health import Health
from .outbound import Publisher
from .topics import BROADCAST, Topics

__all__ = ["Answer", "Dispatch", "Inbound"]

log = logging.getLogger(__name__)

MAX_PARTIAL_PER_SENDER = 64  # chunked messages one sender may have half-sent at once

Answer = Callable[[str, Frame, bytes], None]  # (topic, frame, payload) of a rep/err
Dispatch = Callable[[str, str, Frame, bytes, str, str], None]  # (src, dst, frame, payload, topic, reply_topic)


class Inbound:
    """Turns MQTT messages into whole payloads with their observed sender and where to answer.

    Only paho's network thread touches ``reassembler``. It counts the part bytes it holds, per sender
    too (a flooder is evicted before a sender within its fair share is refused).
    """

    def __init__(self, topics: Topics, publisher: Publisher, health: Health, client_id: str, *,
                 max_buffer_bytes: int, reassembly_timeout: float, answer: Answer, dispatch: Dispatch) -> None:
        self._topics = topics
        self._out = publisher
        self._health = health
        self._client_id = client_id
        self._answer = answer
        self._dispatch = dispatch
        self.reassembler = Reassembler(max_buffer_bytes, reassembly_timeout,
                                       max_owner_pending=MAX_PARTIAL_PER_SENDER)
        self.noise = ThrottledLog(log)  # lines about hostile frames: counted, the first few written

    def on_message(self, client: Any, userdata: Any, message: Any) -> None:
        """paho's ``on_message``."""
        try:
            self.receive(message.topic, message.payload, bool(message.retain))
        except Exception:  # a bug here must not kill paho's network thread
            log.exception("%s: failed to handle a message on %s", self._client_id, message.topic)

    def receive(self, topic: str, data: bytes, retained: bool) -> None:
        route = self._topics.classify(topic)
        if route is None or retained:  # not ours, or a stale retained copy: never replay requests
            self._health.count("garbage")
            return
        src, dst = route
        try:
            frame = parse_frame(data)
        except RemoteProtocolError as e:
            self._health.count("garbage")
            self.noise.warning(("garbage frames on", topic), "%s: dropped garbage on %s: %s", self._client_id, topic, e)
            return
        reply_topic = topic if dst == BROADCAST else self._topics.route(dst, src)
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

    def _reassemble(self, src: str, frame: Frame, topic: str, reply_topic: str) -> bytes | None:
        """Feed one chunk; the whole payload once complete. Chunk ids must be ``<sender>#<cid>``
        with the sender read off the topic, so one peer cannot collide with another's chunks."""
        assert frame.chunk is not None
        self.reassembler.expire()
        try:
            check_chunk_head(frame.chunk, f"{src}#{frame.cid}")
            return self.reassembler.feed(frame.chunk, owner=src)
        except RemoteProtocolError as e:
            # Raised once per bad message (later chunks of a rejected one are dropped quietly),
            # except for chunks that contradict their siblings: then the requester hears it more
            # than once, and every answer after the first is a late reply.
            self._health.count("rejected")
            self.noise.warning(("rejected chunks on", topic), "%s: dropped a chunk of %s on %s: %s",
                               self._client_id, frame.cid, topic, e)
            if frame.op == "req":
                self._out.publish_error(reply_topic, frame.cid, f"rejected: {e}")
            return None
