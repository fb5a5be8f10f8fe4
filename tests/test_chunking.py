"""Chunking: size limits, any order with QoS 1 duplicates, memory cap, timeout, corruption."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedsga_edge.wire import (
    BROKER_PACKET_LIMITS,
    LocalProtocolError,
    Reassembler,
    RemoteProtocolError,
    max_chunk_for,
    split_message,
)

FAST = settings(max_examples=80, deadline=None)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def chunk_fields(chunk: bytes) -> dict:
    return msgpack.unpackb(chunk, raw=False)


def repack(chunk: bytes, **over) -> bytes:
    d = chunk_fields(chunk)
    d.update(over)
    return msgpack.packb(d, use_bin_type=True)


@FAST
@given(
    st.binary(max_size=3000),
    st.integers(220, 700),  # header ~50 bytes + id (40 chars, up to 160 bytes of UTF-8)
    st.text(min_size=1, max_size=40),
)
def test_every_chunk_fits_and_the_message_comes_back(data, max_chunk, msg_id):
    chunks = split_message(data, max_chunk=max_chunk, msg_id=msg_id)
    assert chunks and all(len(c) <= max_chunk for c in chunks)
    r = Reassembler(max_bytes=len(data), timeout_s=10)
    outs = [r.feed(c) for c in chunks]
    assert outs[-1] == data and all(o is None for o in outs[:-1])


def test_chunk_count_is_not_wasteful():
    data = bytes(range(256)) * 400  # 100 KiB
    max_chunk = max_chunk_for(BROKER_PACKET_LIMITS["aws_iot"] // 4)
    chunks = split_message(data, max_chunk=max_chunk, msg_id="m")
    assert len(chunks) == -(-len(data) // (max_chunk - 64))  # header overhead stays under 64 bytes


@FAST
@given(st.data())
def test_random_order_with_duplicates(draw):
    data = draw.draw(st.binary(min_size=0, max_size=2000))
    chunks = split_message(data, max_chunk=draw.draw(st.integers(64, 300)), msg_id="msg-1")
    extra = draw.draw(st.lists(st.sampled_from(chunks), max_size=len(chunks) + 2))
    stream = draw.draw(st.permutations(chunks + extra))
    r = Reassembler(max_bytes=4096, timeout_s=10)
    outs = [r.feed(c) for c in stream]
    done = [o for o in outs if o is not None]
    assert done == [data]  # exactly once, however often chunks repeat
    assert r.stats["completed"] == 1 and r.stats["duplicates"] == len(extra)
    assert r.in_flight_bytes == 0 and r.pending == []


def test_two_messages_interleaved():
    a, b = b"a" * 500, b"b" * 700
    ca = split_message(a, max_chunk=100, msg_id="a")
    cb = split_message(b, max_chunk=100, msg_id="b")
    r = Reassembler(max_bytes=2000, timeout_s=10)
    outs = [r.feed(c) for pair in zip(cb, ca, strict=False) for c in pair] + [r.feed(c) for c in cb[len(ca) :]]
    assert sorted(o for o in outs if o) == [a, b]


def test_declared_total_over_cap_is_rejected_and_later_parts_dropped():
    chunks = split_message(b"x" * 1000, max_chunk=200, msg_id="big")
    r = Reassembler(max_bytes=999, timeout_s=10)
    with pytest.raises(RemoteProtocolError, match="cap"):
        r.feed(chunks[0])
    assert all(r.feed(c) is None for c in chunks[1:])  # one error per message, not per chunk
    assert r.stats["rejected"] == 1 and r.stats["dropped"] == len(chunks) - 1
    assert r.in_flight_bytes == 0


def test_in_flight_cap_counts_bytes_held_and_the_older_message_gives_way():
    first = split_message(b"1" * 600, max_chunk=200, msg_id="first")
    second = split_message(b"2" * 600, max_chunk=200, msg_id="second")
    r = Reassembler(max_bytes=1000, timeout_s=10)
    assert all(r.feed(c) is None for c in first[:-1])
    held = r.in_flight_bytes
    assert 0 < held < 600  # what arrived, not the 600 declared
    assert [r.feed(c) for c in second][-1] == b"2" * 600  # the stale half-sent one was evicted for it
    with pytest.raises(RemoteProtocolError, match="evicted"):
        r.feed(first[-1])  # its sender hears why, once
    assert r.feed(first[0]) is None and r.in_flight_bytes == 0
    assert r.stats == {**r.stats, "evicted": 1, "completed": 1, "rejected": 0}


def test_timeout_with_fake_clock():
    clock = FakeClock()
    r = Reassembler(max_bytes=10_000, timeout_s=5.0, clock=clock)
    chunks = split_message(b"z" * 900, max_chunk=200, msg_id="slow")
    r.feed(chunks[0])
    clock.t += 5.0
    assert r.expire() == []  # exactly timeout_s old is not yet older than it
    clock.t += 0.01
    assert r.expire() == ["slow"]
    assert r.stats["expired"] == 1 and r.in_flight_bytes == 0 and r.pending == []
    # A late chunk starts over; the message can only complete if everything is resent.
    assert r.feed(chunks[1]) is None and r.pending == ["slow"]


def test_completed_ids_are_remembered_for_the_timeout_then_forgotten():
    clock = FakeClock()
    r = Reassembler(max_bytes=10_000, timeout_s=5.0, clock=clock)
    chunks = split_message(b"q" * 300, max_chunk=200, msg_id="m")
    assert [r.feed(c) for c in chunks][-1] == b"q" * 300
    assert r.feed(chunks[0]) is None and r.stats["duplicates"] == 1 and r.pending == []
    clock.t += 6
    r.expire()
    r.feed(chunks[0])
    assert r.pending == ["m"]


def test_corrupted_part_is_caught_by_the_crc():
    chunks = split_message(b"0123456789" * 50, max_chunk=200, msg_id="c")
    other = split_message(b"other" * 40, max_chunk=200, msg_id="o")
    part = bytearray(chunk_fields(chunks[1])["part"])
    part[3] ^= 0xFF
    chunks[1] = repack(chunks[1], part=bytes(part))
    r = Reassembler(max_bytes=10_000, timeout_s=10)
    r.feed(other[0])
    with pytest.raises(RemoteProtocolError, match="corrupted"):
        for c in chunks:
            r.feed(c)
    assert r.stats["rejected"] == 1 and r.in_flight_bytes == len(chunk_fields(other[0])["part"])
    assert [r.feed(c) for c in other[1:]][-1] == b"other" * 40  # nothing else lost


@pytest.mark.parametrize(
    "over, match",
    [
        ({"n": 99}, "earlier chunks"),
        ({"total": 10_001}, "earlier chunks"),
        ({"crc": 1}, "earlier chunks"),
        ({"i": 7}, "bad index"),
        ({"i": -1}, "bad index"),
        ({"v": 2}, "version"),
        ({"part": "text"}, "part"),
        ({"part": b""}, "part"),
        ({"id": ""}, "id"),
        ({"id": 5}, "id"),
    ],
)
def test_inconsistent_chunks_are_refused_and_nothing_accepted_is_lost(over, match):
    data = bytes(range(200)) * 5
    chunks = split_message(data, max_chunk=300, msg_id="m")
    assert len(chunks) >= 4
    r = Reassembler(max_bytes=20_000, timeout_s=10)
    r.feed(chunks[0])
    with pytest.raises(RemoteProtocolError, match=match):
        r.feed(repack(chunks[1], **over))
    assert r.stats["invalid"] == 1
    assert [r.feed(c) for c in chunks[1:]][-1] == data


def test_conflicting_duplicate_and_overflowing_part():
    chunks = split_message(b"a" * 500, max_chunk=200, msg_id="m")
    r = Reassembler(max_bytes=10_000, timeout_s=10)
    r.feed(chunks[0])
    with pytest.raises(RemoteProtocolError, match="different contents"):
        r.feed(repack(chunks[0], part=b"b" * len(chunk_fields(chunks[0])["part"])))
    with pytest.raises(RemoteProtocolError, match="overflows"):
        r.feed(repack(chunks[1], part=b"a" * 500))
    assert [r.feed(c) for c in chunks[1:]][-1] == b"a" * 500


def test_empty_message_is_one_chunk():
    chunks = split_message(b"", max_chunk=64, msg_id="e")
    assert len(chunks) == 1 and Reassembler(0, 1).feed(chunks[0]) == b""


def test_local_misuse():
    with pytest.raises(LocalProtocolError, match="no room"):
        split_message(b"abc", max_chunk=20, msg_id="m")
    with pytest.raises(LocalProtocolError):
        split_message(b"abc", max_chunk=200, msg_id="")
    with pytest.raises(LocalProtocolError):
        split_message("abc", max_chunk=200, msg_id="m")  # type: ignore[arg-type]
    with pytest.raises(LocalProtocolError):
        Reassembler(max_bytes=10, timeout_s=0)
    with pytest.raises(LocalProtocolError):
        max_chunk_for(1000, headroom=1000)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=120))
def test_fuzz_feed_only_raises_remote_errors(junk):
    r = Reassembler(max_bytes=1000, timeout_s=10)
    good = split_message(b"payload" * 10, max_chunk=64, msg_id="g")
    r.feed(good[0])
    with contextlib.suppress(RemoteProtocolError):
        r.feed(junk)
    assert [r.feed(c) for c in good[1:]][-1] == b"payload" * 10
