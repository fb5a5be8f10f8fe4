"""Loopback transport and Peer: nested calls, exact byte counts, idempotency, garbage handling."""

from __future__ import annotations

import numpy as np
import pytest

from fedsga_edge.transport import LoopbackTransport, Peer, Transport, TransportError
from fedsga_edge.wire import LocalProtocolError, Message, RemoteProtocolError, decode, encode

RUN = "run-1"


class Tap:
    """Wrap a bytes handler and record every payload in and reply out."""

    def __init__(self, handler):
        self.handler = handler
        self.seen_in: list[bytes] = []
        self.seen_out: list[bytes] = []

    def __call__(self, data: bytes) -> bytes | None:
        self.seen_in.append(data)
        out = self.handler(data)
        if out is not None:
            self.seen_out.append(out)
        return out


def split_pair(tensor_format: str = "raw"):
    """A coordinator that answers activations with gradients, and a client whose
    round_start handler calls the coordinator once per batch (nested requests)."""
    t = LoopbackTransport()
    coord = Peer(t, "coordinator", RUN, tensor_format)
    client = Peer(t, "client-1", RUN, tensor_format)

    def on_coord(msg: Message) -> Message | None:
        assert msg.kind == "activation"
        z = msg.body["z"]
        return coord.reply(msg, "gradient", {"dz": (2 * z).astype(np.float32), "loss": float(z.sum())})

    def on_client(msg: Message) -> Message | None:
        losses = []
        for b in range(msg.body["batches"]):
            z = np.full((4, 3), b, np.float32)
            rep = client.call("coordinator", "activation", msg.round, {"z": z, "y": np.arange(4), "split": 1})
            assert rep.kind == "gradient"
            np.testing.assert_array_equal(rep.body["dz"], 2 * z)
            losses.append(rep.body["loss"])
        return client.reply(msg, "ack", {"losses": losses})

    coord_tap, client_tap = Tap(coord.serve(on_coord)), Tap(client.serve(on_client))
    t.register("coordinator", coord_tap)
    t.register("client-1", client_tap)
    return t, coord, client, coord_tap, client_tap


def test_nested_requests_over_loopback():
    t, coord, client, coord_tap, _ = split_pair()
    rep = coord.call("client-1", "round_start", 5, {"batches": 3})
    assert (rep.kind, rep.round, rep.sender, rep.run) == ("ack", 5, "client-1", RUN)
    assert rep.body["losses"] == [0.0, 12.0, 24.0]
    assert len(coord_tap.seen_in) == 3 and coord.errors == client.errors == 0
    assert isinstance(t, Transport)


@pytest.mark.parametrize("fmt", ["raw", "fp16", "int8"])
def test_byte_counts_equal_the_sum_of_encoded_lengths(fmt):
    t, coord, _, coord_tap, client_tap = split_pair(fmt)
    coord.call("client-1", "round_start", 0, {"batches": 4})
    s = t.stats
    assert s.bytes_sent(src="client-1", dst="coordinator") == sum(map(len, coord_tap.seen_in)) + sum(
        map(len, client_tap.seen_out)
    )
    assert s.bytes_sent(src="coordinator", dst="client-1") == sum(map(len, client_tap.seen_in)) + sum(
        map(len, coord_tap.seen_out)
    )
    assert s.bytes_sent() == s.bytes_sent(src="client-1") + s.bytes_sent(src="coordinator")
    assert s.messages_sent(src="client-1", dst="coordinator") == 4 + 1  # 4 activations + the ack
    assert s.messages_sent(dst="client-1") == 1 + 4  # round_start + 4 gradients
    # And each counted payload is exactly what encode() makes of the message it carries.
    for data in coord_tap.seen_in + coord_tap.seen_out + client_tap.seen_in + client_tap.seen_out:
        assert len(encode(decode(data), tensor_format=fmt)) == len(data)
    s.reset()
    assert s.bytes_sent() == 0 and s.messages_sent() == 0


