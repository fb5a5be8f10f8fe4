"""Rate-limited log lines about hostile input: a flood of bad frames must not become a flood of lines.

The rule, per key (the kind of problem and who caused it, e.g. ``("garbage", "up/client-3")``): the
first ``first`` events of each ``interval`` seconds are logged, the rest are only counted, and once
the interval is over one summary line says how many were not logged. At most ``max_lines`` lines
per interval are logged in all (invented sender names cannot multiply the output), at most
``max_keys`` keys are tracked (the oldest gives way; what it held back joins one merged summary), and
the summaries of one sweep beyond ``max_lines`` are merged into one line too. Summaries come with the next
event after the interval, or from ``flush()`` (call it on close).

Pure standard library: the wire and the transports use it, and they must not need torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

__all__ = ["Summary", "Throttle", "ThrottledEvents", "ThrottledLog", "describe"]


@dataclass(slots=True, frozen=True)
class Summary:
    """``suppressed`` events of ``key`` (of ``keys`` keys, when merged) were not logged over ``seconds``."""

    key: Hashable
    suppressed: int
    seconds: float
    keys: int = 1


@dataclass(slots=True)
class _Window:
    started: float
    logged: int = 0
    suppressed: int = 0


class Throttle:
    """Decides which events of a key are logged; hands back the summaries that are due. Thread-safe."""

    def __init__(self, first: int = 10, interval: float = 60.0, *, max_keys: int = 256, max_lines: int = 100,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if first < 0 or interval <= 0 or max_keys < 1 or max_lines < 1:
            raise ValueError("need first >= 0, interval > 0, max_keys >= 1, max_lines >= 1")
        self.first, self.interval, self.max_keys, self.max_lines = first, interval, max_keys, max_lines
        self._clock = clock
        self._lock = threading.Lock()
        self._keys: OrderedDict[Hashable, _Window] = OrderedDict()
        self._lines_since = clock()
        self._lines = 0
        self._next_sweep = self._lines_since + min(interval, 1.0)
        self.total_suppressed = 0
        self._spill: _Window | None = None  # suppressed events of keys evicted for room, summarised together
        self._spilled_keys = 0

    def hit(self, key: Hashable) -> tuple[bool, list[Summary]]:
        """Count one event of ``key``: (whether to log it, the summaries due now, to write first)."""
        with self._lock:
            now = self._clock()
            due: list[tuple[Hashable, _Window]] = []
            if now >= self._next_sweep:
                due += self._sweep(now)
            if now - self._lines_since >= self.interval:
                self._lines_since, self._lines = now, 0
            w = self._keys.get(key)
            if w is None:
                if len(self._keys) >= self.max_keys:
                    _, old = self._keys.popitem(last=False)
                    if old.suppressed:
                        if self._spill is None:
                            self._spill = _Window(old.started)
                        self._spill.suppressed += old.suppressed
                        self._spilled_keys += 1
                w = self._keys[key] = _Window(now)
            self._keys.move_to_end(key)
            if w.logged < self.first and self._lines < self.max_lines:
                w.logged += 1
                self._lines += 1
                return True, self._summaries(due, now)
            w.suppressed += 1
            self.total_suppressed += 1
            return False, self._summaries(due, now)

    def flush(self) -> list[Summary]:
        """Every summary owed so far (the windows restart)."""
        with self._lock:
            now = self._clock()
            due = [(k, w) for k, w in self._keys.items() if w.suppressed]
            self._keys.clear()
            return self._summaries(due, now) + self._take_spill(now, force=True)

    def _sweep(self, now: float) -> list[tuple[Hashable, _Window]]:
        """Close the windows older than ``interval``: those with suppressed events owe a summary."""
        self._next_sweep = now + min(self.interval, 1.0)
        over = [k for k, w in self._keys.items() if now - w.started >= self.interval]
        return [(k, w) for k in over if (w := self._keys.pop(k)).suppressed]

    def _summaries(self, due: list[tuple[Hashable, _Window]], now: float) -> list[Summary]:
        out = [Summary(k, w.suppressed, now - w.started) for k, w in due[: self.max_lines]]
        rest = due[self.max_lines :]
        if rest:
            out.append(Summary("(other keys)", sum(w.suppressed for _, w in rest),
                               max(now - w.started for _, w in rest), len(rest)))
        return out + self._take_spill(now)

    def _take_spill(self, now: float, force: bool = False) -> list[Summary]:
        """The merged summary of evicted keys, once its interval is over (or on flush)."""
        spill = self._spill
        if spill is None or not (force or now - spill.started >= self.interval):
            return []
        self._spill, keys, self._spilled_keys = None, self._spilled_keys, 0
        return [Summary("(keys evicted for room)", spill.suppressed, now - spill.started, keys)]


def describe(key: Hashable) -> str:
    """A key as a log line names it."""
    return " ".join(map(str, key)) if isinstance(key, tuple) else str(key)


class ThrottledLog:
    """A logger's ``warning`` behind a Throttle: the caller names the key, the summaries are written for it.

    Lines never carry a traceback: the input was the peer's fault, and the reason says what was wrong.
    """

    def __init__(self, logger: logging.Logger, throttle: Throttle | None = None) -> None:
        self.logger = logger
        self.throttle = throttle if throttle is not None else Throttle()

    def warning(self, key: Hashable, fmt: str, *args: object) -> bool:
        """Log ``fmt % args`` unless ``key`` is over its share; True if it was logged."""
        ok, due = self.throttle.hit(key)
        self.write(due)
        if ok:
            self.logger.warning(fmt, *args)
        return ok

    def write(self, summaries: list[Summary]) -> None:
        for s in summaries:
            scope = f" ({s.keys} keys)" if s.keys > 1 else ""
            self.logger.warning("%d more %s%s not logged in the last %.0f s", s.suppressed, describe(s.key),
                                scope, s.seconds)

    def flush(self) -> None:
        """Write every summary owed (on close)."""
        self.write(self.throttle.flush())


class ThrottledEvents:
    """A JSON event log's warnings about one device behind a Throttle (key: event and device), each
    summary written as one ``log_suppressed`` line: a flood of refusals stays a few lines."""

    def __init__(self, log: Any, throttle: Throttle | None = None) -> None:
        self.log = log  # anything with ``warning(event, **fields)`` (fedsga_edge.runfiles.JsonLog)
        self.throttle = throttle if throttle is not None else Throttle()

    def warn(self, event: str, device: str, **fields: Any) -> None:
        ok, due = self.throttle.hit((event, device))
        self.write(due)
        if ok:
            self.log.warning(event, device=device, **fields)

    def write(self, due: list[Summary]) -> None:
        for s in due:
            event, device = s.key if isinstance(s.key, tuple) else (str(s.key), "*")
            self.log.warning("log_suppressed", of=event, device=device, count=s.suppressed,
                             seconds=round(s.seconds, 1), keys=s.keys)

    def flush(self) -> None:
        """Write every summary owed (at the end of a run)."""
        self.write(self.throttle.flush())
