"""A fleet file's host figures, measured on this host from a real ``trial --fleet`` (docs/fleet.md, "Calibrating
a fleet file to its host").

``simulate --fleet`` turns FLOPs into seconds with ``[host] gflops`` and adds each class's ``warmup_s`` to a
device's first step; both belong to one machine (a file measured on another host put simulate 2-4x off). This
module compares a trial with a simulation of the same run (same config, seed and fleet): the simulation gives
each device-round's FLOPs (its compute seconds times the speed it was charged at), the trial what the host did
with them:

    host gflops = sum FLOPs / sum CPU seconds           device-rounds after each device's first (cpu_s of the
                                                        trial: the CPU its process got while computing)
    warmup_s    = mean over the class's devices of       first round's measured compute seconds - that round's
                                                        FLOPs at the class's calibrated speed

CPU seconds, not wall seconds, give the host's rate: a device under a quarter-core quota, or on a busy host,
computes as fast per CPU second as one with a whole core. Plain data in, plain data out: no torch, no role.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fleet import Fleet, FleetError

__all__ = ["Calibration", "calibrate", "calibrated_toml"]


@dataclass
class Calibration:
    """The host's rate and each class's warm-up, with the samples behind them."""

    host_gflops: float
    warmup_s: dict[str, float]
    device_rounds: int  # steady device-rounds behind host_gflops
    first_rounds: dict[str, int] = field(default_factory=dict)  # per class: devices behind warmup_s


def _timings(records: list[dict[str, Any]]) -> list[tuple[int, str, dict[str, Any]]]:
    out = []
    for rec in records:
        for cid, tm in (rec.get("timing") or {}).items():
            if isinstance(tm, dict) and not tm.get("missed") and tm.get("done_s") is not None:
                out.append((int(rec["round"]), cid, tm))
    return out


def calibrate(fleet: Fleet, trial: list[dict[str, Any]], sim: list[dict[str, Any]]) -> Calibration:
    """Host rate and warm-ups from a trial's records and a simulation's of the same run on ``fleet`` (the file
    both ran with). Raises FleetError when the records cannot say (no CPU seconds: not a ``trial --fleet`` run
    under real limits; rounds that do not match)."""
    by_name = {c.name: c for c in fleet.classes}
    sim_tm = {(r, cid): tm for r, cid, tm in _timings(sim)}
    flops: dict[tuple[int, str], float] = {}
    seen: set[str] = set()
    first: dict[str, int] = {}
    for r, cid, tm in sorted(_timings(sim)):
        cls = by_name.get(tm.get("class"))
        if cls is None:
            raise FleetError(f"fleet file {fleet.path}: the simulation's device {cid} has class {tm.get('class')!r}, "
                             "not one of the file's")
        compute = float(tm["compute_s"])
        if cid not in seen:  # the simulation added the file's warm-up to this step
            seen.add(cid)
            first[cid] = r
            compute = max(0.0, compute - cls.warmup_s)
        flops[(r, cid)] = compute * cls.gflops * 1e9
    steady_flops = steady_cpu = 0.0
    n_steady = 0
    for r, cid, tm in _timings(trial):
        if (r, cid) not in sim_tm or first.get(cid) == r:
            continue
        cpu = tm.get("cpu_s")
        if not isinstance(cpu, (int, float)) or cpu <= 0 or flops[(r, cid)] <= 0:
            continue
        steady_flops += flops[(r, cid)]
        steady_cpu += float(cpu)
        n_steady += 1
    if n_steady == 0:
        raise FleetError("the trial's records have no device-round after a device's first with its CPU seconds "
                         "(cpu_s) and a matching simulated round: calibrate from a `trial --fleet` run under real "
                         "limits (mode cgroup+netns) of at least 2 rounds")
    host = steady_flops / steady_cpu / 1e9
    scale = host / fleet.host_gflops if fleet.host_gflops else 1.0
    warm: dict[str, list[float]] = {}
    for r, cid, tm in _timings(trial):
        if first.get(cid) != r or (r, cid) not in flops:
            continue
        cls = by_name[sim_tm[(r, cid)]["class"]]
        speed = _class_speed(cls, scale)
        warm.setdefault(cls.name, []).append(max(0.0, float(tm["compute_s"]) - flops[(r, cid)] / (speed * 1e9)))
    return Calibration(host_gflops=host, warmup_s={k: sum(v) / len(v) for k, v in warm.items()},
                       device_rounds=n_steady, first_rounds={k: len(v) for k, v in warm.items()})


def _class_speed(cls: Any, scale: float) -> float:
    """The class's GFLOP/s once the host's rate is the calibrated one: a speed relative to the host follows it,
    an absolute one (``gflops``, a profile measured on the board) does not."""
    return cls.gflops * scale if cls.speed_factor is not None else cls.gflops


def calibrated_toml(raw: dict[str, Any], cal: Calibration, note: str, base: Path) -> str:
    """The fleet file ``raw`` (as parsed TOML, read from folder ``base``) with ``[host] gflops`` and each measured
    class's ``warmup_s`` replaced and profile paths made absolute (the new file may live elsewhere); ``note`` goes
    in the header comment. Values are TOML scalars (the fleet format has no others)."""
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in raw.items()}
    host = {k: v for k, v in (data.get("host") or {}).items() if k != "profile"}
    host["gflops"] = round(cal.host_gflops, 3)
    data["host"] = host
    classes = {name: dict(body) for name, body in (data.get("classes") or {}).items()}
    for name, w in cal.warmup_s.items():
        classes[name]["warmup_s"] = round(w, 3)
    for body in classes.values():
        if isinstance(body.get("profile"), str) and not Path(body["profile"]).is_absolute():
            body["profile"] = str((base / body["profile"]).resolve())
    lines = [f"# {line}" for line in note.splitlines()] + [""]
    for table in ("host", "server"):
        if data.get(table):
            lines += [f"[{table}]"] + [f"{k} = {_scalar(v)}" for k, v in data[table].items()] + [""]
    for name, body in classes.items():
        lines += [f"[classes.{name}]"] + [f"{k} = {_scalar(v)}" for k, v in body.items()] + [""]
    return "\n".join(lines)


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise FleetError(f"a fleet value is not finite: {v}")
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"')
    return f'"{s}"'
