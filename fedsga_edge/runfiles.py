"""Files a run writes: its run files, JSON-lines event logs and atomically replaced files.

``RunFiles`` is the one place ``config.json``, ``metrics.jsonl`` and ``summary.json`` are written,
and ``summarize`` the one place a summary is made, for ``simulate``, the coordinator service
(coordinator/driver.py drives both) and the benchmarks.

Field runs are read by machines after the fact (grep, jq, the report), so each log line is one
JSON object ``{"ts", "level", "event", ...fields}`` rather than free text; thread-safe, because
transport handler threads and a service loop log to the same file. Checkpoints and device state
are replaced atomically (temp file + rename) so a crash or power loss mid-write leaves the
previous version intact, never a torn file.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from fedsga_edge.owndata import device_mean, fed_evaluations, final_own_data

if TYPE_CHECKING:
    from fedsga_edge.config import RunConfig

__all__ = ["JsonLog", "RunFiles", "TIMING_FIELDS", "atomic_write", "atomic_torch_save", "device_timing", "fed_text", "summarize"]

LEVELS = ("debug", "info", "warning", "error")


def _plain(value: Any) -> Any:
    """Whatever a field holds must not make logging itself fail: non-JSON values become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    return str(value)


class JsonLog:
    """Appends one JSON object per event to ``path`` (None: keep the events in memory only)."""

    def __init__(self, path: str | Path | None, *, echo: TextIO | None = None) -> None:
        self.path = Path(path) if path is not None else None
        self._echo = echo
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        self.events: list[dict[str, Any]] = []  # the last few, for health checks and tests
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a", encoding="utf-8")

    def log(self, event: str, level: str = "info", **fields: Any) -> dict[str, Any]:
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        entry = {"ts": round(time.time(), 6), "level": level, "event": event} | {
            k: _plain(v) for k, v in fields.items() if k not in ("ts", "level", "event")}
        line = json.dumps(entry, allow_nan=False)
        with self._lock:
            self.events.append(entry)
            del self.events[:-200]
            if self._file is not None and not self._file.closed:
                self._file.write(line + "\n")
                self._file.flush()
            if self._echo is not None:
                self._echo.write(line + "\n")
        return entry

    def info(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.log(event, "info", **fields)

    def warning(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.log(event, "warning", **fields)

    def error(self, event: str, **fields: Any) -> dict[str, Any]:
        return self.log(event, "error", **fields)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()


def atomic_write(path: str | Path, data: bytes | str) -> None:
    """Write ``data`` to ``path`` via a temp file in the same folder, fsync, then rename over it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_torch_save(obj: Any, path: str | Path) -> None:
    """``torch.save`` with the same temp-file + rename guarantee as :func:`atomic_write`."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    atomic_write(path, buf.getvalue())


# A round record's "timing" map: device -> these fields (docs/method.md, "Time per device"). The one shape for
# simulate --fleet (its virtual clock fills them) and the field service (real timestamps, when it fills them).
# trial --fleet adds what the device counted: "steps" (its activations), "requests" (before its update) and
# "cpu_s" (the CPU seconds its process got in the round); "link_mbps": the link's measured rate (any timed round).
TIMING_FIELDS = ("class", "split", "compute_s", "wire_s", "wait_s", "bytes_up", "bytes_down", "done_s", "missed",
                 "steps", "requests", "cpu_s", "link_mbps")


def device_timing(*, split: int | None, compute_s: float, wire_s: float, wait_s: float, bytes_up: int,
                  bytes_down: int, done_s: float | None = None, cls: str | None = None,
                  missed: bool = False, steps: int | None = None, requests: int | None = None,
                  cpu_s: float | None = None) -> dict[str, Any]:
    """One device's round in ``timing``: seconds computing, on its link (bytes over rate plus delay) and
    waiting (for the server's replies and for the round's last device), its bytes each way, its split
    (0: the whole model; None: it sent none), when it was done (None: never, e.g. the deadline took it),
    its fleet class (None outside a fleet) and whether it missed the round; ``steps``, ``requests`` and
    ``cpu_s``: what a real device counted (a field run), absent when not given. ``link_mbps``: its link's
    measured rate, both ways' bytes over its wire seconds (absent when it moved nothing), what a planner
    predicts the next round's transfers from."""
    rec: dict[str, Any] = {"class": cls, "split": split, "compute_s": round(float(compute_s), 6),
                           "wire_s": round(float(wire_s), 6), "wait_s": round(float(wait_s), 6),
                           "bytes_up": int(bytes_up), "bytes_down": int(bytes_down),
                           "done_s": None if done_s is None else round(float(done_s), 6)}
    if wire_s > 0 and bytes_up + bytes_down > 0:
        rec["link_mbps"] = round((bytes_up + bytes_down) * 8 / wire_s / 1e6, 6)
    if missed:
        rec["missed"] = True
    if steps is not None:
        rec["steps"] = int(steps)
    if requests is not None:
        rec["requests"] = int(requests)
    if cpu_s is not None:
        rec["cpu_s"] = round(float(cpu_s), 6)
    return rec


class RunFiles:
    """``config.json`` (the run's settings), ``metrics.jsonl`` (one record per round, flushed as it
    ends, so a killed run keeps its rounds) and ``summary.json`` under ``run_dir``."""

    def __init__(self, run_dir: str | Path) -> None:
        self.dir = Path(run_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._metrics: TextIO | None = None

    @property
    def metrics_path(self) -> Path:
        return self.dir / "metrics.jsonl"

    def write_config(self, info: dict[str, Any]) -> None:
        atomic_write(self.dir / "config.json", json.dumps(info, indent=2))

    def open_metrics(self, *, append: bool) -> None:
        """Start ``metrics.jsonl`` afresh, or go on after the lines a resume rewrote."""
        self.close_metrics()
        self._metrics = self.metrics_path.open("a" if append else "w")

    def append_metrics(self, record: dict[str, Any]) -> None:
        if self._metrics is None:
            raise RuntimeError("open_metrics() first")
        self._metrics.write(json.dumps(record) + "\n")
        self._metrics.flush()

    def rewrite_metrics(self, records: list[dict[str, Any]]) -> None:
        """Replace ``metrics.jsonl`` with ``records`` (a resume: each round listed once)."""
        atomic_write(self.metrics_path, "".join(json.dumps(r) + "\n" for r in records))

    def close_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None

    def write_summary(self, summary: dict[str, Any]) -> None:
        atomic_write(self.dir / "summary.json", json.dumps(summary, indent=2))


def summarize(records: list[dict[str, Any]], cfg: "RunConfig", wall_s: float) -> dict[str, Any]:
    """``summary.json``: the run in one object (a run stopped before its first round has no means: None)."""
    accs = [r["test_acc"] for r in records if "test_acc" in r]
    cal = [r.get("calibration_flops", {}) for r in records]
    obs = [r.get("observation_flops", {}) for r in records]
    out = {
        "strategy": cfg.strategy,
        "rounds": len(records),
        "final_acc": accs[-1] if accs else None,
        "final_acc_by_split": next((r["test_acc_by_split"] for r in reversed(records) if "test_acc_by_split" in r), None),
        "eval_split": next((r["eval_split"] for r in reversed(records) if "test_acc_by_split" in r), None),
        "best_acc": max(accs) if accs else None,
        "final_test_loss": next((r["test_loss"] for r in reversed(records) if "test_loss" in r), None),
        # docs/method.md, "Costs": per-round means; the parts are apart in runs recorded since they were
        # (before, client_flops_per_sample was training alone: that is what such a round's train part is)
        "client_flops_per_sample": _mean([r["client_flops_per_sample"] for r in records]),
        "client_train_flops_per_sample": _mean([r.get("client_train_flops_per_sample", r["client_flops_per_sample"])
                                                for r in records]),
        "client_method_flops_per_sample": _mean([r["client_method_flops_per_sample"] for r in records
                                                 if "client_method_flops_per_sample" in r]),
        "client_params": _mean([r["client_params"] for r in records]),
        "bytes_total": int(sum(r["bytes_up"] + r["bytes_down"] for r in records)),
        "bytes_up": int(sum(r["bytes_up"] for r in records)),
        "bytes_down": int(sum(r["bytes_down"] for r in records)),
        "calibration_flops": {
            "client": int(sum(c.get("client", 0) for c in cal)),
            "server": int(sum(c.get("server", 0) for c in cal)),
        },
        "observation_flops": {"client": int(sum(c.get("client", 0) for c in obs))},
        "split_histogram": _histogram(records),
        "failures": sum(len(r.get("failures", {})) for r in records),
        "wall_s": wall_s,
    }
    if records and all("server_steps" in r for r in records):  # the server's work (docs/method.md, "Costs")
        out["server_steps"] = int(sum(r["server_steps"] for r in records))
        out["server_flops"] = int(sum(r["server_flops"] for r in records))
    fleet = [r["fleet_s"] for r in records if "fleet_s" in r]
    if fleet:  # simulate --fleet: the seconds the fleet would have taken (docs/fleet.md); absent otherwise
        out["fleet_s"] = float(sum(fleet))
        out["fleet_round_s"] = {"median": float(np.median(fleet)), "max": float(max(fleet))}
    fed = fed_evaluations(records)
    if fed:  # the devices' own figure of the last model they evaluated (docs/protocol.md, "Federated evaluation"):
        # the final model's when the run had its final evaluation, fed_model_round says which
        out["final_fed_acc"], out["fed_model_round"] = fed[-1]["fed_acc"], fed[-1]["fed_model_round"]
        if "fed_acc_finetuned" in fed[-1]:  # FedBABU: the devices' fine-tuned heads on the same model
            out["final_fed_acc_finetuned"] = fed[-1]["fed_acc_finetuned"]
    final = final_own_data(records)
    if final is not None:  # the final model as each device uses it, on its own data: mean over devices
        out["final_own_acc"] = device_mean(final)
    return out


def fed_text(summary: dict[str, Any]) -> str:
    """The federated figures of a summary for a command's last line (empty without --eval-holdout)."""
    text = (f" final_fed_acc={summary['final_fed_acc']:.4f} fed_model_round={summary['fed_model_round']}"
            if "final_fed_acc" in summary else "")
    if "final_fed_acc_finetuned" in summary:
        text += f" final_fed_acc_finetuned={summary['final_fed_acc_finetuned']:.4f}"
    return text


def _mean(values: list[float]) -> float | None:
    return float(np.mean(values)) if values else None


def _histogram(records: list[dict[str, Any]]) -> dict[str, int]:
    hist: dict[str, int] = {}
    for r in records:
        for k in r["splits"].values():
            hist[str(k)] = hist.get(str(k), 0) + 1
    return dict(sorted(hist.items()))
