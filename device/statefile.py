"""A device's private state: on disk between runs (``state.npz``) and in memory across one round.

After every round the coordinator acked, the agent saves the client's private state (prompts, r_prev,
the last two descriptors, the last interface mean, round count, its random generators) atomically, as
an ``.npz`` of plain arrays and a JSON meta: no pickle and no torch, so the ONNX backend reads and
writes the same file. A device that reboots keeps its own prompts and r and does not replay the first
round's batch order. The data never needs saving: both sides rebuild the partition from the run's
seeded config (``fedsga_edge.runbuild``).

A round that fails, is refused or is overtaken is rolled back to a :class:`Snapshot` taken before it
(in memory, so a fresh device without a state file is rolled back too): a half-done round leaves no
trace (docs/protocol.md, "Faults").
"""

from __future__ import annotations

import copy
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fedsga_edge.runfiles import atomic_write

from .progress import Progress
from .role import PrivateState, SplitClient

__all__ = ["STATE_FILE", "STATE_VERSION", "Snapshot", "StateFile"]

STATE_FILE = "state.npz"
STATE_VERSION = 2
_ARRAYS = ("prompts", "m_prev", "m_last", "H_prev")


@dataclass(frozen=True)
class Snapshot:
    """What a round may change and a failed round must put back: the state, batch order, the backend's generator."""

    state: PrivateState
    rng: Any
    backend_rng: Any

    @classmethod
    def take(cls, client: SplitClient) -> Snapshot:
        """Copy what a round may change, before it starts."""
        return cls(copy.deepcopy(client.state), copy.deepcopy(client.rng.bit_generator.state),
                   client.backend.rng_state())

    def restore(self, client: SplitClient) -> None:
        client.state = self.state
        client.rng.bit_generator.state = self.rng
        if self.backend_rng is not None:
            client.backend.set_rng_state(self.backend_rng)


class StateFile:
    """``state_dir/state.npz`` of one device of one run: refuses another device's or run's file when loading."""

    def __init__(self, state_dir: Path, device: str, run: str, backend: str) -> None:
        self.path = state_dir / STATE_FILE
        self.device = device
        self.run = run
        self.backend = backend

    def save(self, client: SplitClient, progress: Progress) -> None:
        """Everything private the next round needs (docs/method.md), replaced atomically."""
        s = client.state
        meta = {
            "version": STATE_VERSION,
            "device": self.device,
            "run": self.run,
            "backend": self.backend,
            "rounds_done": progress.rounds_done,
            "last_round": progress.last_round,
            "r_prev": float(s.r_prev),
            "rounds": int(s.rounds),
            "extra": dict(s.extra),
            "rng": client.rng.bit_generator.state,
        }
        arrays = {k: np.asarray(getattr(s, k)) for k in _ARRAYS if getattr(s, k) is not None}
        backend_rng = client.backend.rng_state()
        if backend_rng is not None:
            arrays["backend_rng"] = np.asarray(backend_rng)
        buf = io.BytesIO()
        np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8), **arrays)
        atomic_write(self.path, buf.getvalue())

    def load(self, client: SplitClient, progress: Progress) -> bool:
        """Restore the state a previous agent of this device saved; False when there is none."""
        if not self.path.exists():
            return False
        meta, arrays = self._read()
        client.state = PrivateState(
            r_prev=float(meta["r_prev"]), rounds=int(meta["rounds"]), extra=dict(meta["extra"]),
            **{k: arrays.get(k) for k in _ARRAYS},
        )
        client.rng.bit_generator.state = meta["rng"]
        if "backend_rng" in arrays and meta.get("backend") == self.backend:
            client.backend.set_rng_state(arrays["backend_rng"])
        progress.rounds_done = int(meta["rounds_done"])
        progress.last_round = int(meta["last_round"])
        return True

    def _read(self) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """The file's meta and arrays, checked to be this device's of this run before anything is restored."""
        try:
            with np.load(self.path, allow_pickle=False) as npz:
                meta = json.loads(npz["meta"].tobytes().decode())
                arrays = {k: np.array(npz[k]) for k in npz.files if k != "meta"}
        except (OSError, ValueError, KeyError, UnicodeDecodeError) as exc:
            raise ValueError(f"{self.path} is not a device state file ({type(exc).__name__}: {exc}); "
                             "move it away or use another --state-dir") from None
        if meta.get("version") != STATE_VERSION:
            raise ValueError(f"{self.path}: state version {meta.get('version')!r}, expected {STATE_VERSION}")
        if meta.get("device") != self.device or meta.get("run") != self.run:
            raise ValueError(f"{self.path} holds device {meta.get('device')!r} of run {meta.get('run')!r}, "
                             f"not {self.device!r} of run {self.run!r}: use another --state-dir")
        return meta, arrays