def test_raw_transport_counts_exact_lengths():
    t = LoopbackTransport()
    t.register("b", lambda data: data * 2)
    assert t.request("a", "b", b"xyz") == b"xyzxyz"
    t.send("a", "b", bytearray(b"12345"))  # reply of a send is dropped and not counted
    assert t.stats.bytes[("a", "b")] == 8 and t.stats.bytes[("b", "a")] == 6
    assert t.stats.messages[("a", "b")] == 2 and t.stats.messages[("b", "a")] == 1


def test_duplicate_seq_gets_the_cached_reply_without_rerunning_the_handler():
    t = LoopbackTransport()
    server, sender = Peer(t, "coordinator", RUN), Peer(t, "client-1", RUN)
    runs: list[int] = []

    def handler(msg: Message) -> Message:
        runs.append(msg.seq)
        return server.reply(msg, "ack", {"n": len(runs)})

    server.register(handler)
    payload = encode(sender.message("hello", 0))
    first = t.request("client-1", "coordinator", payload)
    again = t.request("client-1", "coordinator", payload)  # QoS 1 redelivery
    assert first == again and runs == [1] and server.duplicates == 1
    # Same (sender, seq) but different bytes is not a redelivery (e.g. sender restarted).
    restarted = encode(Message("hello", RUN, 0, 1, "client-1", {"boot": 2}))
    assert decode(t.request("client-1", "coordinator", restarted)).body == {"n": 2}
    assert runs == [1, 1]


def test_reply_cache_is_bounded():
    t = LoopbackTransport()
    server, sender = Peer(t, "coordinator", RUN, cache_size=2), Peer(t, "client-1", RUN)
    runs: list[int] = []
    server.register(lambda m: (runs.append(m.seq), server.reply(m, "ack"))[1])
    payloads = [encode(sender.message("hello", 0)) for _ in range(3)]
    for p in payloads:
        t.request("client-1", "coordinator", p)
    t.request("client-1", "coordinator", payloads[2])  # still cached
    t.request("client-1", "coordinator", payloads[0])  # evicted: handled again
    assert runs == [1, 2, 3, 1]


def test_garbage_gets_an_error_reply_and_the_handler_keeps_serving():
    t = LoopbackTransport()
    server, sender = Peer(t, "coordinator", RUN), Peer(t, "client-1", RUN)
    server.register(lambda m: server.reply(m, "ack", {"echo": m.body.get("x")}))
    for junk in (b"", b"\xff\x00garbage", encode(Message("hello", "other-run", 0, 1, "client-1", {}))):
        rep = decode(t.request("client-1", "coordinator", junk))
        assert rep.kind == "error" and rep.sender == "coordinator" and rep.body["reason"]
    assert server.errors == 3
    assert sender.call("coordinator", "hello", 0, {"x": 7}).body == {"echo": 7}


def test_handler_remote_error_becomes_error_reply_other_errors_propagate():
    t = LoopbackTransport()
    server, sender = Peer(t, "coordinator", RUN), Peer(t, "client-1", RUN)

    def handler(msg: Message) -> Message:
        if msg.kind == "bye":
            raise RemoteProtocolError("bye for a round that is over")
        raise ValueError("a bug of ours")

    server.register(handler)
    rep = sender.call("coordinator", "bye", 3)
    assert (rep.kind, rep.round) == ("error", 3) and "round that is over" in rep.body["reason"]
    assert server.errors == 1
    with pytest.raises(ValueError, match="a bug of ours"):
        sender.call("coordinator", "hello", 3)


def test_garbage_reply_raises_remote_error_at_the_caller():
    t = LoopbackTransport()
    sender = Peer(t, "client-1", RUN)
    t.register("coordinator", lambda data: b"\x00junk")
    with pytest.raises(RemoteProtocolError):
        sender.call("coordinator", "hello", 0)
    assert sender.errors == 1


def test_handler_returning_non_message_is_a_local_error():
    t = LoopbackTransport()
    server, sender = Peer(t, "coordinator", RUN), Peer(t, "client-1", RUN)
    server.register(lambda m: {"kind": "ack"})  # type: ignore[arg-type,return-value]
    with pytest.raises(LocalProtocolError):
        sender.call("coordinator", "hello", 0)


