"""``trial``'s live table of devices: who is online, in which round, at which split, how long its last
step took and its link's rate, from what the coordinator writes while it runs (``coordinator.log``'s events
and ``metrics.jsonl``'s per-round records; step time and rate from a record's ``timing``, every field run's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["DeviceTable", "JsonTail"]


class JsonTail:
    """The JSON lines appended to a file since the last ``read`` (a line still being written waits)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0

    def read(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        out = []
        for line in data[:end].decode("utf-8", "replace").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
        return out


class DeviceTable:
    """Per device: online, its state in the last round it took part in, split, last step time and link rate."""

    HEAD = ("device", "class", "online", "round", "state", "split", "step s", "link Mbit/s")

    def __init__(self, classes: dict[str, str] | None = None) -> None:
        self.devices: dict[str, dict[str, Any]] = {}
        self.round: int | None = None
        self.classes = dict(classes or {})  # each device's fleet class, known before its first round

    def _dev(self, cid: Any) -> dict[str, Any]:
        return self.devices.setdefault(str(cid), {"class": self.classes.get(str(cid)), "online": None, "round": None,
                                                  "state": "", "split": None, "step_s": None, "mbps": None})

    def event(self, e: dict[str, Any]) -> bool:
        """One ``coordinator.log`` event; True when it changed the table."""
        kind, dev = e.get("event"), e.get("device")
        if kind == "hello_ack" and dev:
            d = self._dev(dev)
            d["online"], d["state"] = True, d["state"] or "registered"
        elif kind == "bye" and dev:
            d = self._dev(dev)
            d["online"], d["state"] = False, "left"
        elif kind == "round_begin":
            self.round = e.get("round")
            for cid in e.get("devices") or []:
                d = self._dev(cid)
                d["round"], d["state"] = self.round, "training"
        elif kind == "update" and dev:
            d = self._dev(dev)
            d["round"], d["state"] = e.get("round"), "done"
            if isinstance(e.get("split"), int):
                d["split"] = e["split"]
        elif kind == "device_gave_up" and dev:
            d = self._dev(dev)
            d["round"], d["state"] = e.get("round"), "gave up"
        elif kind == "round_end":
            for cid, why in (e.get("failures") or {}).items():
                d = self._dev(cid)
                d["round"], d["state"] = e.get("round"), f"failed: {why}"[:40]
        else:
            return False
        return True

    def record(self, rec: dict[str, Any]) -> bool:
        """One round's ``metrics.jsonl`` record: who sent an update (and its split) or failed, and from ``timing``
        each device's class, last step time (compute seconds over steps) and link rate (bytes over wire seconds)."""
        changed, t = False, rec.get("round")
        for cid, k in (rec.get("splits") or {}).items():
            d = self._dev(cid)
            d["split"], d["round"], d["state"] = k, t, "done"
            changed = True
        for cid, why in (rec.get("failures") or {}).items():
            d = self._dev(cid)
            d["round"], d["state"] = t, f"failed: {why}"[:40]
            changed = True
        for cid, t in (rec.get("timing") or {}).items():
            if not isinstance(t, dict):
                continue
            d = self._dev(cid)
            d["class"] = t.get("class") or d["class"]
            steps, compute, wire = t.get("steps"), t.get("compute_s"), t.get("wire_s")
            if isinstance(steps, int) and steps > 0 and isinstance(compute, (int, float)):
                d["step_s"] = compute / steps
            moved = (t.get("bytes_up") or 0) + (t.get("bytes_down") or 0)
            if isinstance(wire, (int, float)) and wire > 0 and moved:
                d["mbps"] = moved * 8 / wire / 1e6
            changed = True
        return changed

    def rows(self) -> list[list[str]]:
        def f(x: Any, fmt: str) -> str:
            return "—" if x is None else format(x, fmt)

        return [[cid, d["class"] or "—", {True: "yes", False: "no", None: "—"}[d["online"]],
                 f(d["round"], "d"), d["state"] or "—", f(d["split"], "d"), f(d["step_s"], ".3f"), f(d["mbps"], ".2f")]
                for cid, d in sorted(self.devices.items())]

    def format(self) -> str:
        rows = [list(self.HEAD)] + self.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.HEAD))]
        return "\n".join("  ".join(c.ljust(w) if i in (0, 1, 4) else c.rjust(w) for i, (c, w) in
                                   enumerate(zip(r, widths))) for r in rows)
