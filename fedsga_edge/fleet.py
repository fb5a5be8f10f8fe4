"""A fleet file: which devices a simulated run has, how fast they compute and how their links carry bytes.

Core: plain data parsed with the standard library (``tomllib``), no torch, no role. ``simulate --fleet``
(coordinator/scheduling.py ``FleetScheduler``) turns each device's step into virtual seconds with it, and
``--strategy resource`` takes the devices' speeds from it. The format is described in docs/fleet.md::

    [host]                      # optional: what speed_factor is relative to
    gflops = 20.0               # or profile = "host.json"

    [server]                    # optional: model the coordinator's own compute (default: free)
    gflops = 200.0

    [classes.pi4]
    count = 2
    gflops = 1.5                # or speed_factor = 0.1 / profile = "pi4-profile.json"
    uplink_mbps = 20.0
    downlink_mbps = 40.0
    rtt_ms = 8.0
    availability = 0.95         # the chance to take part in a round (1 - its chance to miss one)
    warmup_s = 4.0              # optional: a fresh device process's one-time work (s), added to its first step

Devices get their class in file order: the first ``count`` devices (partition order) the first class.
Every bad value raises ``FleetError`` naming the file and the key.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the tomli backport (pyproject's dependency before 3.11)
    import tomli as tomllib

__all__ = ["DeviceClass", "Fleet", "FleetError", "load_fleet", "parse_fleet", "profile_gflops", "read_fleet"]

_SPEED_KEYS = ("gflops", "speed_factor", "profile")
_CLASS_KEYS = {"count", *_SPEED_KEYS, "uplink_mbps", "downlink_mbps", "rtt_ms", "availability", "warmup_s"}
_TOP_KEYS = {"host", "server", "classes"}


class FleetError(ValueError):
    """A fleet file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class DeviceClass:
    """One kind of device: ``gflops`` is its sustained training throughput (GFLOP/s), whatever the file
    gave (absolute, a factor of the host's, or derived from a measured profile: ``speed_source`` says)."""

    name: str
    count: int
    gflops: float
    speed_source: str
    uplink_mbps: float
    downlink_mbps: float
    rtt_ms: float
    availability: float = 1.0
    # Seconds a freshly started device process of this class spends before its first request (torch's lazy
    # initialisation, first allocations: 3.0-3.4 CPU-s on a host core, 13 s under a quarter core; benchmarks/
    # RESULTS.md, "A real fleet on one machine"). FLOPs do not count it; the virtual clock adds it once per run.
    warmup_s: float = 0.0
    # the file's factor of [host] gflops when it gave one (the class then follows the host's rate); None for an
    # absolute gflops or a profile measured on the board
    speed_factor: float | None = None

    def compute_s(self, flops: float) -> float:
        """Seconds this class takes for ``flops`` floating-point operations."""
        return flops / (self.gflops * 1e9)

    def up_s(self, nbytes: int) -> float:
        """Seconds to push ``nbytes`` up its link (rate only; the delay is ``rtt_ms``)."""
        return nbytes * 8 / (self.uplink_mbps * 1e6)

    def down_s(self, nbytes: int) -> float:
        return nbytes * 8 / (self.downlink_mbps * 1e6)

    def round_s(self, flops: float, bytes_up: float, bytes_down: float, round_trips: float) -> float:
        """Predicted seconds of one device's round on this class, as the virtual clock charges them
        (docs/fleet.md, "The time model"): its compute, its bytes each way and a round trip per request,
        with no waiting for the server or other devices (what a deadline-aware split choice compares)."""
        return (self.compute_s(flops) + self.up_s(bytes_up) + self.down_s(bytes_down)
                + round_trips * self.rtt_ms / 1e3)


