"""Protocol messages: the envelope, the kinds, and what each kind's body must hold.

Everything the lead may want to change about message *contents* lives in
``REQUIRED_FIELDS`` below: one table, one place (h11 keeps its state machine the
same way). Checking a body is a lookup; a miss becomes a typed error that names
the kind and the field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .errors import WireError

__all__ = [
    "FIELD_TYPES",
    "KINDS",
    "PROTOCOL_VERSION",
    "REQUIRED_FIELDS",
    "Message",
    "Outgoing",
    "check_body",
]

PROTOCOL_VERSION = 1

KINDS: tuple[str, ...] = (
    "hello",
    "round_start",
    "fetch",
    "weights",
    "activation",
    "gradient",
    "probe",
    "probe_result",
    "evaluate",
    "eval_result",
    "describe",
    "description",
    "update",
    "ack",
    "error",
    "bye",
)

# kind -> {field: type tag}. Kinds not listed require nothing. Extra fields are
# always allowed, so adding an optional field never needs a protocol bump.
REQUIRED_FIELDS: dict[str, dict[str, str]] = {
    "activation": {"z": "array", "y": "array", "split": "int"},
    "gradient": {"dz": "array", "loss": "float"},
    "update": {"weights": "dict", "num_samples": "int"},
    "weights": {"weights": "dict"},
    "fetch": {"blocks": "list"},
    "probe": {"z1": "array", "zref": "array", "y": "array", "o": "list", "r_prev": "float"},
    # federated evaluation: a held-out batch's eval-mode activations, and the coordinator's tally
    "evaluate": {"z": "array", "y": "array", "split": "int"},
    "eval_result": {"loss": "float", "correct": "int", "count": "int"},
    # before its hello, a device with its own data asks what the run's classes and inputs are
    "description": {"classes": "list", "image_size": "int", "mean": "list", "std": "list"},
    "error": {"reason": "str"},
}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Type tags usable in REQUIRED_FIELDS. "float" accepts ints too: a loss of 0
# may legitimately arrive as the msgpack integer 0 from a non-Python peer.
FIELD_TYPES: dict[str, Callable[[Any], bool]] = {
    "array": lambda v: isinstance(v, np.ndarray),
    "int": _is_int,
    "float": lambda v: isinstance(v, float) or _is_int(v),
    "bool": lambda v: isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "list": lambda v: isinstance(v, (list, tuple)),
    "dict": lambda v: isinstance(v, dict),
}


@dataclass(slots=True)
class Message:
    """One protocol message, already decoded (arrays are numpy arrays).

    ``seq`` is the sender's step number; receivers use ``(sender, seq)`` to
    recognise MQTT QoS 1 redeliveries. Note: ``==`` on two messages whose bodies
    hold arrays raises numpy's "truth value is ambiguous" error; compare fields.
    """

    kind: str
    run: str
    round: int
    seq: int
    sender: str
    body: dict[str, Any] = field(default_factory=dict)


Outgoing = list[tuple[str, Message]]
"""What a role wants sent, each ``(device, message)``, in order. A message that answers a request carries
that request's ``seq`` (the coordinator's replies do): it is the reply to ``device``'s request ``seq``,
whenever it is emitted (MergeSFL's merged step answers a held activation on a later call)."""


def check_body(kind: str, body: dict[str, Any], error: type[WireError]) -> None:
    """Raise ``error`` if ``body`` lacks a field ``kind`` requires or has it mistyped.

    ``error`` is the class to raise: decode passes RemoteProtocolError (the peer
    broke the rules), encode passes LocalProtocolError (we did).
    """
    for name, tag in REQUIRED_FIELDS.get(kind, {}).items():
        if name not in body:
            raise error(f"{kind!r} message is missing required body field {name!r} ({tag})")
        if not FIELD_TYPES[tag](body[name]):
            got = type(body[name]).__name__
            raise error(f"{kind!r} message body field {name!r} must be {tag}, got {got}")
