"""What a device agent knows about its own run, in one place its parts share.

Registration sets ``registered`` (and ``last_error`` when refused), the round loop moves the round
counters, the state file saves and restores them, ``health()`` reports them: one object, so no part
keeps a copy that could disagree with another's.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Progress"]


@dataclass
class Progress:
    """Registered, rounds finished, the newest round taken part in, and the last error (None after a good round)."""

    registered: bool = False
    rounds_done: int = 0
    last_round: int = 0
    last_error: str | None = None
