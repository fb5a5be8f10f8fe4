"""Check before decode: a message's envelope and every tensor's declared size are checked before any
array is built, and what decoding allocates is bounded by the bytes that came."""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsga_edge.transport import LoopbackTransport, Peer
from fedsga_edge.wire import MAX_EXPANSION, Envelope, Message, RemoteProtocolError, codec, decode, encode

MiB = 1 << 20


def pack(body: dict[str, Any], *, kind: str = "activation", run: str = "r", sender: str = "client-1",
         rnd: int = 1, body_first: bool = False) -> bytes:
    env: dict[str, Any] = {"v": 1, "kind": kind, "run": run, "round": rnd, "seq": 1, "sender": sender}
    env = {"body": body, **env} if body_first else {**env, "body": body}
    return msgpack.packb(env, use_bin_type=True)


def int8_tensor(n: int, dtype: str, scale: Any = 0.01, shape: list[int] | None = None) -> dict[str, Any]:
    return {"__t": 1, "dtype": dtype, "shape": shape or [n], "data": b"\x01" * n, "enc": "int8", "scale": scale}


def labels() -> dict[str, Any]:
    return {"__t": 1, "dtype": "int64", "shape": [2], "data": np.array([0, 1], "<i8").tobytes()}


def peak_of(fn: Callable[[], Any]) -> tuple[int, Any]:
    """tracemalloc's peak while ``fn`` runs (numpy registers its buffers with it), and what it returned
    or raised."""
    tracemalloc.start()
    try:
        try:
            out: Any = fn()
        except Exception as e:  # noqa: BLE001 - returned for the test to judge
            out = e
        return tracemalloc.get_traced_memory()[1], out
    finally:
        tracemalloc.stop()


# ------------------------------------------------------------------ declared dtype against the bytes


def test_int8_bytes_declared_float64_are_refused_before_allocation() -> None:
    """The attack at 16 MiB: the whole message as int8 that claims float64 (8x). Before the fix it
    decoded into 128 MiB of float64; now it is refused, and decode held about one copy of the message."""
    n = 16 * MiB
    data = pack({"z": int8_tensor(n, "float64"), "y": labels(), "split": 1})
    peak, out = peak_of(lambda: decode(data))
    assert isinstance(out, RemoteProtocolError), out
    assert "body['z']" in str(out) and "decodes to" in str(out)
    assert peak < 1.5 * len(data), f"peak {peak / MiB:.1f} MiB for a {len(data) / MiB:.1f} MiB message"


def test_honest_int8_float32_decodes_within_the_stated_bound() -> None:
    """What the bound allows: int8 into float32 (4x) plus msgpack's copy of the bytes."""
    n = 8 * MiB
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    data = encode(Message("activation", "r", 1, 1, "client-1", {"z": x, "y": np.array([0, 1]), "split": 1}),
                  tensor_format="int8")
    peak, out = peak_of(lambda: decode(data))
    assert isinstance(out, Message) and out.body["z"].dtype == np.float32
    assert peak < (1 + MAX_EXPANSION) * len(data) + 2 * MiB


def test_the_budget_is_per_message_not_per_tensor() -> None:
    """Many int8 float64 tensors, each small, together 8x the message: refused at the one that passes it."""
    body = {f"t{i}": int8_tensor(64 * 1024, "float64") for i in range(40)}  # 2.5 MiB of int8 -> 20 MiB
    data = pack(body, kind="hello")
    peak, out = peak_of(lambda: decode(data))
    assert isinstance(out, RemoteProtocolError) and "body['t" in str(out) and "decodes to" in str(out)
    # what it held until then: msgpack's copy of the bytes plus the arrays the budget allowed
    assert peak < (1 + MAX_EXPANSION) * len(data) + codec.EXPANSION_ALLOWANCE + 256 * 1024


def test_small_float64_int8_tensors_still_decode() -> None:
    """Within the allowance (1 MiB) int8 float64 tensors decode as before (the codec's own round trip)."""
    x = np.linspace(-1, 1, 10_000)
    out = decode(encode(Message("hello", "r", 0, 0, "c", {"x": x}), tensor_format="int8")).body["x"]
    assert out.dtype == np.float64 and np.abs(out - x).max() <= 1 / 254 * 1.0001


@pytest.mark.parametrize("enc, dtype, itemsize", [("raw", "float64", 8), ("raw", "int32", 4), ("fp16", "float32", 2),
                                                   ("int8", "float32", 1)])
