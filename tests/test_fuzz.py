"""Hostile input, in process: the codec, chunk reassembly, the Peer's reply cache, the coordinator's
``receive`` and the device's ``handle`` (docs/protocol.md, "What is rejected and how it is counted").

Every property is the same: whatever bytes arrive, the receiver answers with an error (or drops and
counts), never raises anything but ``RemoteProtocolError``, and a refused message changes no state.
Hypothesis draws the inputs with bounded example counts (the whole file runs in well under a minute).
The against-a-running-trial half is ``benchmarks/hostile.py`` (tests/test_hostile.py).
"""

from __future__ import annotations

import itertools
import math
import tracemalloc
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from _coordinator import only_reply
from _runs import tiny_config
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from fedsga_edge.transport import LoopbackTransport, Peer
from fedsga_edge.transport.mqtt import _parse_frame
from fedsga_edge.wire import Message, Reassembler, RemoteProtocolError, decode, encode, split_message
from fedsga_edge.wire.codec import MAX_DEPTH, MAX_ITEMS

RUN = "fuzz"
FUZZ = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                                      HealthCheck.data_too_large])

# -- wire-level builders: bytes exactly as a hostile peer would put them on the wire ----------------------

def tensor(arr: np.ndarray | None = None, **over: Any) -> dict[str, Any]:
    """A tensor map as docs/protocol.md describes it; ``over`` replaces any field (or adds one)."""
    t: dict[str, Any] = {}
    if arr is not None:
        t = {"__t": 1, "dtype": arr.dtype.name, "shape": list(arr.shape), "data": arr.tobytes()}
    t.update(over)
    return t


def pack(kind: str, body: Any, *, round: Any = 1, seq: Any = 1, sender: Any = "client-000", run: Any = RUN,
         **over: Any) -> bytes:
    env = {"v": 1, "kind": kind, "run": run, "round": round, "seq": seq, "sender": sender, "body": body} | over
    return msgpack.packb(env, use_bin_type=True)


def wire_body(body: dict[str, Any]) -> dict[str, Any]:
    return {k: tensor(v) if isinstance(v, np.ndarray) else v for k, v in body.items()}


# Values of every wire type, for "wrong type in this field".
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(),
                      st.text(max_size=8), st.binary(max_size=8), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3),
                      st.dictionaries(st.text(max_size=4), st.integers(-(2**63), 2**63 - 1), max_size=2),
                      st.just({"__t": 1}), st.just({"__t": 1, "dtype": "float32", "shape": [2], "data": b"\0" * 8}))
BAD_DTYPES = st.sampled_from(["object", "complex64", "float128", "<U4", "V8", "O", "int4", "", "float32 ", "bool_"])


# -- codec --------------------------------------------------------------------------------------------------

@settings(FUZZ, max_examples=300)
@given(st.binary(max_size=300))
def test_random_bytes_only_ever_raise_remote_errors(junk: bytes) -> None:
    try:
        decode(junk)
    except RemoteProtocolError:
        pass


VALID = encode(Message("activation", RUN, 3, 7, "client-000", {
    "z": np.linspace(-1, 1, 2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3), "y": np.array([1, 2]), "split": 1,
    "h1": np.ones((2, 4), np.float16), "nested": {"a": [1, 2.5, "x", None, True]}}))


@settings(FUZZ, max_examples=300)
@given(st.data())
def test_mutated_valid_messages_decode_or_raise_remote_errors(data: st.DataObject) -> None:
    raw = bytearray(VALID)
    for _ in range(data.draw(st.integers(1, 6))):
        op = data.draw(st.sampled_from(["flip", "cut", "insert", "dup"]))
        pos = data.draw(st.integers(0, len(raw) - 1))
        if op == "flip":
            raw[pos] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del raw[pos:pos + data.draw(st.integers(1, 40))]
        elif op == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=8))
        else:
            raw += raw[pos:pos + 20]
        if not raw:
            raw = bytearray(b"\xc0")
    try:
        msg = decode(bytes(raw))
    except RemoteProtocolError:
        return
    for v in msg.body.values():  # what decodes is well-typed
        if isinstance(v, np.ndarray):
            assert v.dtype.name in {"float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool"}