def test_one_way_send_runs_the_handler():
    t = LoopbackTransport()
    server, sender = Peer(t, "coordinator", RUN), Peer(t, "client-1", RUN)
    got: list[Message] = []
    server.register(lambda m: (got.append(m), None)[1])
    sender.send("coordinator", "bye", 9, {"why": "done"})
    assert [(m.kind, m.round, m.body) for m in got] == [("bye", 9, {"why": "done"})]


def test_transport_errors():
    t = LoopbackTransport()
    t.register("silent", lambda data: None)
    with pytest.raises(TransportError, match="no handler registered at 'nobody'"):
        t.request("a", "nobody", b"x")
    with pytest.raises(TransportError, match="no reply"):
        t.request("a", "silent", b"x")
    with pytest.raises(TransportError, match="already registered"):
        t.register("silent", lambda data: None)
    with pytest.raises(TransportError, match="bad address"):
        t.register("a/b", lambda data: None)
    with pytest.raises(TransportError, match="bad address"):
        t.request("#", "silent", b"x")
    t.unregister("silent")
    with pytest.raises(TransportError):
        t.send("a", "silent", b"x")
    t.close()
    with pytest.raises(TransportError, match="closed"):
        t.register("late", lambda data: None)
    with pytest.raises(TransportError, match="closed"):
        t.send("a", "late", b"x")


def test_peer_numbers_its_messages():
    t = LoopbackTransport()
    p = Peer(t, "client-1", RUN, seq_start=10)
    assert [p.message("hello", 0).seq for _ in range(3)] == [10, 11, 12]
    with pytest.raises(LocalProtocolError):
        Peer(t, "client-1", RUN, tensor_format="bf16")


# -- a request left open (its reply not emitted yet: MergeSFL's merged step) ----------------------------------

def test_an_open_request_returns_a_pending_reply_that_answer_fills_once():
    """The handler's list of messages holds no reply to the request: the loopback request returns at once
    with a pending reply, which the server's ``answer`` fills (its bytes counted as any reply's); a repeat of
    the open request is not handled again meanwhile; once answered, the same bytes are handled afresh (the
    role's own guard)."""
    from fedsga_edge.transport import OpenRequest, PendingMessage, PendingReply

    t = LoopbackTransport()
    server, dev = Peer(t, "coordinator", RUN), Peer(t, "client-1", RUN)
    runs: list[int] = []

    def handler(msg: Message) -> list[tuple[str, Message]]:
        runs.append(msg.seq)
        return []  # nothing to send yet

    server.register(handler)
    pending = dev.call("coordinator", "activation", 1, {"z": np.ones((2, 3), np.float32), "y": np.arange(2),
                                                        "split": 1})
    assert isinstance(pending, PendingMessage) and not pending.ready and runs == [1]
    up = t.stats.bytes_sent(src="client-1", dst="coordinator")
    assert t.stats.bytes_sent(src="coordinator") == 0  # nothing answered yet
    replay = encode(Message("activation", RUN, 1, 1, "client-1", {"z": np.ones((2, 3), np.float32),
                                                                   "y": np.arange(2), "split": 1}))
    with pytest.raises(TransportError, match="no reply"):  # the held request's repeat: not handled twice
        t.request("client-1", "coordinator", replay)
    assert runs == [1] and server.duplicates == 1
    reply = Message("gradient", RUN, 1, 1, "coordinator", {"dz": np.full((2, 3), 2, np.float32), "loss": 0.5})
    server.answer("client-1", reply)
    assert pending.ready
    got = pending.result()
    assert got.kind == "gradient" and got.seq == 1 and got.body["loss"] == 0.5
    assert t.stats.bytes_sent(src="coordinator", dst="client-1") == len(encode(reply))
    assert t.stats.bytes_sent(src="client-1", dst="coordinator") == 2 * up
    assert isinstance(t.request("client-1", "coordinator", replay), PendingReply) and runs == [1, 1]
    # a reply that comes before its request's handler returned (another thread released it) is kept
    t.reply("coordinator", OpenRequest("client-1", 7), encode(reply))
    early = t.request("client-1", "coordinator", encode(Message("activation", RUN, 1, 7, "client-1", {
        "z": np.ones((2, 3), np.float32), "y": np.arange(2), "split": 1})))
    assert isinstance(early, PendingReply) and early.ready and decode(early.wait()).kind == "gradient"
