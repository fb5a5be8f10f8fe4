"""What a strategy tells one device at a round's start, and the ``round_start`` body built from it.

A strategy's ``configure_round(t, devices)`` returns one ``Instruction`` per device: the split, the
local training settings (the round's rate included: the coordinator sends ``train`` as it is) and
the method's own fields (its device side's ``method`` map, FedSGA's settings and state, a device's
deadline predictions or label-memory margin). The body is built here, in one place: the core
fields first, then the method's, none of which may name a core field, so a strategy cannot
overwrite the split, the weights or the training settings by accident. docs/protocol.md,
"Messages", describes the fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from fedsga_edge.config import WIRE_FORMATS, TrainConfig

__all__ = ["CORE_FIELDS", "Instruction", "check_instructions", "round_start_body"]

# The coordinator's own round_start fields (and the envelope's round): never a method's
CORE_FIELDS = frozenset({"split", "full", "train", "weights", "round", "evaluate", "evaluate_only",
                         "wire_format"})


def _check_fields(fields: Mapping[str, Any]) -> None:
    """A ValueError naming the first method field that is no string or that names a core field."""
    for key in fields:
        if not isinstance(key, str):
            raise ValueError(f"method field {key!r:.40} is not a string")
        if key in CORE_FIELDS:
            raise ValueError(f"method field {key!r} would overwrite the round_start's core field {key!r}: "
                             f"set the split through Instruction.split and the training settings through "
                             f"Instruction.train")
    method = fields.get("method")
    if method is not None and not (isinstance(method, Mapping) and isinstance(method.get("name"), str)):
        raise ValueError("method field 'method' must be a map naming the method's device side (device/methods.py)")


@dataclass(frozen=True)
class Instruction:
    """One device's round: ``split`` 1..K, 0 for the whole model on the device, None for "the device
    decides"; ``train`` the local settings as sent (lr, mu, freeze_head, epochs ...); ``fields`` the
    method's round-start fields beside the core ones (checked on construction: none may name a core field);
    ``wire_format`` the device's activations and gradients this round (one of ``WIRE_FORMATS``; None: the run's
    ``--wire-format``, and the round start names none)."""

    split: int | None
    train: TrainConfig
    fields: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    wire_format: str | None = None

    def __post_init__(self) -> None:
        if self.split is not None and (isinstance(self.split, bool) or not isinstance(self.split, int)
                                       or self.split < 0):
            raise ValueError(f"Instruction.split must be None or an integer >= 0, not {self.split!r:.40}")
        if not isinstance(self.train, TrainConfig):
            raise ValueError(f"Instruction.train must be a TrainConfig, not {type(self.train).__name__}")
        if not isinstance(self.fields, Mapping):
            raise ValueError(f"Instruction.fields must be a map, not {type(self.fields).__name__}")
        if self.wire_format is not None and self.wire_format not in WIRE_FORMATS:
            raise ValueError(f"Instruction.wire_format must be one of {', '.join(WIRE_FORMATS)} or None, not "
                             f"{self.wire_format!r:.40}")
        _check_fields(self.fields)
        object.__setattr__(self, "fields", MappingProxyType(dict(self.fields)))

    def with_fields(self, **fields: Any) -> "Instruction":
        """This instruction with more (or other) method fields."""
        return dataclasses.replace(self, fields={**self.fields, **fields})

    def with_train(self, **changes: Any) -> "Instruction":
        """This instruction with other training settings (FedProx's mu, FedBABU's freeze_head)."""
        return dataclasses.replace(self, train=dataclasses.replace(self.train, **changes))


def check_instructions(instructions: Any, devices: list[str]) -> dict[str, Instruction]:
    """``configure_round``'s answer, checked: one ``Instruction`` for each device of the round, no other."""
    if not isinstance(instructions, dict) or set(instructions) != set(devices):
        got = sorted(instructions) if isinstance(instructions, dict) else type(instructions).__name__
        raise ValueError(f"configure_round must return one Instruction per device of the round {sorted(devices)}, "
                         f"got {got}")
    for cid, instruction in instructions.items():
        if not isinstance(instruction, Instruction):
            raise ValueError(f"configure_round's answer for {cid} is a {type(instruction).__name__}, "
                             "not an Instruction")
    return instructions


def round_start_body(instruction: Instruction, weights: dict[str, Any], evaluate: bool,
                     evaluate_only: bool = False) -> dict[str, Any]:
    """The ``round_start`` body of one device: core fields, then the method's (checked again here, so
    an instruction whose fields were changed after construction cannot slip a core field in).

    ``weights`` are the units the round start carries (numpy); ``evaluate``: the round measures the
    received model on the device's held-out slice (coordinator/evaluation.py); ``evaluate_only``: it does only
    that (the final evaluation after the last round), training nothing."""
    _check_fields(instruction.fields)
    full = instruction.split == 0
    body: dict[str, Any] = {
        "split": None if full else instruction.split,
        "full": full,
        "train": instruction.train.to_wire(),
        "weights": weights,
        # FedSGA's settings, None for every other method: the field that arms FedSGA's device side (device/fedsga.py)
        "fedsga": None,
    }
    body.update(instruction.fields)
    if instruction.wire_format is not None:  # named only when it is the device's own (--wire-format auto)
        body["wire_format"] = instruction.wire_format
    if evaluate:
        body["evaluate"] = True
    if evaluate_only:
        body["evaluate_only"] = True
    return body