@settings(FUZZ, max_examples=200)
@given(field=st.sampled_from(["v", "kind", "run", "round", "seq", "sender", "body"]), value=ANY_VALUE)
def test_a_wrong_type_in_any_envelope_field_is_a_remote_error(field: str, value: Any) -> None:
    good = {"z": tensor(np.zeros((2, 3), np.float32)), "y": tensor(np.array([0, 1])), "split": 1}
    env = {"v": 1, "kind": "activation", "run": RUN, "round": 1, "seq": 1, "sender": "client-000", "body": good}
    env[field] = value
    try:
        msg = decode(msgpack.packb(env, use_bin_type=True))
    except RemoteProtocolError:
        return
    # Accepted: only because the value happens to be a legal one for that field.
    assert isinstance(msg.kind, str) and isinstance(msg.round, int) and isinstance(msg.seq, int) and msg.sender


@settings(FUZZ, max_examples=200)
@given(key=st.sampled_from(["__t", "dtype", "shape", "data", "enc", "scale", "extra"]), value=ANY_VALUE)
def test_a_wrong_type_in_any_tensor_field_is_a_remote_error(key: str, value: Any) -> None:
    t = tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    t[key] = value
    try:
        msg = decode(pack("activation", {"z": t, "y": tensor(np.array([0, 1])), "split": 1}))
    except RemoteProtocolError:
        return
    z = msg.body["z"]
    assert isinstance(z, np.ndarray) and z.nbytes <= 6 * 8  # never more than the data that came


@settings(FUZZ, max_examples=60)
@given(dtype=BAD_DTYPES)
def test_disallowed_dtypes_are_refused(dtype: str) -> None:
    with pytest.raises(RemoteProtocolError, match="allow-list"):
        decode(pack("activation", {"z": tensor(np.zeros(4, np.float32), dtype=dtype), "y": tensor(np.array([0, 1])),
                                   "split": 1}))


@settings(FUZZ, max_examples=60)
@given(shape=st.lists(st.integers(0, 2**62), min_size=1, max_size=6), data=st.binary(max_size=64))
def test_terabyte_shapes_cost_nothing(shape: list[int], data: bytes) -> None:
    """A tensor's shape must match the bytes that came, so a claimed terabyte allocates nothing."""
    assume(math.prod(shape) * 4 > 2**30 or 0 in shape)
    tracemalloc.start()
    try:
        msg = decode(pack("activation", {"z": tensor(dtype="float32", shape=shape, data=data, __t=1),
                                         "y": tensor(np.array([0, 1])), "split": 1}))
        assert msg.body["z"].size == 0  # only a zero-size tensor gets through
    except RemoteProtocolError:
        pass
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peak < 2**20


