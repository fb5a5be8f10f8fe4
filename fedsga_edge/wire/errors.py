"""Wire errors, split by who broke the rules (after h11).

* ``RemoteProtocolError`` -- the peer sent something we cannot accept (garbage,
  truncated bytes, wrong version, missing field, a chunk that contradicts earlier
  ones). Log it, count it, drop it, carry on: a misbehaving device must not take
  the coordinator down.
* ``LocalProtocolError`` -- *we* asked for something the protocol cannot express
  (an object array, a non-str dict key, an unknown kind). That is a bug on our
  side: fail loudly.
"""

from __future__ import annotations

__all__ = ["LocalProtocolError", "RemoteProtocolError", "WireError"]


class WireError(Exception):
    """Base class of every error raised by :mod:`fedsga_edge.wire`."""


class LocalProtocolError(WireError):
    """Our own code tried to send something the protocol does not allow."""


class RemoteProtocolError(WireError):
    """Bytes received from a peer violate the protocol."""