@dataclass(frozen=True)
class Fleet:
    """The classes in file order; ``server_gflops`` None: the coordinator's compute is not modelled (free)."""

    path: str
    classes: tuple[DeviceClass, ...]
    server_gflops: float | None = None
    host_gflops: float | None = None

    @property
    def size(self) -> int:
        return sum(c.count for c in self.classes)

    def assign(self, devices: list[str]) -> dict[str, DeviceClass]:
        """Each device's class, dealt in file order over ``devices`` (partition order)."""
        if len(devices) != self.size:
            raise FleetError(f"fleet file {self.path}: its classes count {self.size} devices, the run has "
                             f"{len(devices)} (--clients {len(devices)}); make the counts add up to --clients")
        out: dict[str, DeviceClass] = {}
        it = iter(devices)
        for cls in self.classes:
            for _ in range(cls.count):
                out[next(it)] = cls
        return out

    def speed_factors(self, devices: list[str]) -> dict[str, float]:
        """Each device's speed over the median device's (``resource``'s speed factors: median 1)."""
        by = self.assign(devices)
        g = sorted(c.gflops for c in by.values())
        mid = len(g) // 2
        median = g[mid] if len(g) % 2 else (g[mid - 1] + g[mid]) / 2
        return {d: c.gflops / median for d, c in by.items()}


def load_fleet(path: str | Path) -> Fleet:
    """Read and check a fleet file (profiles named in it are read relative to its folder)."""
    return read_fleet(path)[0]


