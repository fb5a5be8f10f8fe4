"""Who is registered with a field run's coordinator: hellos checked and recorded, byes, ``devices.json``.

A device registers with ``hello`` (``backend``, ``num_samples``, ``capabilities``, optionally its
measured latency ``profile``). ``num_samples`` must equal the size of that device's partition on this
side: both sides derive partitions from the same seeded config, so a mismatch means a different config
or data set and the device is refused before it can train on the wrong samples. A device with its own
data (``local_data``) reports its size instead, which then weighs its updates. The strategy hears of
each registration and departure (``Strategy.device_registered`` / ``device_left``). Not thread-safe:
the service calls it under its lock.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from fedsga_edge.latency import hello_profile_problem
from fedsga_edge.runfiles import JsonLog, atomic_write

__all__ = ["MAX_LOCAL_SAMPLES", "Registry"]

MAX_LOCAL_SAMPLES = 10**9


class Registry:
    """The registered devices of one Coordinator (``registered``: device -> what its hello said)."""

    def __init__(self, co: Any, run_dir: Path, log: JsonLog, *, local_data: bool = False) -> None:
        self.co, self.run_dir, self.log, self.local_data = co, run_dir, log, local_data
        self.registered: dict[str, dict[str, Any]] = {}

    def problem(self, sender: str, body: dict[str, Any]) -> str | None:
        """Why a ``hello`` is refused (None: it is not)."""
        expected = self.co.clients.get(sender)
        return ((_local_hello_problem(sender, body, expected) if self.local_data
                 else _hello_problem(sender, body, expected)) or self.profile_problem(body.get("profile")))

    def profile_problem(self, profile: Any) -> str | None:
        """Why a hello's ``profile`` is refused (none: fine, a device need not report one)."""
        if profile is None:
            return None
        return hello_profile_problem(profile, self.co.cfg.model, self.co.model.num_splits)

    def add(self, sender: str, body: dict[str, Any]) -> bool:
        """Record a checked hello; whether ``sender`` was registered already."""
        again = sender in self.registered
        expected = self.co.clients[sender]
        if self.local_data:  # its own data: the size it reports weighs its updates (docs/protocol.md)
            expected = self.co.clients[sender] = body["num_samples"]
            self.co.unverified.add(sender)  # a claim: weighed at most --sample-cap x the fleet's median
            self.co.fed_eval.expected[sender] = body.get("eval_samples", 0)
        info = {"backend": body["backend"], "num_samples": expected, "since": time.time(),
                "capabilities": dict(body.get("capabilities", {}))}
        if self.local_data:
            info["eval_samples"] = body.get("eval_samples", 0)
        if body.get("profile") is not None:  # its measured latency per split (checked by ``problem``)
            info["profile"] = body["profile"]
        self.registered[sender] = info
        self.co.strategy.device_registered(sender, info)
        self.save()
        return again

    def remove(self, sender: str) -> None:
        """A registered device said ``bye``."""
        del self.registered[sender]
        self.co.strategy.device_left(sender)
        self.save()

    def restore(self, fallback: dict[str, Any]) -> None:
        """A resumed run's devices (``devices.json``, else the checkpoint's ``fallback``), as their hellos
        would have registered them: sizes read back, a profile no longer valid dropped, the strategy told."""
        self.registered = _restored_devices(self.run_dir, fallback, self.co.clients)
        for d, info in self.registered.items() if self.local_data else ():
            n, e = info.get("num_samples"), info.get("eval_samples", 0)
            if isinstance(n, int) and not isinstance(n, bool) and n > 0:
                self.co.clients[d] = n
                self.co.unverified.add(d)
            if isinstance(e, int) and not isinstance(e, bool) and e >= 0:
                self.co.fed_eval.expected[d] = e
        for d, info in self.registered.items():
            problem = self.profile_problem(info.get("profile"))
            if problem is not None:
                self.log.warning("restored_profile_dropped", device=d, reason=problem)
                del info["profile"]
            self.co.strategy.device_registered(d, info)

    def save(self) -> None:
        """``devices.json``: who is registered now; a resumed coordinator reads it."""
        atomic_write(self.run_dir / "devices.json", json.dumps(self.registered, indent=2, default=str))


def _hello_problem(sender: str, body: dict[str, Any], expected: int | None) -> str | None:
    """Why a ``hello`` is refused (None: it is not); ``expected`` is the sender's partition size here."""
    if expected is None:
        return f"unknown device {sender!r:.140}: this run has no partition for it"
    if not isinstance(body.get("backend"), str) or not body["backend"]:
        return "hello must name the device's backend (a non-empty string)"
    if not isinstance(body.get("num_samples"), int) or isinstance(body.get("num_samples"), bool):
        return "hello must carry num_samples (an integer)"
    if body["num_samples"] != expected:
        return (f"num_samples {body['num_samples']} does not match this run's partition for {sender} "
                f"({expected}): the device was built from a different config or data set (a device with its own "
                "data, --data, needs a coordinator started with --classes)")
    if not isinstance(body.get("capabilities", {}), dict):
        return "capabilities must be a map"
    return None


def _local_hello_problem(sender: str, body: dict[str, Any], known: int | None) -> str | None:
    """Why a device with its own data is refused: its size is its word, but a number of samples it must be."""
    if known is None:
        return f"unknown device {sender!r:.140}: not a device of this run (--clients)"
    if not isinstance(body.get("backend"), str) or not body["backend"]:
        return "hello must name the device's backend (a non-empty string)"
    for key, low in (("num_samples", 2), ("eval_samples", 0)):
        v = body.get(key, 0 if key == "eval_samples" else None)
        if not isinstance(v, int) or isinstance(v, bool) or not low <= v <= MAX_LOCAL_SAMPLES:
            return f"hello must carry {key}, an integer in {low}..{MAX_LOCAL_SAMPLES}"
    if not isinstance(body.get("capabilities", {}), dict):
        return "capabilities must be a map"
    return None


def _restored_devices(run_dir: Path, fallback: dict[str, Any], clients: dict[str, int]) -> dict[str, dict[str, Any]]:
    """The devices registered when the last coordinator died (``devices.json``, else the checkpoint's):
    they are still running and listening, so the resumed rounds include them without a new hello."""
    try:
        saved = json.loads((run_dir / "devices.json").read_text())
    except (OSError, ValueError):
        saved = fallback
    if not isinstance(saved, dict):
        saved = fallback
    return {d: dict(info, restored=True) for d, info in saved.items() if d in clients and isinstance(info, dict)}
