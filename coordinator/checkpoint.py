"""The run's ``checkpoint.pt``: one writer for ``simulate`` and the coordinator service, and resume.

Every checkpoint holds ``model`` (the global weights: ``create_model(..., pretrained=...)`` and
``export --checkpoint`` load it), ``arch`` and ``coordinator`` (harmonizer, prototypes, estimator,
calibration pairs). A resumable one (the service's, replaced atomically after every round) adds
``round`` and ``resume``: what ``Coordinator.checkpoint_state`` says the next round needs, the
records so far, the registered devices, the run's wall time and the global random generators, so
a killed coordinator goes on as if never stopped (docs/protocol.md, "Faults").
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsga_edge.config import RunConfig
from fedsga_edge.runfiles import atomic_torch_save

__all__ = ["RESUMABLE", "RESUME_VERSION", "CheckpointWriter", "Resumed", "load_resume"]

RESUME_VERSION = 1
# Settings a resumed run may change: how long it goes on and how it waits, not what it computes.
RESUMABLE = ("rounds", "round_timeout", "eval_every", "device", "data_root")


class CheckpointWriter:
    """Writes ``path``: after every round when ``resumable`` (with the resume state), else once at the end."""

    def __init__(self, path: str | Path, cfg: RunConfig, *, resumable: bool,
                 extra: Callable[[], dict[str, Any]] | None = None) -> None:
        """``extra``: more resume state from the driver's owner (the service's registered devices)."""
        self.path = Path(path)
        self.cfg = cfg
        self.resumable = resumable
        self._extra = extra

    def state(self, co: Any, t: int, records: list[dict[str, Any]], elapsed_s: float) -> dict[str, Any]:
        """What ``write`` saves (call under the driver's lock: it reads the coordinator)."""
        if not self.resumable:
            return {"model": co.model.state_dict(), "arch": self.cfg.model, "coordinator": co.state_dict()}
        full = co.checkpoint_state()
        extra = self._extra() if self._extra is not None else {}
        return {"round": t, "model": co.model.state_dict(), "arch": self.cfg.model,
                "coordinator": full.pop("coordinator"),
                "resume": {"version": RESUME_VERSION, "config": self.cfg.to_dict(), "records": records, **extra,
                           "elapsed_s": elapsed_s, **full, "rng": global_rngs()}}

    def write(self, co: Any, t: int, records: list[dict[str, Any]], elapsed_s: float) -> None:
        atomic_torch_save(self.state(co, t, records, elapsed_s), self.path)


@dataclass
class Resumed:
    """What a resumable checkpoint gave back besides the coordinator's own state."""

    round: int
    records: list[dict[str, Any]]
    registered: dict[str, Any]
    elapsed_s: float


def load_resume(path: Path, co: Any, cfg: RunConfig) -> Resumed:
    """Check ``path`` was made by this run's settings, restore ``co`` and the global generators from it.

    ValueError names what is wrong: not a checkpoint, no resume state (``simulate`` wrote it), another
    model, or a setting outside ``RESUMABLE`` that changed.
    """
    try:
        ck = torch.load(path, map_location=co.device, weights_only=True)
    except Exception as exc:
        raise ValueError(f"cannot resume from {path}: {type(exc).__name__}: {exc}") from None
    state = ck.get("resume") if isinstance(ck, dict) else None
    if not isinstance(state, dict) or state.get("version") != RESUME_VERSION:
        raise ValueError(f"{path} holds no resume state of version {RESUME_VERSION} (written by simulate or "
                         "another version?): this run cannot be resumed")
    if ck.get("arch") != cfg.model:
        raise ValueError(f"{path} is a {ck.get('arch')!r} checkpoint, this run builds {cfg.model!r}")
    try:  # a setting added since the checkpoint was written takes what the run then did (config.RECORD_BEFORE)
        saved = RunConfig.from_record(state["config"], drop_unknown=False).to_dict()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot resume from {path}: its settings do not load here: {exc}") from None
    changed = _changed(saved, cfg.to_dict())
    if changed:
        raise ValueError(f"cannot resume {path.parent}: its checkpoint was made with other settings "
                         f"({'; '.join(changed)}); only {', '.join(RESUMABLE)} may change")
    co.restore({**state, "coordinator": ck["coordinator"]})
    set_global_rngs(state["rng"])
    return Resumed(int(ck["round"]), list(state["records"]), state["registered"], float(state["elapsed_s"]))


def _changed(saved: dict[str, Any], now: dict[str, Any], prefix: str = "") -> list[str]:
    """``key: saved -> now`` for every setting outside RESUMABLE that differs (nested configs by dotted key)."""
    out = []
    for key in sorted(set(saved) | set(now)):
        a, b = saved.get(key), now.get(key)
        if prefix == "" and key in RESUMABLE or a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict) and key != "model_args":
            out += _changed(a, b, f"{prefix}{key}.")
        else:
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def global_rngs() -> dict[str, Any]:
    """Python's, numpy's and torch's global generators, as plain values ``torch.load(weights_only=True)`` reads."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else []
    return {"python": random.getstate(), "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
            "torch": torch.get_rng_state(), "cuda": cuda}


def set_global_rngs(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"].cpu())
    if state["cuda"] and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
