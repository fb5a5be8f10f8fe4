"""Transports move bytes between addresses; Peer lets roles speak Messages over any of them.

Only the loopback transport is imported here. Network transports (MQTT) live in
their own modules and are imported by name when the CLI picks them, so devices
without a broker client installed can still use this package.
"""

from .base import Handler, OpenRequest, PendingReply, Transport, TransportError, TransportStats, check_address
from .loopback import LoopbackTransport
from .peer import MessageHandler, Peer, PendingMessage

__all__ = [
    "Handler",
    "LoopbackTransport",
    "MessageHandler",
    "OpenRequest",
    "Peer",
    "PendingMessage",
    "PendingReply",
    "Transport",
    "TransportError",
    "TransportStats",
    "check_address",
]
