"""The retained ``status/<client id>`` topic: ``online`` once connected, ``offline`` on a clean close.

The broker publishes ``offline`` for us (the last will) when we vanish without closing, so whoever
reads the topic sees a lost device as well as one that left.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OFFLINE", "ONLINE", "Presence"]

ONLINE, OFFLINE = b"online", b"offline"


class Presence:
    """One client's status topic; every publish is QoS 1 and retained."""

    def __init__(self, topic: str) -> None:
        self.topic = topic

    def arm(self, client: Any) -> None:
        """The last will: set before connecting, published by the broker if we drop off."""
        client.will_set(self.topic, OFFLINE, qos=1, retain=True)

    def online(self, client: Any) -> None:
        client.publish(self.topic, ONLINE, qos=1, retain=True)

    def offline(self, client: Any, timeout: float = 2.0) -> None:
        """Publish ``offline`` and wait for the broker's PUBACK (paho raises if the link drops meanwhile)."""
        info = client.publish(self.topic, OFFLINE, qos=1, retain=True)
        info.wait_for_publish(timeout=timeout)