def test_declared_shape_must_match_the_bytes(enc: str, dtype: str, itemsize: int) -> None:
    t: dict[str, Any] = {"__t": 1, "dtype": dtype, "shape": [1000, 1000], "data": b"\0" * (1000 * itemsize)}
    if enc != "raw":
        t["enc"] = enc
    if enc == "int8":
        t["scale"] = 0.5
    peak, out = peak_of(lambda: decode(pack({"x": t}, kind="hello")))
    assert isinstance(out, RemoteProtocolError) and "body['x']" in str(out) and "needs" in str(out)
    assert peak < MiB


# ------------------------------------------------------------------ the int8 scale


@pytest.mark.parametrize("scale", [128, 127, 1, 2**63, True, float("nan"), float("inf"), -float("inf"), -1.0,
                                   -1e-300, "1.0", None])
def test_int8_scale_must_be_a_finite_float(scale: Any) -> None:
    """An int scale overflowed (>= 128: OverflowError out of decode) or wrapped (127) in int8 arithmetic."""
    with pytest.raises(RemoteProtocolError, match=r"body\['z'\]: int8 scale"):
        decode(pack({"z": int8_tensor(4, "float32", scale), "y": labels(), "split": 1}))


def test_int8_scale_zero_is_the_encoders_all_zero_tensor() -> None:
    out = decode(pack({"z": int8_tensor(4, "float32", 0.0), "y": labels(), "split": 1})).body["z"]
    assert out.dtype == np.float32 and not out.any()


@pytest.mark.parametrize("dtype, scale", [("float16", 0.01), ("float32", 1e-40), ("float32", 0.37), ("float64", 3e-300)])
def test_dequantize_matches_a_whole_array_multiply(dtype: str, scale: float) -> None:
    """The blockwise int8 decode gives bit for bit what the one-shot multiply gave (honest traffic unchanged)."""
    q = np.random.default_rng(1).integers(-127, 128, size=codec._BLOCK * 2 + 17, dtype=np.int8)
    whole = np.empty(q.shape, dtype=codec._int8_math(dtype, scale))
    np.multiply(q, scale, out=whole)
    want = whole.astype(dtype, copy=False)
    got = codec._dequantize(q, scale, dtype)
    assert got.dtype == want.dtype and got.tobytes() == want.tobytes()


# ------------------------------------------------------------------ the envelope before the body


def serve_one(data: bytes, *, seen: str = "client-1", admit: Callable[[Envelope], None] | None = None
              ) -> tuple[int, Message, list[Message]]:
    """Hand ``data`` to a coordinator Peer as if it arrived on ``seen``'s topic: (peak, reply, handled)."""
    peer = Peer(LoopbackTransport(), "coordinator", "r", admit=admit)
    handled: list[Message] = []

    def handler(msg: Message) -> Message:
        handled.append(msg)
        return peer.reply(msg, "ack")

    on_bytes = peer.serve(handler, sender_of=lambda: seen)
    peak, raw = peak_of(lambda: on_bytes(data))
    assert isinstance(raw, bytes), raw
    return peak, decode(raw), handled


@pytest.mark.parametrize("over, reason", [({"run": "other-run"}, "run 'other-run'"),
                                          ({"sender": "client-2"}, "claims sender 'client-2'"),
                                          ({"rnd": 7}, "round 7 is not running")])
@pytest.mark.parametrize("body_first", [False, True])
def test_an_envelope_refused_builds_nothing_of_the_body(over: dict[str, Any], reason: str, body_first: bool) -> None:
    """Another run, another sender or (through the role's admit hook) another round: refused on the envelope,
    before msgpack copies the body's 16 MiB or any tensor is built."""
    def only_round_1(env: Envelope) -> None:
        if env.round != 1:
            raise RemoteProtocolError(f"{env.kind!r}: round {env.round} is not running")

    data = pack({"z": int8_tensor(16 * MiB, "float32"), "y": labels(), "split": 1}, body_first=body_first, **over)
    peak, reply, handled = serve_one(data, admit=only_round_1)
    assert reply.kind == "error" and reason in reply.body["reason"] and not handled
    assert peak < MiB, f"{peak / MiB:.1f} MiB held to refuse an envelope"


