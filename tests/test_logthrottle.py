"""Log lines about hostile input are rate-limited: counted and summarised, not one line per bad frame."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from fedsga_edge.logthrottle import Throttle, ThrottledLog
from fedsga_edge.transport import LoopbackTransport, Peer
from fedsga_edge.transport.mqtt.health import Health
from fedsga_edge.transport.mqtt.inbound import Inbound
from fedsga_edge.transport.mqtt.topics import Topics
from fedsga_edge.wire import Message, encode


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def inbound(clock: Clock) -> tuple[Inbound, Health]:
    health = Health()
    ib = Inbound(Topics("r", "coordinator"), None, health, "coordinator",  # type: ignore[arg-type]
                 max_buffer_bytes=1 << 20, reassembly_timeout=60.0,
                 answer=lambda *a: None, dispatch=lambda *a: None)
    ib.noise = ThrottledLog(logging.getLogger("fedsga_edge.transport.mqtt.inbound"), Throttle(clock=clock))
    return ib, health


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records]


def test_a_thousand_garbage_frames_make_a_few_lines_and_one_summary(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    ib, health = inbound(clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(1000):
            ib.receive("fedsga/r/up/client-1", b"\x00garbage", False)
            clock.t += 0.01  # 10 s of flood
        assert health.counters["garbage"] == 1000  # every frame is still counted
        during = lines(caplog)
        clock.t += 60
        ib.receive("fedsga/r/up/client-1", b"\x00garbage", False)  # the next one after the interval
    out = lines(caplog)
    assert len(during) == 10 and all("dropped garbage" in s for s in during)
    summary = [s for s in out if "not logged" in s]
    assert summary == ["990 more garbage frames on fedsga/r/up/client-1 not logged in the last 70 s"], out
    assert len(out) == 12  # the new interval's first line is written again
    assert not any(r.exc_info for r in caplog.records)  # no tracebacks for a peer's garbage
    assert sum(len(s) for s in out) < 2000


def test_flush_writes_what_is_owed(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    ib, _ = inbound(clock)
    with caplog.at_level(logging.WARNING):
        for _ in range(25):
            ib.receive("fedsga/r/up/client-1", b"junk", False)
        ib.noise.flush()
    assert lines(caplog)[-1] == "15 more garbage frames on fedsga/r/up/client-1 not logged in the last 0 s"


def test_invented_senders_cannot_multiply_the_lines() -> None:
    """A flood from a thousand made-up topics: at most max_lines lines an interval, and the summaries
    beyond max_lines are merged into one."""
    clock = Clock()
    th = Throttle(first=2, interval=60, max_keys=64, max_lines=20, clock=clock)
    logged, summaries = 0, []
    for i in range(1000):
        ok, due = th.hit(("garbage", f"up/x{i % 500}"))
        logged += ok
        summaries += due
    clock.t += 61
    summaries += th.hit(("garbage", "up/late"))[1]
    summaries += th.flush()
    assert logged == 20
    assert len(summaries) <= 21 + 64
    assert sum(s.suppressed for s in summaries) == 1000 - 20


def test_per_key_and_per_interval() -> None:
    clock = Clock()
    th = Throttle(first=3, interval=10, clock=clock)
    assert [th.hit("a")[0] for _ in range(5)] == [True] * 3 + [False] * 2
    assert th.hit("b")[0]  # another key has its own share
    clock.t += 10
    ok, due = th.hit("a")
    assert ok and [(s.key, s.suppressed) for s in due] == [("a", 2)]


def test_peer_rejections_are_throttled_with_a_summary(caplog: pytest.LogCaptureFixture) -> None:
    """1000 undecodable messages from one device: its first 10 reach the log and on_reject, then one
    summary line with the count."""
    clock = Clock()
    heard: list[tuple[str, str, str]] = []
    peer = Peer(LoopbackTransport(), "coordinator", "r", on_reject=lambda *a: heard.append(a))
    peer.log_throttle = Throttle(clock=clock)
    serve = peer.serve(lambda m: None, sender_of=lambda: "client-1")
    with caplog.at_level(logging.WARNING, logger="fedsga_edge.transport.peer"):
        for _ in range(1000):
            assert serve(b"\x00\x01") is not None  # each still gets its error reply
        clock.t += 61
        serve(b"\x00\x01")
    assert peer.errors == 1001 and peer.rejections["client-1"] == 1001
    assert len(heard) == 12 and heard[10][1] == "*" and heard[10][2].startswith("990 more rejections")
    assert len(caplog.records) == 12 and not any(r.exc_info for r in caplog.records)


def test_a_bad_scale_is_one_short_line_not_a_traceback(caplog: pytest.LogCaptureFixture) -> None:
    """Before: an int scale raised OverflowError inside the handler thread (a 1.1 KB traceback)."""
    peer = Peer(LoopbackTransport(), "coordinator", "r")
    serve = peer.serve(lambda m: None, sender_of=lambda: "client-1")
    good = encode(Message("activation", "r", 1, 1, "client-1", {"z": _z(), "y": _y(), "split": 1}), tensor_format="int8")
    bad = good.replace(b"\xa5scale\xcb", b"\xa5scale\xd3")  # the float64 scale's 8 bytes read as an int64
    assert bad != good
    with caplog.at_level(logging.WARNING):
        reply = serve(bad)
    assert reply is not None and b"int8 scale" in reply
    assert len(caplog.records) == 1 and not caplog.records[0].exc_info and len(caplog.records[0].getMessage()) < 400


def _z() -> np.ndarray:
    return np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)


def _y() -> np.ndarray:
    return np.array([0, 1, 2])


def test_throttle_arguments_are_checked() -> None:
    for bad in ({"first": -1}, {"interval": 0}, {"max_keys": 0}, {"max_lines": 0}):
        with pytest.raises(ValueError):
            Throttle(**bad)


def test_peer_flush_log_writes_the_owed_summary_at_the_end_of_a_run() -> None:
    heard: list[tuple[str, str, str]] = []
    peer = Peer(LoopbackTransport(), "coordinator", "r", on_reject=lambda *a: heard.append(a))
    serve = peer.serve(lambda m: None, sender_of=lambda: "client-1")
    other_run = encode(Message("activation", "other", 1, 1, "client-1", {"z": _z(), "y": _y(), "split": 1}))
    for _ in range(25):
        serve(other_run)
    peer.flush_log()
    assert len(heard) == 11 and heard[0][1] == "activation"  # the envelope's kind names the refusal
    assert heard[-1][:2] == ("client-1", "*") and heard[-1][2].startswith("15 more rejections")
