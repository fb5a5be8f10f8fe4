"""Messages authenticated end to end (wire/auth.py, transport/sealed.py): forged, altered, replayed,
unkeyed and misaddressed frames are refused before decode, on loopback as on any transport."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from fedsga_edge.transport import LoopbackTransport, Peer
from fedsga_edge.transport.sealed import SealedTransport
from fedsga_edge.wire import Message, RemoteProtocolError, decode, encode
from fedsga_edge.wire.auth import (KeyFileError, Keyring, is_sealed, key_path, make_key, read_key, read_keys,
                                   write_key)

RUN = "run-a"
DEVICES = ("client-000", "client-001")


def fleet(encrypt: bool = False):
    """One loopback transport, the coordinator and two devices each sealing with its own keyring."""
    keys = {d: make_key() for d in DEVICES}
    t = LoopbackTransport()
    coord_t = SealedTransport(t, Keyring("coordinator", keys, encrypt=encrypt), RUN)
    coord = Peer(coord_t, "coordinator", RUN)
    heard: dict[str, list[Message]] = {d: [] for d in (*DEVICES, "coordinator")}
    coord.register(lambda m: heard["coordinator"].append(m) or coord.reply(m, "ack", {"ok": True}))
    peers = {}
    for d in DEVICES:
        st = SealedTransport(t, Keyring(d, {"coordinator": keys[d]}, encrypt=encrypt), RUN)
        p = peers[d] = Peer(st, d, RUN)
        p.register(lambda m, d=d: heard[d].append(m) or None)
    return t, keys, coord, peers, heard


def test_sealed_round_trip_and_orders_reach_only_their_device():
    t, keys, coord, peers, heard = fleet()
    rep = peers["client-000"].call("coordinator", "hello", 0, {"backend": "torch", "num_samples": 5})
    assert rep.kind == "ack" and heard["coordinator"][0].sender == "client-000"
    coord.send("client-001", "bye", 3, {"reason": "done"})
    assert [m.kind for m in heard["client-001"]] == ["bye"] and heard["client-000"] == []


@pytest.mark.parametrize("encrypt", [False, True])
def test_forged_bye_on_loopback_is_refused(encrypt):
    """An attacker on the transport (a plain message, or one sealed with its own device's key claiming to be
    the coordinator) cannot stop another device."""
    t, keys, coord, peers, heard = fleet(encrypt)
    plain = encode(Message("bye", RUN, 3, 99, "coordinator", {"reason": "forged"}))
    reply = decode(t.request("coordinator", "client-001", plain))
    assert reply.kind == "error" and "not authenticated" in reply.body["reason"]
    # client-000's own key, sealed as if it were the coordinator's order to client-001
    evil = Keyring("coordinator", {"client-001": keys["client-000"]}, encrypt=encrypt)
    reply = decode(t.request("coordinator", "client-001", evil.seal("client-001", plain)))
    assert reply.kind == "error" and ("MAC" in reply.body["reason"] or "tag" in reply.body["reason"])
    assert heard["client-001"] == [] and sum(peers["client-001"].transport.refused.values()) == 2


def test_altered_misaddressed_and_unknown_frames_are_refused():
    t, keys, coord, peers, heard = fleet()
    ring = Keyring("client-000", {"coordinator": keys["client-000"]})
    good = ring.seal("coordinator", encode(Message("hello", RUN, 0, 1, "client-000", {"backend": "x", "num_samples": 1})))
    bad = bytearray(good)
    bad[-40] ^= 1  # one bit of the body
    assert "does not match" in decode(t.request("client-000", "coordinator", bytes(bad))).body["reason"]
    # a device's sealed frame replayed to another device: addressed to the coordinator, not to it
    assert "not 'client-001'" in decode(t.request("x", "client-001", good)).body["reason"]
    stranger = Keyring("client-009", {"coordinator": make_key()})
    msg = encode(Message("hello", RUN, 0, 1, "client-009", {"backend": "x", "num_samples": 1}))
    assert "not enrolled" in decode(t.request("x", "coordinator", stranger.seal("coordinator", msg))).body["reason"]
    assert heard["coordinator"] == []


def test_a_device_cannot_claim_another_devices_name_inside_its_frame():
    t, keys, coord, peers, heard = fleet()
    ring = Keyring("client-000", {"coordinator": keys["client-000"]})
    lie = encode(Message("hello", RUN, 0, 1, "client-001", {"backend": "x", "num_samples": 1}))
    reply = decode(ring.open(t.request("client-000", "coordinator", ring.seal("coordinator", lie)))[1])
    assert reply.kind == "error" and "claims sender 'client-001'" in reply.body["reason"]
    assert heard["coordinator"] == []


def test_encryption_hides_tensors_and_refuses_clear_frames():
    t, keys, coord, peers, heard = fleet(encrypt=True)
    z = np.full(64, 1234.5, np.float32)
    ring = Keyring("client-000", {"coordinator": keys["client-000"]}, encrypt=True)
    payload = encode(Message("activation", RUN, 1, 1, "client-000", {"z": z, "y": np.zeros(64, np.int64), "split": 1}))
    frame = ring.seal("coordinator", payload)
    assert is_sealed(frame) and z.tobytes()[:16] not in frame and b"activation" not in frame
    mac_only = Keyring("client-000", {"coordinator": keys["client-000"]}).seal("coordinator", payload)
    assert b"activation" in mac_only  # the MAC alone authenticates, it does not hide
    reply = decode(t.request("client-000", "coordinator", mac_only))
    assert "not encrypted" in reply.body["reason"]


def test_a_device_without_a_key_is_told_why():
    t, keys, coord, peers, heard = fleet()
    bare = Peer(t, "client-002", RUN)
    reply = bare.call("coordinator", "hello", 0, {"backend": "torch", "num_samples": 5})
    assert reply.kind == "error" and "needs its key" in reply.body["reason"]


def test_a_plain_reply_is_refused_by_a_keyed_device():
    """A coordinator reply that is not sealed (a forger answering a request first) is never acted on."""
    t = LoopbackTransport()
    t.register("coordinator", lambda data: encode(Message("ack", RUN, 0, 1, "coordinator", {})))
    dev = Peer(SealedTransport(t, Keyring("client-000", {"coordinator": make_key()}), RUN), "client-000", RUN)
    with pytest.raises(RemoteProtocolError, match="not authenticated"):
        dev.call("coordinator", "hello", 0, {"backend": "torch", "num_samples": 5})


def test_key_files(tmp_path):
    key = make_key()
    path = write_key(key_path(tmp_path / "keys", "client-000"), key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and read_key(path) == key
    assert read_keys(tmp_path / "keys") == {"client-000": key}
    os.chmod(path, 0o644)
    with pytest.raises(KeyFileError, match="open to other users"):
        read_key(path)
    os.chmod(path, 0o600)
    path.write_text("nothex\n")
    with pytest.raises(KeyFileError, match="does not hold a key"):
        read_key(path)
    with pytest.raises(KeyFileError, match="cannot read"):
        read_key(tmp_path / "missing.key")
    with pytest.raises(KeyFileError, match="does not exist"):
        read_keys(tmp_path / "nowhere")


def test_field_roles_refuse_a_bad_key_before_the_broker(tmp_path):
    """A device whose key file is missing or open to others stops with the problem named (a usage error),
    before it connects anywhere; --encrypt without a key is refused too."""
    from fedsga_edge.config import RunConfig
    from fedsga_edge.fieldroles import FieldError, run_coordinator, run_device

    cfg = RunConfig(dataset="digits", clients=1, rounds=1)
    path = write_key(tmp_path / "client-000.key", make_key())
    os.chmod(path, 0o640)
    kw = dict(backend="torch", artifacts=None, max_packet=1 << 16, threads=1, request_timeout=1.0, data=None,
              fleet_link="off", latency_profile=None)
    with pytest.raises(FieldError, match="open to other users") as e:
        run_device(cfg, 0, "mqtt://127.0.0.1:9", tmp_path / "state", key=path, **kw)
    assert e.value.usage
    with pytest.raises(FieldError, match="--encrypt needs --key"):
        run_device(cfg, 0, "mqtt://127.0.0.1:9", tmp_path / "state", encrypt=True, **kw)
    with pytest.raises(FieldError, match="holds no <device>.key"):
        run_coordinator(cfg, "mqtt://127.0.0.1:9", tmp_path / "run", resume=False, min_devices=None,
                        register_timeout=1.0, max_packet=1 << 16, classes=None, test_data=None,
                        keys=tmp_path / "state" if (tmp_path / "state").mkdir() is None else None)


def test_any_bytes_either_open_or_are_refused_by_name():
    """Random and mutated frames: ``open`` raises RemoteProtocolError and nothing else, and a frame with any
    byte changed never opens."""
    from hypothesis import given, settings, strategies as st

    key = make_key()
    ring = Keyring("coordinator", {"client-000": key})
    dev = Keyring("client-000", {"coordinator": key})
    good = dev.seal("coordinator", b"payload bytes")

    @settings(max_examples=300, deadline=None)
    @given(st.binary(max_size=200), st.integers(0, len(good) - 1), st.integers(1, 255))
    def fuzz(junk, at, flip):
        for data in (junk, b"\xc1FSA" + junk, memoryview(b"\xc1FSA\x01" + junk)):
            with pytest.raises(RemoteProtocolError):
                ring.open(data)
        bad = bytearray(good)
        bad[at] ^= flip
        with pytest.raises(RemoteProtocolError):
            ring.open(bytes(bad))

    fuzz()
    assert ring.open(good) == ("client-000", b"payload bytes")
