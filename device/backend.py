"""The device round's building blocks shared by the role and the methods' device sides: the compute backend's
contract, how a round fails (the backend cannot, or the coordinator refused), and the round's step type.

Only numpy and the wire here (no torch): the torch-free ONNX device imports it.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import Any, Protocol, TypeVar

import numpy as np

from fedsga_edge.config import TrainConfig
from fedsga_edge.wire import Message

__all__ = ["Backend", "BackendError", "Refused", "Steps", "expect"]


class BackendError(RuntimeError):
    """The backend cannot do what the round asks (e.g. a FedAvg round on the ONNX backend)."""


class Backend(Protocol):
    """The prefix's arithmetic. Arrays in and out are numpy; the backend keeps the block weights.

    One training step is ``forward`` (returns z and, when asked, the pooled p_1 features h1),
    then, once the server's dz is back, ``backward`` (one SGD step of the prefix and the prompts;
    returns the prompts' gradient and their value before the step, for Eq. 2).
    """

    name: str
    num_splits: int
    num_blocks: int

    def depth_of(self, k: int) -> int: ...

    def unit_of(self, name: str) -> int:
        """The model's aggregation unit of a weight (``SplitModel.unit_of``); ValueError if unknown."""
        ...

    def weight_shape(self, name: str) -> tuple[int, ...] | None:
        """The shape ``load`` needs for a weight (None: the backend does not keep it); ValueError if unknown.

        The role checks every weight the coordinator sends against it before ``load`` allocates anything."""
        ...

    def init_prompts(self, m: int) -> np.ndarray: ...

    def inputs(self, images: np.ndarray, augment: bool) -> Any: ...

    def load(self, weights: dict[str, np.ndarray]) -> None: ...

    def observe(self, x: Any, prompts: np.ndarray | None) -> np.ndarray: ...

    def train_begin(self, cfg: TrainConfig, depth: int, full: bool, prompts: np.ndarray | None,
                    prompt_lr: float | None = None) -> None:
        """Start local training; the prompts (if any) step at ``prompt_lr`` (None: ``cfg.lr``)."""
        ...

    def forward(self, x: Any, want_h1: bool) -> tuple[np.ndarray, np.ndarray | None]: ...

    def backward(self, dz: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None: ...

    def full_step(self, x: Any, y: np.ndarray) -> float: ...

    def train_end(self) -> np.ndarray | None: ...

    def probe(self, x: Any, prompts: np.ndarray | None, d1: int, dref: int) -> tuple[np.ndarray, np.ndarray]: ...

    def weights(self, depth: int, full: bool) -> dict[str, np.ndarray]: ...

    def capabilities(self) -> dict[str, Any]: ...

    def rng_state(self) -> Any: ...

    def set_rng_state(self, state: Any) -> None: ...


class Refused(Exception):
    """The coordinator refused a request (or answered nonsense, or the round start asks for what this device
    cannot give it): this round cannot go on."""


_R = TypeVar("_R")
# A part of the round: yields (kind, body) requests, is sent each reply, returns its result.
Steps = Generator[tuple[str, dict[str, Any]], Message | None, _R]


def expect(reply: Message | None, kind: str) -> Message:
    """``reply`` if it is a ``kind``; else ``Refused``, naming the coordinator's reason when it gave one."""
    if reply is None or reply.kind != kind:
        reason = reply.body.get("reason") if reply is not None and reply.kind == "error" else None
        got = reply.kind if reply is not None else "nothing"
        raise Refused(f"coordinator answered {got}" + (f": {reason}" if reason else f" where {kind} was expected"))
    return reply
