"""The outbound path: correlation ids, and a payload framed whole or chunked to fit ``max_packet``."""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

from ...wire import max_chunk_for, split_message
from ...wire.errors import LocalProtocolError
from ..base import TransportError
from .connection import ReturnCodes
from .frames import pack_frame

__all__ = ["MAX_REASON", "Publisher"]

log = logging.getLogger(__name__)

MAX_REASON = 1000  # characters of an error reply's reason that travel


class Publisher:
    """Publishes frames at QoS 1 on one client; thread-safe (paho's publish is)."""

    def __init__(self, client: Any, codes: ReturnCodes, max_packet: int, client_id: str) -> None:
        self.client = client
        self.codes = codes
        self.max_packet = max_packet
        self.client_id = client_id
        self._cids = itertools.count(1)
        self._cid_prefix = os.urandom(4).hex()

    def new_cid(self) -> str:
        """A correlation id unique to this transport (the random prefix tells restarts apart)."""
        return f"{self._cid_prefix}-{next(self._cids):x}"

    def payload_limit(self) -> int:
        return max_chunk_for(self.max_packet)  # room for fixed header, topic and packet id

    def publish(self, topic: str, op: str, cid: str, src: str, data: memoryview) -> None:
        """Publish one whole frame, or chunk frames when it would not fit ``max_packet``.

        Chunk ids are ``<src>#<cid>``: the receiver checks ``src`` against the topic's sender.
        """
        limit = self.payload_limit()
        overhead = len(pack_frame(op, cid, p=b"")) + 3  # bin8 -> bin32 length prefix
        if data.nbytes + overhead <= limit:
            frames = [pack_frame(op, cid, p=data)]
        else:
            try:
                chunks = split_message(data, max_chunk=limit - overhead, msg_id=f"{src}#{cid}")
            except LocalProtocolError as e:
                raise TransportError(f"cannot chunk for max_packet={self.max_packet}: {e}") from e
            frames = [pack_frame(op, cid, chunk=c) for c in chunks]
        for f in frames:
            info = self.client.publish(topic, f, qos=1)
            # NO_CONN: paho keeps QoS 1 messages and sends them after reconnecting.
            if info.rc not in (self.codes.ok, self.codes.no_conn):
                raise TransportError(f"publish to {topic} failed: rc={info.rc}")

    def publish_error(self, topic: str, cid: str, reason: str) -> None:
        """An ``err`` reply to request ``cid``; never raises, so it cannot take a thread down."""
        try:
            self.client.publish(topic, pack_frame("err", cid, p=reason[:MAX_REASON].encode()), qos=1)
        except Exception:  # never let an error reply take a thread down
            log.exception("%s: could not publish an error reply", self.client_id)