def test_an_admitted_message_is_decoded_and_handled() -> None:
    seen: list[Envelope] = []
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    data = encode(Message("activation", "r", 1, 5, "client-1", {"z": x, "y": np.array([0, 1]), "split": 1}))
    _, reply, handled = serve_one(data, admit=seen.append)
    assert reply.kind == "ack" and len(handled) == 1 and np.array_equal(handled[0].body["z"], x)
    assert seen == [Envelope(kind="activation", run="r", round=1, seq=5, sender="client-1")]


def test_body_anywhere_in_the_map_decodes_the_same() -> None:
    """Key order is the sender's business: a body before the envelope fields is skipped, then decoded."""
    body = {"z": {"__t": 1, "dtype": "float32", "shape": [2], "data": b"\0" * 8}, "y": labels(), "split": 1,
            "o": [[1, 2], {"a": [3]}]}
    a, b = decode(pack(body)), decode(pack(body, body_first=True))
    assert (a.kind, a.run, a.round, a.seq, a.sender) == (b.kind, b.run, b.round, b.seq, b.sender)
    assert a.body["o"] == b.body["o"] and a.body["z"].tobytes() == b.body["z"].tobytes()


@pytest.mark.parametrize("data, match", [
    (msgpack.packb({"v": 1, "kind": "hello", "run": "r" * 100_000, "round": 0, "seq": 0, "sender": "c", "body": {}}),
     "run must be a str"),
    (msgpack.packb({"v": 1, "kind": ["x"] * 10, "run": "r", "round": 0, "seq": 0, "sender": "c", "body": {}}),
     "kind"),
    (msgpack.packb({"body": {}, "v": 1, "kind": "hello", "run": "r", "round": 0, "seq": 0, "sender": "c"})[:-1],
     "truncated"),
    (b"\x87\xa4body" + b"\x91" * 300_000 + b"\xc0", "elements"),
    (b"\x82\xa1v\x01\xa1v\x01", "twice"),
    (b"\xdf\xff\xff\xff\xff", "keys"),
])
def test_envelopes_that_lie_are_refused_by_name(data: bytes, match: str) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        decode(data)


def test_a_claimed_terabyte_in_an_envelope_string_costs_nothing() -> None:
    """A str32 header claiming 4 GiB for the run: refused as truncated, nothing allocated for it."""
    data = b"\x87\xa3run\xdb\xff\xff\xff\xff" + b"r" * 100
    peak, out = peak_of(lambda: decode(data))
    assert isinstance(out, RemoteProtocolError) and "truncated" in str(out)
    assert peak < 64 * 1024


def test_the_stated_bound_is_what_the_docs_say() -> None:
    """docs/protocol.md states the decode bound with these numbers."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    assert f"{MAX_EXPANSION} x its size" in doc and math.isclose(codec.EXPANSION_ALLOWANCE, MiB)


# ------------------------------------------------------------------ the envelope reader agrees with msgpack

ENVELOPE = {"v": 1, "kind": "activation", "run": "r", "round": 3, "seq": 9, "sender": "client-1",
            "body": {"z": {"__t": 1, "dtype": "float32", "shape": [2], "data": b"\0" * 8}, "y": {"__t": 1,
                     "dtype": "int64", "shape": [1], "data": b"\0" * 8}, "split": 1, "o": [1.5, [None, "x"]]}}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(order=st.permutations(list(ENVELOPE)), cut=st.integers(0, 400), flip=st.integers(0, 400),
       byte=st.integers(0, 255))
def test_the_envelope_reader_agrees_with_msgpack_on_any_key_order_and_damage(order, cut, flip, byte) -> None:
    """Whatever the key order, truncation or flipped byte: decode accepts exactly what msgpack reads as a whole
    (and then with msgpack's values), and refuses everything else with RemoteProtocolError."""
    data = bytearray(msgpack.packb({k: ENVELOPE[k] for k in order}, use_bin_type=True))
    if flip < len(data):
        data[flip] = byte
    data = bytes(data[: max(cut, 1)]) if cut < len(data) else bytes(data)
    try:
        msg = decode(data)
    except RemoteProtocolError:
        return
    ref = msgpack.unpackb(data, raw=False, strict_map_key=True, max_ext_len=0)  # raises if decode should have
    assert (msg.kind, msg.run, msg.round, msg.seq, msg.sender) == tuple(
        ref[k] for k in ("kind", "run", "round", "seq", "sender"))
    assert msg.body.keys() == ref["body"].keys()
