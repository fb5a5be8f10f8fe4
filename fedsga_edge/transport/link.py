"""A device's link as ``trial --fleet`` gives it (docs/fleet.md, "A real fleet on one machine").

``FleetLink`` wraps a device's transport:

* **delay**: half the class's round trip before each message goes out and after each one comes in
  (a reply, or a message to the device's handler): this kernel has no ``netem``, so the delay is
  added here, in user space, in either mode;
* **emulation** (``emulate=True``, the ``emulated`` mode, where no cgroup or namespace limits the
  process): each message's bytes over the link's rate are slept too, and before each message goes
  out the device sleeps what a CPU at ``speed`` of this one would have added to the compute since
  its last message (``compute x (1/speed - 1)``);
* **timing**: from the last message to the device's handler (its ``round_start``) on, the seconds
  spent inside the transport (``net_s``: the requests' round trips, delay and emulation included)
  and the requests made; ``TimingPeer`` puts them in the ``update``'s body as ``timing``
  (``compute_s``: the round's time outside the transport, ``cpu_s``: the CPU seconds the process got
  outside the transport in the round (under a quota, or on a busy host, a fraction of ``compute_s``; the
  CPU its MQTT thread spends sending while a request waits is the transport's, so it is left out: on a
  2 Mbit/s link it exceeded the round's compute), ``net_s``, ``requests``, ``steps`` (the
  activations), ``round_start_at`` and ``sent_at``: wall-clock times, comparable on one machine).
  The coordinator turns them into the round's per-device ``timing`` (coordinator/scheduling.py
  ``FieldTiming``). Extra body fields are always allowed (fedsga_edge/wire/messages.py).
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["FleetLink", "TimingPeer"]


class FleetLink:
    """A device's transport under its class's link: delay, optional emulation, and the round's timing."""

    def __init__(self, inner: Any, *, rtt_ms: float, up_mbps: float, down_mbps: float, speed: float = 1.0,
                 emulate: bool = False) -> None:
        self._inner = inner
        self.delay_s = max(0.0, rtt_ms) / 2e3
        self.up_bps, self.down_bps = up_mbps * 1e6, down_mbps * 1e6
        self.speed, self.emulate = speed, emulate
        self._lock = threading.Lock()
        self.round_start_at = time.time()
        self._cpu0 = time.process_time()
        self.net_s = self.net_cpu_s = 0.0
        self.requests = self.steps = 0
        self._last = time.perf_counter()  # when the device last left the transport (its compute since: ours)

    # -- what the transport's users see ----------------------------------------------------------------
    def request(self, src: str, dst: str, payload: bytes, *, timeout: float | None = None) -> bytes:
        t, c = self._out(len(payload))
        try:
            reply = self._inner.request(src, dst, payload, timeout=timeout)
            self._in(len(reply))
        finally:
            self._done(t, c, request=True)
        return reply

    def send(self, src: str, dst: str, payload: bytes) -> None:
        t, c = self._out(len(payload))
        try:
            self._inner.send(src, dst, payload)
        finally:
            self._done(t, c, request=False)

    def register(self, address: str, handler: Any) -> None:
        def delayed(data: bytes) -> Any:
            self._in(len(data))
            with self._lock:  # a round_start (or a bye): the round's accounting starts afresh
                self.round_start_at, self.net_s, self.requests, self.steps = time.time(), 0.0, 0, 0
                self._cpu0, self.net_cpu_s = time.process_time(), 0.0
                self._last = time.perf_counter()
            return handler(data)

        self._inner.register(address, delayed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    # -- the round's timing ----------------------------------------------------------------------------
    def timing(self) -> dict[str, Any]:
        """The round so far, as the update reports it (call just before sending the update)."""
        with self._lock:
            now = time.time()
            compute = max(0.0, now - self.round_start_at - self.net_s)
            cpu = max(0.0, time.process_time() - self._cpu0 - self.net_cpu_s)
            return {"compute_s": round(compute, 6), "cpu_s": round(cpu, 6),
                    "net_s": round(self.net_s, 6), "requests": self.requests,
                    "steps": self.steps, "round_start_at": self.round_start_at, "sent_at": now}

    # -- internals --------------------------------------------------------------------------------------
    def _out(self, nbytes: int) -> tuple[float, float]:
        if self.emulate and self.speed < 1.0:  # a slower CPU: stretch the compute since the last message
            time.sleep((time.perf_counter() - self._last) * (1.0 / self.speed - 1.0))
        t, c = time.perf_counter(), time.process_time()
        time.sleep(self.delay_s + (nbytes * 8 / self.up_bps if self.emulate else 0.0))
        return t, c

    def _in(self, nbytes: int) -> None:
        time.sleep(self.delay_s + (nbytes * 8 / self.down_bps if self.emulate else 0.0))

    def _done(self, t: float, c: float, *, request: bool) -> None:
        now = time.perf_counter()
        with self._lock:
            self.net_s += now - t
            self.net_cpu_s += time.process_time() - c
            self.requests += int(request)
            self._last = now


class TimingPeer:
    """A device's Peer that adds the link's ``timing`` to its update and counts its activations."""

    def __init__(self, peer: Any, link: FleetLink) -> None:
        self._peer, self._link = peer, link

    def call(self, dst: str, kind: str, round: int, body: dict[str, Any] | None = None, **kw: Any) -> Any:
        if kind == "activation":
            self._link.steps += 1
        elif kind == "update" and body is not None:
            body = {**body, "timing": self._link.timing()}
        return self._peer.call(dst, kind, round, body, **kw)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._peer, name)