def read_fleet(path: str | Path) -> tuple[Fleet, dict[str, Any]]:
    """The checked fleet and the file's parsed TOML (what ``calibrate-fleet`` rewrites)."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise FleetError(f"fleet file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise FleetError(f"fleet file {p} is not valid TOML: {exc}") from None
    return parse_fleet(data, str(p), base=p.parent), data


def parse_fleet(data: dict[str, Any], path: str = "<fleet>", base: Path | None = None) -> Fleet:
    """A ``Fleet`` from parsed TOML; every problem raises ``FleetError`` naming ``path`` and the key."""
    base = base if base is not None else Path(".")

    def bad(key: str, what: str) -> FleetError:
        return FleetError(f"fleet file {path}: {key} {what}")

    unknown = sorted(set(data) - _TOP_KEYS)
    if unknown:
        raise bad(unknown[0], f"is not a fleet key (known: {', '.join(sorted(_TOP_KEYS))})")
    host = _table(data, "host", bad)
    server = _table(data, "server", bad)
    for name, table, keys in (("host", host, {"gflops", "profile"}), ("server", server, {"gflops"})):
        extra = sorted(set(table) - keys)
        if extra:
            raise bad(f"{name}.{extra[0]}", f"is not a key of [{name}] (known: {', '.join(sorted(keys))})")
    host_gflops = None
    if "gflops" in host and "profile" in host:
        raise bad("host", "takes one of gflops and profile, not both")
    if "gflops" in host:
        host_gflops = _number(host["gflops"], "host.gflops", bad, gt=0)
    elif "profile" in host:
        host_gflops = _profile(host["profile"], "host.profile", bad, base)
    server_gflops = _number(server["gflops"], "server.gflops", bad, gt=0) if "gflops" in server else None
    classes_raw = data.get("classes")
    if not isinstance(classes_raw, dict) or not classes_raw:
        raise bad("classes", "must hold at least one [classes.<name>] table")
    classes = []
    for name, raw in classes_raw.items():
        key = f"classes.{name}"
        if not isinstance(raw, dict):
            raise bad(key, "must be a table ([classes.<name>])")
        extra = sorted(set(raw) - _CLASS_KEYS)
        if extra:
            raise bad(f"{key}.{extra[0]}", f"is not a class key (known: {', '.join(sorted(_CLASS_KEYS))})")
        for need in ("count", "uplink_mbps", "downlink_mbps", "rtt_ms"):
            if need not in raw:
                raise bad(f"{key}.{need}", "is missing")
        count = raw["count"]
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise bad(f"{key}.count", f"must be an integer >= 1 (got {count!r})")
        speeds = [k for k in _SPEED_KEYS if k in raw]
        if len(speeds) != 1:
            raise bad(key, f"needs exactly one compute speed of {', '.join(_SPEED_KEYS)} (got "
                      f"{', '.join(speeds) or 'none'})")
        kind, factor = speeds[0], None
        if kind == "gflops":
            gflops = _number(raw["gflops"], f"{key}.gflops", bad, gt=0)
            source = "gflops"
        elif kind == "speed_factor":
            factor = _number(raw["speed_factor"], f"{key}.speed_factor", bad, gt=0)
            if host_gflops is None:
                raise bad(f"{key}.speed_factor", "is relative to the host: give [host] gflops or [host] profile")
            gflops, source = factor * host_gflops, f"speed_factor {factor:g} x host {host_gflops:g} GFLOP/s"
        else:
            gflops = _profile(raw["profile"], f"{key}.profile", bad, base)
            source = f"profile {raw['profile']}"
        classes.append(DeviceClass(
            name=name, count=count, gflops=gflops, speed_source=source,
            uplink_mbps=_number(raw["uplink_mbps"], f"{key}.uplink_mbps", bad, gt=0),
            downlink_mbps=_number(raw["downlink_mbps"], f"{key}.downlink_mbps", bad, gt=0),
            rtt_ms=_number(raw["rtt_ms"], f"{key}.rtt_ms", bad, ge=0),
            availability=_number(raw.get("availability", 1.0), f"{key}.availability", bad, gt=0, le=1),
            warmup_s=_number(raw.get("warmup_s", 0.0), f"{key}.warmup_s", bad, ge=0), speed_factor=factor))
    return Fleet(path=path, classes=tuple(classes), server_gflops=server_gflops, host_gflops=host_gflops)


def profile_gflops(report: dict[str, Any]) -> float:
    """Sustained training GFLOP/s from a ``fedsga-edge profile --json`` report: the fp32 train steps'
    FLOPs over their median times, summed over the splits at the largest batch profiled (the forward
    latency where no train step was timed: a forward costs about a third of a train step's FLOPs)."""
    rows = report.get("results") if isinstance(report, dict) else None
    if not isinstance(rows, list):
        raise ValueError("has no 'results' list (is it the JSON of `fedsga-edge profile --json`?)")
    best: dict[int, tuple[int, float, float]] = {}
    for row in rows:
        if not isinstance(row, dict) or row.get("variant", "fp32") != "fp32":
            continue
        train, fwd = row.get("train_step_ms"), row.get("latency_ms")
        if train and row.get("flops_train_per_sample"):
            flops, ms = float(row["flops_train_per_sample"]), float(train["p50"])
        elif fwd and row.get("flops_per_sample"):
            flops, ms = float(row["flops_per_sample"]), float(fwd["p50"])
        else:
            continue
        k, batch = int(row["split"]), int(row.get("batch", 1))
        if k not in best or batch > best[k][0]:
            best[k] = (batch, flops * batch, ms / 1e3)
    if not best or sum(s for _, _, s in best.values()) <= 0:
        raise ValueError("has no fp32 row with FLOPs and a latency")
    return sum(f for _, f, _ in best.values()) / sum(s for _, _, s in best.values()) / 1e9


def _table(data: dict[str, Any], name: str, bad: Any) -> dict[str, Any]:
    value = data.get(name, {})
    if not isinstance(value, dict):
        raise bad(name, f"must be a table ([{name}])")
    return value


def _number(value: Any, key: str, bad: Any, *, gt: float | None = None, ge: float | None = None,
            le: float | None = None) -> float:
    """A finite number within the bounds, else an error naming ``key``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad(key, f"must be a finite number (got {value!r})")
    if gt is not None and not value > gt or ge is not None and not value >= ge or le is not None and not value <= le:
        bounds = " and ".join(s for s in (f"> {gt:g}" if gt is not None else "", f">= {ge:g}" if ge is not None else "",
                                          f"<= {le:g}" if le is not None else "") if s)
        raise bad(key, f"must be {bounds} (got {value!r})")
    return float(value)


def _profile(value: Any, key: str, bad: Any, base: Path) -> float:
    if not isinstance(value, str) or not value:
        raise bad(key, f"must be the path of a `fedsga-edge profile --json` file (got {value!r})")
    p = Path(value) if Path(value).is_absolute() else base / value
    try:
        report = json.loads(p.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise bad(key, f"names {p}, which does not exist") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise bad(key, f"names {p}, which is not readable JSON ({exc})") from None
    try:
        return profile_gflops(report)
    except (ValueError, TypeError, KeyError) as exc:
        raise bad(key, f"names {p}, which {exc}") from None
