"""MQTT transport: the Transport ABC over an MQTT 3.1.1 broker (paho-mqtt 2), for field trials.

Topics, frames and the rules behind them are in ``docs/protocol.md``; in short:

* ``fedsga/<run>/up/<device>``   device -> coordinator (requests, one-way sends, replies)
* ``fedsga/<run>/down/<device>`` coordinator -> device (requests such as round_start, replies)
* ``fedsga/<run>/bcast``         coordinator -> every device, one-way (devices listen; this
  transport publishes nothing there)
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
when a transport is built, not when this package is.

Layout: ``transport`` (MqttTransport, the Transport API wired from the parts below),
``connection`` (paho import, login and TLS), ``session`` (connection and subscription state),
``presence`` (the retained status topic and last will), ``topics`` (the topic layout, the
observed sender), ``frames`` (frame format and checks), ``outbound`` (publishing, chunking),
``inbound`` (routing, parsing, reassembly), ``pending`` (requests awaiting replies),
``handlers`` (handler threads and their queues), ``health`` (what was dropped, and why).
"""

from __future__ import annotations

from .frames import FRAME_VERSION, pack_frame, parse_frame
from .topics import TOPIC_ROOT
from .transport import MqttTransport

# The frame codec under its old names, for the tests and fuzzers that build or parse raw frames.
_pack_frame = pack_frame
_parse_frame = parse_frame

__all__ = ["FRAME_VERSION", "TOPIC_ROOT", "MqttTransport"]
