"""What the tests read out of the coordinator's one output channel (``Outgoing``: device, message)."""

from __future__ import annotations

from typing import Any

from fedsga_edge.wire import Message, Outgoing


def only_reply(out: Outgoing) -> Message:
    """The one message ``Coordinator.receive`` returned: the reply to the request (nothing else released)."""
    assert len(out) == 1, [(d, m.kind) for d, m in out]
    return out[0][1]


def bodies(out: Outgoing) -> dict[str, dict[str, Any]]:
    """``begin_round``'s round starts: device -> body."""
    assert all(m.kind == "round_start" for _, m in out)
    return {d: m.body for d, m in out}
