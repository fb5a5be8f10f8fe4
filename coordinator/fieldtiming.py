"""Per-device timing of a real fleet (``trial --fleet``; docs/fleet.md, "A real fleet on one machine").

The devices' ``update`` carries ``timing`` (fedsga_edge/transport/link.py): the round's compute seconds,
its seconds inside the transport (``net_s``), its requests and activations, and two wall-clock times:
when its ``round_start`` arrived and when it sent the update. The coordinator adds its own clock: when it
started the round, how long it took to answer each of the device's requests (waiting for the lock
included), and when the update arrived. Per device, in the shape ``simulate --fleet`` writes
(``fedsga_edge.runfiles.device_timing``):

    wire_s    = (round_start_at - round start)            the round_start down its link, plus half the delay
              + (net_s - the coordinator's answering time) the requests' bytes both ways, plus the delays
              + (update arrival - sent_at)                the update up its link
    compute_s = what the device measured outside its transport
    wait_s    = the round's seconds - compute_s - wire_s   (replies it waited for, the round's last device)

The wall-clock times compare across processes on one machine (the trial's case); on separate machines
the clocks differ and the first and last terms carry their offset. Under ``--fleet`` the round's ``fleet_s``
is its real seconds, from starting the devices to the last update (or the deadline); without one the record
keeps its ``round_s`` (the same seconds) and gets ``timing`` alone: every field run measures its devices.
"""

from __future__ import annotations

import math
import time
from typing import Any

from fedsga_edge.runfiles import device_timing

__all__ = ["FieldTiming"]


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


class FieldTiming:
    """Collects one round's timing at the coordinator; ``fields()`` is what the round's record gets."""

    def __init__(self, classes: dict[str, Any], stats: Any, server: str = "coordinator", *, fleet: bool = True) -> None:
        self.classes, self.stats, self.server, self.fleet = classes, stats, server, fleet
        self.t0 = time.time()
        self.devices: list[str] = []
        self._serve: dict[str, float] = {}
        self._updates: dict[str, tuple[float, dict[str, Any], Any]] = {}
        self._bytes0: dict[str, tuple[int, int]] = {}
        self._fields: dict[str, Any] = {}

    def begin(self, devices: list[str]) -> None:
        """The round starts now for ``devices``."""
        self.t0 = time.time()
        self.devices = list(devices)
        self._serve = {d: 0.0 for d in devices}
        self._updates = {}
        self._bytes0 = {d: self._bytes(d) for d in devices}

    def heard(self, msg: Any, t_in: float, t_out: float) -> None:
        """A round message from a device, taken in at ``t_in`` and answered at ``t_out`` (wall clock)."""
        cid = msg.sender
        if cid not in self._serve:
            return
        if msg.kind == "update":
            tm = msg.body.get("timing")
            self._updates[cid] = (t_in, tm if isinstance(tm, dict) else {}, msg.body.get("split"))
        else:
            self._serve[cid] += max(0.0, t_out - t_in)

    def end(self) -> None:
        """The round is over: compute every device's timing."""
        end = time.time()
        round_s = end - self.t0
        out = {}
        for cid in self.devices:
            cls = self.classes.get(cid)
            up, down = (a - b for a, b in zip(self._bytes(cid), self._bytes0[cid]))
            compute = wire = 0.0
            done = split = steps = requests = cpu = None
            if cid in self._updates:
                arrived, tm, split = self._updates[cid]
                split = 0 if split is None else split
                compute = max(0.0, _num(tm.get("compute_s")) or 0.0)
                starts, sent, net = _num(tm.get("round_start_at")), _num(tm.get("sent_at")), _num(tm.get("net_s"))
                if starts is not None:
                    wire += max(0.0, starts - self.t0)
                if net is not None:
                    wire += max(0.0, net - self._serve[cid])
                if sent is not None:
                    wire += max(0.0, arrived - sent)
                done = arrived - self.t0
                steps = int(tm["steps"]) if _num(tm.get("steps")) is not None else None
                requests = int(tm["requests"]) if _num(tm.get("requests")) is not None else None
                cpu = max(0.0, _num(tm.get("cpu_s"))) if _num(tm.get("cpu_s")) is not None else None
            out[cid] = device_timing(split=split if isinstance(split, int) else None, compute_s=compute, wire_s=wire,
                                     wait_s=max(0.0, round_s - compute - wire), bytes_up=up, bytes_down=down,
                                     done_s=done, cls=getattr(cls, "name", None), steps=steps, requests=requests,
                                     cpu_s=cpu)
        self._fields = {"fleet_s": round_s, "timing": out} if self.fleet else {"timing": out}

    def fields(self) -> dict[str, Any]:
        return self._fields

    def _bytes(self, cid: str) -> tuple[int, int]:
        return (self.stats.bytes_sent(src=cid), self.stats.bytes_sent(src=self.server, dst=cid))


def timed_scheduler(scheduler: Any, timing: FieldTiming) -> Any:
    """``scheduler`` (a MessageScheduler) that closes ``timing`` after each round and hands the driver its
    fields (``round_fields``, as FleetScheduler does)."""
    advance = scheduler.advance

    def timed_advance(co: Any, clock: Any, send: Any) -> None:
        advance(co, clock, send)
        timing.end()

    scheduler.advance = timed_advance
    scheduler.round_fields = timing.fields
    return scheduler