def test_element_bombs_are_refused_before_they_expand() -> None:
    """1 byte of msgpack can be ~60 bytes of Python: a body of a million empty lists must not decode."""
    bomb = pack("hello", {"backend": "x", "num_samples": 1, "pad": [[]] * 1_000_000})
    deep = b"\x91" * 100_000 + b"\xc0"
    wide = pack("hello", {"backend": "x", "num_samples": 1,
                          "pad": [[[] for _ in range(1000)] for _ in range(MAX_ITEMS // 1000 + 1)]})
    tracemalloc.start()
    for junk, match in ((bomb, "max_array_len"), (deep, "not a msgpack"), (wide, "elements")):
        with pytest.raises(RemoteProtocolError, match=match):
            decode(junk)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 64 * 2**20  # the widest legal one is bounded by MAX_ITEMS, not by the bytes sent
    with pytest.raises(RemoteProtocolError, match="deeper"):
        nested: Any = 1
        for _ in range(MAX_DEPTH + 2):
            nested = [nested]
        decode(pack("hello", {"backend": "x", "num_samples": 1, "pad": nested}))


def test_transport_frames_refuse_containers() -> None:
    for frame in ({"tf": 1, "op": "req", "cid": "c", "p": [[]] * 10}, {"tf": 1, "op": "req", "cid": "c", "p": {}},
                  {"tf": 1, "op": "req", "cid": "c", "p": b"", "x": 1}, [1, 2]):
        with pytest.raises(RemoteProtocolError):
            _parse_frame(msgpack.packb(frame, use_bin_type=True))


# -- chunk reassembly ----------------------------------------------------------------------------------------

def _chunk(msg_id: str, i: int, n: int, total: int, part: bytes, crc: int = 0) -> bytes:
    return msgpack.packb({"v": 1, "id": msg_id, "i": i, "n": n, "total": total, "crc": crc, "part": part},
                         use_bin_type=True)


@settings(FUZZ, max_examples=120)
@given(st.data())
def test_reassembler_holds_real_bytes_under_its_caps_whatever_arrives(data: st.DataObject) -> None:
    cap, owner_cap = 20_000, 12_000
    r = Reassembler(cap, 60, max_owner_bytes=owner_cap, max_pending=40, max_owner_pending=10)
    honest = b"h" * 9000
    good = split_message(honest, max_chunk=1200, msg_id="honest#1")
    steps = data.draw(st.lists(st.tuples(
        st.sampled_from(["flood", "junk", "dup", "claim"]), st.sampled_from(["evil", "evil2", None]),
        st.integers(0, 10**12), st.integers(1, 3000), st.integers(0, 50)), max_size=60))
    out = []
    gi = 0
    for op, owner, total, size, k in steps:
        if op == "flood":  # half-sent messages declaring anything
            chunk = _chunk(f"{owner}#{k}", 0, max(2, min(total, 10**6)), total, b"f" * min(size, max(total, 1)))
        elif op == "claim":  # a chunk that contradicts its siblings
            chunk = _chunk(f"{owner}#{k}", 1, 3, 9999, b"c" * 10)
        elif op == "junk":
            chunk = data.draw(st.binary(max_size=50))
        else:
            chunk = good[k % len(good)]
        try:
            got = r.feed(chunk, owner=owner if op != "dup" else "honest")
        except RemoteProtocolError:
            got = None
        if got is not None:
            out.append(got)
        held = sum(p.size for p in r._partial.values())
        assert r.in_flight_bytes == held <= cap  # real bytes, never what was declared
        assert all(r.owner_bytes(o) <= owner_cap for o in ("evil", "evil2", None, "honest"))
        assert len(r.pending) <= 40
        if gi < len(good) and data.draw(st.booleans()):  # the honest sender keeps sending meanwhile
            try:
                got = r.feed(good[gi], owner="honest")
            except RemoteProtocolError:
                got = None
            gi += 1
            if got is not None:
                out.append(got)
    for c in good[gi:]:
        try:
            got = r.feed(c, owner="honest")
        except RemoteProtocolError:
            got = None
        if got is not None:
            out.append(got)
    assert out == [] or out == [honest]


def test_a_flooding_sender_is_evicted_before_a_fair_one_is_refused() -> None:
    r = Reassembler(10_000, 60)
    for k in range(9):  # 9 half-sent messages of 1000 bytes each, each declaring all the room there is
        r.feed(_chunk(f"evil#{k}", 0, 10, 10_000, b"e" * 1000), owner="evil")
    assert r.in_flight_bytes == 9000 and r.owner_bytes("evil") == 9000
    honest = bytes(range(256)) * 16  # within its fair share (half the cap: two senders hold bytes)
    out = [r.feed(c, owner="device") for c in split_message(honest, max_chunk=1100, msg_id="device#1")]
    assert out[-1] == honest and r.stats["evicted"] >= 4 and r.in_flight_bytes <= 10_000
    with pytest.raises(RemoteProtocolError, match="evicted"):  # the flooder hears it, once
        r.feed(_chunk("evil#0", 1, 10, 10_000, b"e" * 1000), owner="evil")
    assert r.feed(_chunk("evil#0", 2, 10, 10_000, b"e" * 1000), owner="evil") is None


def test_pending_cap_evicts_the_oldest_half_sent_message_of_the_sender() -> None:
    r = Reassembler(10**6, 60, max_owner_pending=3)
    for k in range(10):
        r.feed(_chunk(f"x#{k}", 0, 5, 5000, b"p"), owner="x")
    assert r.pending == ["x#7", "x#8", "x#9"] and r.stats["evicted"] == 7


# -- the Peer's reply cache ------------------------------------------------------------------------------------

def _peer_with_echo(**kw: Any) -> tuple[Peer, Any, list[tuple[str, int]]]:
    peer = Peer(LoopbackTransport(), "coordinator", RUN, **kw)
    runs: list[tuple[str, int]] = []
    who: list[str] = []

    def handler(msg: Message) -> Message:
        runs.append((msg.sender, msg.seq))
        if msg.kind == "fetch" and msg.body["blocks"] == ["refuse"]:
            return peer.reply(msg, "error", {"reason": "no"})
        return peer.reply(msg, "weights", {"weights": {"w": np.zeros(msg.body["blocks"][0], np.uint8)}})

    serve = peer.serve(handler, sender_of=lambda: who[-1] if who else None)

    def send(sender: str, seq: int, size: int, claim: str | None = None) -> Message:
        who.append(sender)
        return decode(serve(pack("fetch", {"blocks": [size]}, seq=seq, sender=claim or sender)))

    return peer, send, runs


def test_reply_cache_is_per_sender_and_bounded_in_bytes() -> None:
    peer, send, runs = _peer_with_echo(cache_size=50, cache_bytes=200_000, cache_total_bytes=300_000)
    send("client-000", 1, 100)  # a small reply, cached
    send("client-000", 2, 50_000)  # a large one
    for seq in range(1, 200):  # another sender floods large replies
        send("client-666", seq, 60_000)
    assert peer.cached_bytes <= 300_000 + 2 * 50 * 200
    runs.clear()
    assert send("client-000", 1, 100).kind == "weights" and send("client-000", 2, 50_000).kind == "weights"
    assert runs == []  # both answered from the cache: the flood evicted only the flooder's own entries
    assert peer.duplicates == 2
    # A payload claiming another sender never reaches the handler or the cache.
    assert send("client-666", 500, 10, claim="client-000").kind == "error" and runs == []


def test_a_replay_after_the_cache_turned_over_is_not_handled_twice() -> None:
    peer, send, runs = _peer_with_echo(cache_size=1000, cache_bytes=100_000)
    first = send("client-000", 1, 60_000)
    for seq in range(2, 6):  # the sender's own later large replies push the first reply out
        send("client-000", seq, 60_000)
    runs.clear()
    replay = send("client-000", 1, 60_000)
    assert first.kind == "weights" and replay.kind == "error" and "replay" in replay.body["reason"]
    assert runs == [] and peer.replays == 1


def test_error_replies_are_never_cached() -> None:
    peer, _, _ = _peer_with_echo()
    for seq in range(1, 5000):  # an unknown sender that only ever gets refused holds nothing
        who = f"intruder-{seq}"
        assert decode(peer.serve(lambda m: peer.reply(m, "error", {"reason": "unknown"}),
                                 sender_of=lambda who=who: who)(pack("fetch", {"blocks": [1]}, sender=who))).kind == "error"
    assert peer.cached_bytes == 0 and peer.rejections["intruder-4990"] == 1 and len(peer.rejections) <= 4096


# -- the coordinator's receive ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def coordinator(digits):
    from fedsga_edge.runbuild import build_coordinator, plan_run

    cfg = tiny_config("fedsga", batch_size=16, max_batches=2)
    co = build_coordinator(plan_run(cfg, digits)).coordinator
    co.begin_round(1, 0.0)  # FedSGA round 1: devices choose their split, and it calibrates (probes allowed)
    return co


def _state(co: Any) -> dict[str, torch.Tensor]:
    out = {}
    extra = [(n, getattr(co.strategy, n)) for n in ("prototypes", "phi_s") if hasattr(co.strategy, n)]
    for name, mod in [("m", co.model), ("h", co.head), *extra]:
        out.update({f"{name}.{k}": v.detach().clone() for k, v in mod.state_dict().items()})
    opts = [("opt", co.server.shared.opt)] + [(n, getattr(co.strategy, n)) for n in ("phi_opt",) if hasattr(co.strategy, n)]
    for opt_name, opt in opts:
        for i, st_ in enumerate(opt.state.values()):
            out.update({f"{opt_name}.{i}.{k}": v.clone() for k, v in st_.items() if torch.is_tensor(v)})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _interface(co: Any, k: int) -> tuple[int, ...]:
    return co.model.interface_shape(co.model.depth_of(k))


def _valid_body(co: Any, kind: str, b: int, k: int, rng: np.random.Generator) -> dict[str, Any]:
    """What an honest device of this round would send (the starting point every mutation spoils)."""
    y = rng.integers(0, co.num_classes, b)
    if kind == "activation":
        return {"z": rng.standard_normal((b, *_interface(co, k))).astype(np.float32), "y": y, "split": k,
                "h1": rng.standard_normal((b, co.strategy.phi_s.net[0].in_features)).astype(np.float32)}
    if kind == "probe":
        return {"z1": rng.standard_normal((b, *_interface(co, 1))).astype(np.float32),
                "zref": rng.standard_normal((b, *_interface(co, 2))).astype(np.float32), "y": y,
                "o": [0.1, 0.2, 0.0][: co.strategy.cal_buffer.num_obs], "r_prev": 0.5}
    if kind == "update":
        depth = co.model.depth_of(k)
        weights = {n: v.numpy().copy() for n, v in co._snapshot.items() if co.model.unit_of(n) < depth}
        return {"weights": weights, "num_samples": 479, "split": k, "depth": depth, "train_loss": 0.7, "a": 0.1,
                "r": 0.4, "probe_samples": b, "steps": 2}
    if kind == "fetch":
        return {"blocks": [0, 1], "head": False}
    return {"reason": "giving up"}


def _spoil(draw: st.DrawFn, body: dict[str, Any], co: Any) -> None:
    """One hostile change to a field of ``body``: poison, reshape, retype, drop or replace it."""
    key = draw(st.sampled_from(sorted(body)))
    v = body[key]
    how = draw(st.sampled_from(["nan", "inf", "huge", "dtype", "batch", "dim", "ndim", "any", "drop", "labels"]))
    if key == "weights" and isinstance(v, dict) and v:
        name = draw(st.sampled_from(sorted(v)))
        if how == "drop":
            del v[name]
        elif how == "any":
            v[draw(st.sampled_from([name, "blocks.99.x", "head.fc"]))] = draw(ANY_VALUE)
        else:
            sub = {"w": v[name]}
            _spoil_array(draw, sub, "w", how)
            v[name] = sub["w"]
    elif isinstance(v, np.ndarray):
        _spoil_array(draw, body, key, how)
    elif how == "drop":
        del body[key]
    elif how in ("nan", "inf", "huge") and isinstance(v, (int, float, list)):
        bad = {"nan": math.nan, "inf": math.inf, "huge": 1e300}[how]
        body[key] = [bad, *v[1:]] if isinstance(v, list) and v else bad
    else:
        body[key] = draw(st.one_of(ANY_VALUE, st.integers(-3, 2**40), st.sampled_from([-1, 0, 4, 99, 2**63])))


def _spoil_array(draw: st.DrawFn, body: dict[str, Any], key: str, how: str) -> None:
    a = body[key]
    if how in ("nan", "inf", "huge") and a.size and a.dtype.kind == "f":
        a = a.copy()
        a.reshape(-1)[draw(st.integers(0, a.size - 1))] = {"nan": np.nan, "inf": -np.inf, "huge": 3e7}[how]
    elif how == "dtype":
        a = a.astype(draw(st.sampled_from(["float16", "float64", "int64", "uint8", "bool", "int8"])))
    elif how == "batch" and a.ndim:
        a = np.resize(a, (draw(st.sampled_from([0, 1, 3, 17, 40])), *a.shape[1:]))
    elif how == "dim" and a.ndim > 1:
        a = np.resize(a, (*a.shape[:-1], a.shape[-1] + 1))
    elif how == "ndim":
        a = a.reshape(*a.shape, 1)
    elif how == "labels" and a.dtype.kind in "iu" and a.size:
        a = a.copy()
        a.reshape(-1)[0] = draw(st.sampled_from([-1, 10, 2**40]))
    elif how == "drop":
        del body[key]
        return
    elif how == "any":
        body[key] = draw(ANY_VALUE)
        return
    body[key] = a


_SEQ = itertools.count(1)


@st.composite
def hostile_request(draw: st.DrawFn, co: Any) -> bytes:
    """A request that is almost right: an honest one with 0-2 fields spoiled, sometimes in the envelope."""
    kind = draw(st.sampled_from(["activation", "activation", "activation", "probe", "probe", "update", "fetch",
                                 "error", "hello", "gradient", "round_start"]))
    sender = draw(st.sampled_from(["client-000", "client-001", "client-002", "intruder"]))
    rnd = {0: 0, 1: co.round.t + 1, 2: 2**63}.get(draw(st.integers(0, 11)), co.round.t)  # mostly the current round
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    body = _valid_body(co, kind, draw(st.sampled_from([2, 8, 16, 17])), draw(st.integers(1, co.model.num_splits)), rng)
    for _ in range(draw(st.integers(0, 2))):
        if body:
            _spoil(draw, body, co)
    return pack(kind, wire_body(body) | {k: {n: tensor(a) if isinstance(a, np.ndarray) else a for n, a in v.items()}
                                         for k, v in body.items() if k == "weights" and isinstance(v, dict)},
                round=rnd, seq=next(_SEQ) if draw(st.integers(0, 5)) else draw(st.integers(0, 2**40)), sender=sender)


@settings(FUZZ, max_examples=150)
@given(st.data())
def test_coordinator_receive_refuses_hostile_requests_and_changes_nothing(coordinator, data: st.DataObject) -> None:
    co = coordinator
    next_round = data.draw(st.integers(0, 4)) == 0  # drawn every time: what hypothesis draws may not depend on state
    if co.round_complete or (len(co.round.waiting) < len(co.clients) and next_round):
        co.end_round(0.0)  # aggregate whatever (hostile but valid) updates got in, and go on
        co.begin_round(co.round.t + 1, 0.0)
    peer = Peer(LoopbackTransport(), "coordinator", RUN)
    raw = data.draw(hostile_request(co))
    try:  # mostly the topic the bytes arrive on matches the sender they claim
        claimed = decode(raw).sender if data.draw(st.integers(0, 5)) else None
    except RemoteProtocolError:
        claimed = None
    observed = claimed or data.draw(st.sampled_from(["client-000", "client-001", "intruder"]))
    serve = peer.serve(lambda m: co.receive(m, 0.0), sender_of=lambda: observed)
    before, errors, updates = _state(co), co.remote_errors, dict(co.round.updates)
    cal = len(co.strategy.cal_buffer)
    reply = serve(raw)  # never raises: a refusal is a reply (a one-way ``error`` leaves nothing to answer)
    rep = decode(reply) if isinstance(reply, bytes) else None
    event(f"{decode(raw).kind if rep is None or rep.kind != 'error' else 'refused'} -> {rep.kind if rep else None}: "
          f"{(rep.body.get('reason', '') if rep else '')[:34]}")
    if rep is None or rep.kind == "error":
        assert _same(before, _state(co)) and co.round.updates.keys() == updates.keys() and len(co.strategy.cal_buffer) == cal
        assert rep is None or rep.body["reason"]
        assert rep is None or co.remote_errors >= errors
    for k, v in _state(co).items():  # whatever was accepted, nothing non-finite got in
        assert not v.is_floating_point() or bool(torch.isfinite(v).all()), k


def _activation(co: Any, seq: int, *, sender: str = "client-001", k: int = 1, b: int = 4, **over: Any) -> Message:
    rng = np.random.default_rng(seq)
    body = {"z": rng.standard_normal((b, *_interface(co, k))).astype(np.float32), "y": np.arange(b) % 10, "split": k}
    return Message("activation", RUN, co.round.t, seq, sender, body | over)


def test_poisoned_activations_and_replays_are_refused_with_a_reason(digits) -> None:
    from fedsga_edge.runbuild import build_coordinator, plan_run

    co = build_coordinator(plan_run(tiny_config("static", batch_size=16, max_batches=2), digits)).coordinator
    co.begin_round(1, 0.0)
    k = co.round.assigned["client-001"]
    z = _activation(co, 1, k=k).body["z"]
    cases = [
        ("non-finite", {"z": np.where(np.arange(z.size).reshape(z.shape) == 5, np.nan, z).astype(np.float32)}),
        ("non-finite", {"z": np.full_like(z, np.inf)}),
        ("up to", {"z": z * 1e7}),
        ("labels outside", {"y": np.array([0, 1, 2, 10])}),
        ("more than a batch", {"z": np.zeros((18, *z.shape[1:]), np.float32), "y": np.zeros(18, np.int64)}),
    ]
    for i, (reason, over) in enumerate(cases):
        before = _state(co)
        rep = only_reply(co.receive(_activation(co, 10 + i, k=k, **over), 0.0))
        assert rep.kind == "error" and reason in rep.body["reason"] and _same(before, _state(co)), (reason, rep.body)
    assert only_reply(co.receive(_activation(co, 20, k=k), 0.0)).kind == "gradient"
    before = _state(co)
    for seq in (20, 19, 3):  # the same seq again (bytes changed, so the Peer handles it afresh) or older
        rep = only_reply(co.receive(_activation(co, seq, k=k), 0.0))
        assert rep.kind == "error" and "replay" in rep.body["reason"]
    assert _same(before, _state(co)) and only_reply(co.receive(_activation(co, 21, k=k), 0.0)).kind == "gradient"
    # A finite activation can still blow up a server whose weights went bad: the step is refused and
    # BatchNorm's statistics, which the forward pass moved, are put back bit for bit.
    bn = [m for m in co.model.blocks[-1].modules() if isinstance(m, torch.nn.BatchNorm2d)][-1]  # server side
    with torch.no_grad():
        bn.weight.fill_(3e38)
        bn.bias.fill_(3e38)
    before = _state(co)
    rep = only_reply(co.receive(_activation(co, 22, k=k), 0.0))
    assert rep.kind == "error" and "non-finite loss" in rep.body["reason"] and _same(before, _state(co))
    rec, _ = co.end_round(0.0)
    assert rec["remote_errors_count"] == len(cases) + 4 and len(rec["remote_errors"]) == len(cases) + 4


def test_a_malformed_update_is_refused_and_never_reaches_end_round(digits) -> None:
    from fedsga_edge.runbuild import build_coordinator, plan_run

    co = build_coordinator(plan_run(tiny_config("static", clients=2, batch_size=16, max_batches=2), digits)).coordinator
    co.begin_round(1, 0.0)
    k = co.round.assigned["client-000"]
    depth = co.model.depth_of(k)
    weights = {n: v.numpy().copy() for n, v in co._snapshot.items() if co.model.unit_of(n) < depth}
    good = {"weights": weights, "num_samples": co.clients["client-000"], "split": k, "depth": depth, "train_loss": 0.5}
    name = next(n for n in weights if weights[n].dtype == np.float32)
    bad = {
        "non-finite": {"weights": weights | {name: np.full_like(weights[name], np.nan)}},
        "up to": {"weights": weights | {name: weights[name] + 1e30}},
        "train_loss": {"train_loss": math.nan},
        "probe_samples": {"probe_samples": "many"},  # end_round int()s it: this used to crash the round
        "descriptor_entropy": {"descriptor_entropy": [1, 2]},  # copied into metrics.jsonl
        "num_samples": {"num_samples": 10**9},
    }
    for seq, (reason, over) in enumerate(bad.items(), start=1):
        rep = only_reply(co.receive(Message("update", RUN, 1, seq, "client-000", good | over), 0.0))
        assert rep.kind == "error" and reason in rep.body["reason"], (reason, rep.body)
    assert only_reply(co.receive(Message("update", RUN, 1, 99, "client-000", good), 0.0)).kind == "ack"
    co.fail("client-001", "test")
    rec, _ = co.end_round(0.0)
    assert rec["splits"] == {"client-000": k} and all(torch.isfinite(v.float()).all() for v in co.model.state_dict().values())


def test_probe_observations_out_of_range_are_refused(digits) -> None:
    from fedsga_edge.runbuild import build_coordinator, plan_run

    co = build_coordinator(plan_run(tiny_config("fedsga", batch_size=16, max_batches=2), digits)).coordinator
    co.begin_round(1, 0.0)
    b = 4
    body = {"z1": np.zeros((b, *_interface(co, 1)), np.float32), "zref": np.zeros((b, *_interface(co, 2)), np.float32),
            "y": np.arange(b), "r_prev": 0.5}
    for o in ([math.nan, 0.0, 0.0], [0.5, 1e300, 0.0], [2.0, 0.0, 0.0], [0.5, -1.0, 0.0]):
        rep = only_reply(co.receive(Message("probe", RUN, 1, 10**9, "client-002", body | {"o": o}), 0.0))
        assert rep.kind == "error" and ("finite" in rep.body["reason"] or "out of range" in rep.body["reason"])


# -- the device -------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def agent(digits, tmp_path_factory):
    from fedsga_edge.runbuild import device_agent

    a = device_agent(tiny_config("fedsga"), 0, LoopbackTransport(), tmp_path_factory.mktemp("agent"), bundle=digits)
    yield a
    a.log.close()


@st.composite
def hostile_round_start(draw: st.DrawFn) -> dict[str, Any]:
    body: dict[str, Any] = {"split": draw(st.one_of(st.none(), st.integers(-1, 5), ANY_VALUE)),
                            "full": draw(st.booleans()),
                            "train": draw(st.one_of(ANY_VALUE, st.just({"batch_size": 16}),
                                                    st.just({"lr": "fast", "batch_size": -1}))),
                            "weights": draw(st.one_of(st.just({}), ANY_VALUE, st.just({"blocks.0.x": [1]}))),
                            "fedsga": draw(st.one_of(st.none(), st.just({"rho": "x"}), ANY_VALUE))}
    for key in draw(st.sets(st.sampled_from(sorted(body)))):
        del body[key]
    return body


@settings(FUZZ, max_examples=120)
@given(body=hostile_round_start(), rnd=st.sampled_from([1, 2, 5, 2**40]), kind=st.sampled_from(
    ["round_start", "round_start", "activation", "gradient", "update", "hello", "bye"]),
    claim=st.sampled_from(["coordinator", "coordinator", "client-001"]))
def test_device_refuses_hostile_orders_without_dropping_its_round(agent, body, rnd, kind, claim) -> None:
    """What arrives on the device's down topic: anything malformed is refused with an error, and
    never supersedes the round the device is running (agent.py ``_handle`` validates first)."""
    assume(kind != "bye")  # a well-formed bye from the coordinator ends the run: that is its meaning
    peer = agent.peer
    serve = peer.serve(agent._handle, sender_of=lambda: "coordinator")
    latest, newest, queued, errors = agent._latest, agent._newest, agent._queue.qsize(), peer.errors
    try:
        wire = pack(kind, body, round=rnd, seq=7, sender=claim, run=peer.run)
    except (TypeError, ValueError):
        return
    reply = serve(wire)
    rep = decode(reply) if reply is not None else None
    if rep is not None and rep.kind == "error":
        assert (agent._latest, agent._newest, agent._queue.qsize()) == (latest, newest, queued)
        assert peer.errors == errors + 1 or rep.body["reason"]
    else:  # accepted: only a round start that passes the role's own checks
        from fedsga_edge.device.role import check_round_start

        assert kind == "round_start" and claim == "coordinator"
        check_round_start(decode(wire).body)
        while not agent._queue.empty():
            agent._queue.get_nowait()
        agent._latest, agent._newest = latest, newest


@pytest.mark.parametrize(("train", "fedsga", "flag"), [
    ({"lr": -0.1}, None, "--lr"), ({"lr": math.nan}, None, "--lr"), ({"batch_size": 1}, None, "--batch-size"),
    ({"local_epochs": 0}, None, "--local-epochs"), ({"momentum": 1.5}, None, "--momentum"),
    ({"mu": -1.0}, None, "--mu"), ({}, {"mu_proto": 2.0}, "--mu-proto"), ({}, {"tau_m": 0.0}, "--tau-a and --tau-m"),
])
def test_round_start_settings_out_of_range_are_refused_naming_the_setting(train, fedsga, flag) -> None:
    """Types alone are not enough: a negative learning rate or a batch of one would fail (or diverge)
    half-way through local training. The device refuses them up front, with the same words as the CLI."""
    from fedsga_edge.device.role import check_round_start

    body: dict[str, Any] = {"split": 1, "train": train, "weights": {}}
    if fedsga is not None:
        body["fedsga"] = fedsga
    with pytest.raises(RemoteProtocolError, match=f"malformed round_start: ValueError: .*{flag}"):
        check_round_start(body)
    check_round_start({"split": 1, "train": {"lr": 0.05, "batch_size": 2}, "weights": {}})  # in range: accepted
