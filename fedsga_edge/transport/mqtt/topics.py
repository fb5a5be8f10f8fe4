"""The run's topic layout (``docs/protocol.md``): which topic a payload travels on, and who sent what arrives.

The sender of an inbound payload is read off its topic, never off the payload, so this is where the
transport learns who is talking.
"""

from __future__ import annotations

from ..base import TransportError, check_address

__all__ = ["BROADCAST", "TOPIC_ROOT", "Topics"]

TOPIC_ROOT = "fedsga"
BROADCAST = "*"  # the destination of a payload that arrived on ``bcast``


class Topics:
    """``fedsga/<run>/{up/<device>, down/<device>, bcast, status/<client id>}`` for one run and coordinator."""

    def __init__(self, run: str, coordinator: str) -> None:
        self.run = run
        self.coordinator = coordinator
        self.base = f"{TOPIC_ROOT}/{run}"

    def route(self, src: str, dst: str) -> str:
        """The topic a payload from ``src`` to ``dst`` travels on."""
        check_address(src)
        check_address(dst)
        if dst == self.coordinator and src != self.coordinator:
            return f"{self.base}/up/{src}"
        if src == self.coordinator and dst != self.coordinator:
            return f"{self.base}/down/{dst}"
        raise TransportError(f"MQTT carries coordinator <-> device traffic only, not {src!r} -> {dst!r}")

    def inbound(self, address: str) -> list[str]:
        """Topics on which payloads for ``address`` arrive."""
        if address == self.coordinator:
            return [f"{self.base}/up/+"]
        return [f"{self.base}/down/{address}", f"{self.base}/bcast"]

    def status(self, client_id: str) -> str:
        """The retained ``online``/``offline`` topic of one MQTT client."""
        return f"{self.base}/status/{client_id}"

    def classify(self, topic: str) -> tuple[str, str] | None:
        """(observed sender, destination) of an inbound topic; None if it is not ours."""
        parts = topic.split("/")
        if len(parts) < 3 or parts[0] != TOPIC_ROOT or parts[1] != self.run:
            return None
        if len(parts) == 3 and parts[2] == "bcast":
            return self.coordinator, BROADCAST
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
