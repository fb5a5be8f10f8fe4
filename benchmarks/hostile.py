"""A hostile device on the broker of a running field run, and proof that it changes nothing.

    python benchmarks/hostile.py --out runs/hostile [--clients 2] [--rounds 2] [--examples 150] \
        [--flood-mb 160] [--json runs/hostile/hostile.json]

runs the same tiny field run twice with the same seed, the roles as OS processes (``fedsga-edge
coordinator`` and ``fedsga-edge device`` x N, as ``fedsga-edge trial`` starts them) on a Mosquitto this
script starts on a free 127.0.0.1 port: once untouched, once with an ``Intruder`` publishing on the
coordinator's and a device's topics. Then it checks what docs/protocol.md ("What is rejected and how it
is counted") promises: every hostile request gets an ``error`` message naming the reason (or is dropped
and counted when it is not even a frame); the coordinator counts the refusals and logs them
(``coordinator.log``); no process crashes; the bytes the coordinator's transport holds for partial
messages and for queued handler jobs stay under the stated cap (``max_buffer_bytes``, measured inside
the coordinator process, see ``HELD``); and the run ends with the same accuracy and the same weights,
bit for bit. Peak RSS per role is reported, not checked: beside other jobs (the clean run, other
tests), the allocator's and the OS's share of it varies by more than the cap's slack.

The processes start in stages so that every attack meets a live receiver: the coordinator alone
(``attack_idle``: garbage, wrong types in every envelope and required field, disallowed dtypes,
terabyte shapes, other names, another run, and a hypothesis fuzz of mutated and random messages), then
device 0 (``attack_device``: orders no coordinator would give, on its down topic), then the other
devices, whose registration starts round 1: before they start, while the coordinator holds round 1
for them, a flood of partial chunked messages (``flood``); then ``attack_rounds``: the must-show below,
poisoned activations, replays, stale rounds. The must-show, in round 1:

* an activation holding a NaN, from a real device, for the running round;
* the same activation from a device the run does not know (``intruder``);
* the same activation for another round.

Replays: the same frames (a transport duplicate), the same payload under a new frame id (the Peer's
reply cache answers; the step is not taken twice), the same (sender, seq) with a changed byte (what a
turned-over cache lets through: the coordinator's seq check refuses it), and round 1's requests in
round 2 (stale). Also in round 1: ``--misdeclared-mb`` MiB of int8 bytes declared float64 (refused
before a float64 array exists; the peak RSS lines show what it cost). On device 0's down topic:
well-formed orders no coordinator gives (round 2^64-1, a bye for it, a bye claiming another device).
Floods: 300 half-sent messages declaring 100 MiB each, then ``--flood-mb`` of real
part bytes from three made-up senders, more than the 128 MiB reassembly cap.

Bit-identical needs a deterministic run: ``--strategy static --server-copies per-client``. With one
shared server copy (the default), the server sees the devices' batches in arrival order, which the OS
decides, so two clean runs already differ in the last bits (docs/protocol.md, "Faults").

A hostile message that is *valid* (a well-formed activation on a device's topic with a fresh seq, or
a well-formed ``round_start`` on its down topic) is indistinguishable from the device or the
coordinator on an open broker; only the broker's ACL stops that (docs/protocol.md, "The sender is the
topic"), or the per-device keys, which this run does not use. The intruder never sends one.

    python benchmarks/hostile.py --logins [--out runs/logins] [--json runs/logins/logins.json]

runs instead the scenarios of a device's own login (``login_attacks``): with ``client-000``'s password read
from the broker's files and its own key, eavesdropping on ``#``, forged and replayed orders to
``client-001``, a forged request in ``client-001``'s name, and a connection with client id ``coordinator``,
on the embedded broker and on Mosquitto, with messages plain, MAC-sealed and encrypted (docs/protocol.md,
"Security"; benchmarks/RESULTS.md has the figures).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import psutil
from fedsga_edge.broker.launch import RunningBroker, mosquitto_path, start_mosquitto

from fedsga_edge.wire import Message, Reassembler, RemoteProtocolError, decode, encode, split_message

MOSQUITTO = mosquitto_path()
TINY = ["--dataset", "digits", "--model", "resnet18_cifar", "--width", "0.25", "--seed", "0", "--local-epochs", "1",
        "--max-batches", "2", "--batch-size", "32", "--round-timeout", "300", "--strategy", "static",
        "--server-copies", "per-client"]
REASSEMBLY_CAP = 128 * 2**20  # MqttTransport's max_buffer_bytes default

# The coordinator runs as ``python -c HELD <cli args>``: the real CLI, with the peak bytes its transports
# hold measured where they are counted. ``Reassembler.feed`` is sampled on return and ``_assemble`` on
# entry (a completing message's last part is held at that moment); ``MqttTransport._dispatch`` on return
# (whole payloads queued for handlers). The peaks go to $FEDSGA_HELD_FILE as JSON when the process exits.
HELD = """
import atexit, json, os, sys, threading
from fedsga_edge.transport import mqtt
from fedsga_edge.wire import chunking
peak = {"reassembly": 0, "queued": 0}
lock = threading.Lock()
def note(key, value):
    with lock:
        peak[key] = max(peak[key], value)
def wrap(cls, name, sample, entry=False):
    orig = getattr(cls, name)
    def wrapped(self, *a, **k):
        if entry:
            sample(self)
        try:
            return orig(self, *a, **k)
        finally:
            if not entry:
                sample(self)
    setattr(cls, name, wrapped)
wrap(chunking.Reassembler, "feed", lambda r: note("reassembly", r.in_flight_bytes))
wrap(chunking.Reassembler, "_assemble", lambda r: note("reassembly", r.in_flight_bytes), entry=True)
wrap(mqtt.MqttTransport, "_dispatch", lambda t: note("queued", t._queued_bytes))
atexit.register(lambda: open(os.environ["FEDSGA_HELD_FILE"], "w").write(json.dumps(peak)))
from fedsga_edge.cli.main import app
sys.argv[0] = "fedsga-edge"
app()
"""


# -- a broker ----------------------------------------------------------------------------------------------

def start_broker(folder: Path) -> RunningBroker:
    """Mosquitto on a free loopback port, anonymous (no ACL: the intruder can publish anywhere).

    ``max_queued_messages 0``: the flood must reach the coordinator. Mosquitto's default (1000 QoS 1
    messages queued per subscriber) drops the rest for a subscriber that lags, and on a loaded machine the
    coordinator lags the whole flood: the reassembly cap is then never reached."""
    return start_mosquitto(folder, extra=("allow_anonymous true", "max_queued_messages 0"))


# -- the intruder --------------------------------------------------------------------------------------------

def frame(op: str, cid: str, *, p: bytes | None = None, chunk: bytes | None = None) -> bytes:
    """A transport frame as docs/protocol.md ("Frames") describes it."""
    d: dict[str, Any] = {"tf": 1, "op": op, "cid": cid}
    d["chunk" if chunk is not None else "p"] = chunk if chunk is not None else p
    return msgpack.packb(d, use_bin_type=True)


def tensor(arr: np.ndarray, **over: Any) -> dict[str, Any]:
    return {"__t": 1, "dtype": arr.dtype.name, "shape": list(arr.shape), "data": arr.tobytes()} | over


def pack(kind: Any, body: Any, *, run: Any, round: Any, seq: Any, sender: Any, **over: Any) -> bytes:
    """A message as raw msgpack: no encoder checks, so it can be wrong in any way."""
    env = {"v": 1, "kind": kind, "run": run, "round": round, "seq": seq, "sender": sender, "body": body} | over
    return msgpack.packb(env, use_bin_type=True)


def wire(body: dict[str, Any]) -> dict[str, Any]:
    return {k: tensor(v) if isinstance(v, np.ndarray) else v for k, v in body.items()}


@dataclass
class Captured:
    """An honest request seen on the broker, with the frame it came in and whether it was answered."""

    sender: str
    cid: str
    payload: bytes
    msg: Message
    frames: list[bytes]
    answered: threading.Event = field(default_factory=threading.Event)


class Intruder:
    """A raw MQTT client on the trial's broker: it publishes anything on any topic of the run, hears
    every reply, and records the honest devices' requests (reassembled) for replays and mutations."""

    def __init__(self, host: str, port: int, run: str) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        self.run = run
        self.base = f"fedsga/{run}"
        self._cids = itertools.count(1)
        self._lock = threading.Condition()
        self.replies: dict[str, tuple[str, bytes]] = {}  # our cid -> (op, payload)
        self.captured: list[Captured] = []
        self._frames: dict[tuple[str, str], list[bytes]] = {}
        self._by_cid: dict[str, Captured] = {}
        self._ours = "evil"
        self._asm = Reassembler(512 * 2**20, 120)  # honest requests overheard
        self._mine = Reassembler(64 * 2**20, 120)  # chunked replies to our own requests
        self.client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"intruder-{os.getpid()}")
        self.client.on_message = self._on_message
        self.client.connect(host, port)
        self.client.loop_start()
        for t in (f"{self.base}/up/+", f"{self.base}/down/+"):
            self.client.subscribe(t, qos=1)[1]
        time.sleep(0.3)

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def cid(self) -> str:
        return f"{self._ours}-{next(self._cids)}"

    # network thread
    def _on_message(self, client: Any, userdata: Any, m: Any) -> None:
        try:
            parts = m.topic.split("/")
            d = msgpack.unpackb(m.payload, raw=False)
            op, cid = d.get("op"), d.get("cid")
            if not isinstance(cid, str):
                return
            if cid.startswith(self._ours + "-"):
                if op in ("rep", "err"):
                    p = d.get("p")
                    if "chunk" in d:  # a big reply (a gradient answered from the cache) comes in chunks
                        p = self._mine.feed(d["chunk"], owner=m.topic)
                    if isinstance(p, bytes):
                        with self._lock:
                            self.replies[cid] = (op, p)
                            self._lock.notify_all()
                return
            if parts[2] == "down" and op in ("rep", "err"):
                got = self._by_cid.get(cid)
                if got is not None:
                    got.answered.set()
                return
            if parts[2] != "up" or op != "req":
                return
            sender = parts[3]
            key = (sender, cid)
            self._frames.setdefault(key, []).append(m.payload)
            payload = d.get("p")
            if "chunk" in d:
                payload = self._asm.feed(d["chunk"], owner=sender)
            if payload is None:
                return
            msg = decode(payload)
            cap = Captured(sender, cid, payload, msg, self._frames.pop(key))
            with self._lock:
                self.captured.append(cap)
                self._by_cid[cid] = cap
                self._lock.notify_all()
        except Exception:  # noqa: BLE001, S110 - whatever it overhears, the intruder keeps listening
            pass

    # publishing
    def publish(self, topic: str, data: bytes) -> None:
        self.client.publish(topic, data, qos=1).wait_for_publish(10)

    def request(self, topic: str, payload: bytes, timeout: float = 10.0) -> tuple[str, Any]:
        """Publish ``payload`` as a whole ``req`` frame on ``topic``; the answer on the reverse topic:
        ("error", reason) for an error message, ("err", reason) for a transport err frame,
        (kind, body) for any other message, or ("none", None) if nothing came."""
        cid = self.cid()
        self.publish(topic, frame("req", cid, p=payload))
        return self.wait(cid, timeout)

    def wait(self, cid: str, timeout: float) -> tuple[str, Any]:
        deadline = time.monotonic() + timeout
        with self._lock:
            while cid not in self.replies:
                left = deadline - time.monotonic()
                if left <= 0:
                    return "none", None
                self._lock.wait(left)
            op, p = self.replies.pop(cid)
        if op == "err":
            return "err", p.decode("utf-8", "replace")
        try:
            rep = decode(p)
        except RemoteProtocolError as e:
            return "undecodable", str(e)
        return (rep.kind, rep.body.get("reason") if rep.kind == "error" else rep.body)

    def honest(self, kind: str, sender: str | None = None, *, round: int | None = None, answered: bool = False,
               timeout: float = 120.0) -> Captured:
        """The first honest request of ``kind`` (from ``sender``, of ``round``) seen on the broker."""
        deadline = time.monotonic() + timeout
        with self._lock:
            while True:
                for c in self.captured:
                    if c.msg.kind == kind and sender in (None, c.sender) and round in (None, c.msg.round):
                        if answered and not c.answered.wait(0):
                            continue
                        return c
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no honest {kind} from {sender or 'any device'} within {timeout:g} s")
                self._lock.wait(min(left, 0.5))


# -- the attack ------------------------------------------------------------------------------------------------

@dataclass
class Report:
    """What each hostile message got back, by attack."""

    sent: dict[str, int] = field(default_factory=dict)
    answers: dict[str, dict[str, int]] = field(default_factory=dict)
    examples: dict[str, str] = field(default_factory=dict)
    must_show: dict[str, tuple[str, Any]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def note(self, attack: str, answer: tuple[str, Any], *, expect: tuple[str, ...] = ("error", "err")) -> None:
        self.sent[attack] = self.sent.get(attack, 0) + 1
        kind = answer[0]
        by = self.answers.setdefault(attack, {})
        by[kind] = by.get(kind, 0) + 1
        self.examples.setdefault(f"{attack}/{kind}", str(answer[1])[:200])
        if kind not in expect:
            self.problems.append(f"{attack}: expected {'/'.join(expect)}, got {kind}: {str(answer[1])[:200]}")


def _spoil_values(arr: np.ndarray, how: str) -> np.ndarray:
    a = arr.astype(np.float32, copy=True)
    a.reshape(-1)[len(a.reshape(-1)) // 2] = {"nan": np.nan, "inf": np.inf, "huge": 1e30}[how]
    return a


# A small well-formed activation for the attacks that need no real shapes (they fail before shapes count).
_SMALL = {"z": np.linspace(-1, 1, 2 * 4 * 3, dtype=np.float32).reshape(2, 4, 3), "y": np.array([1, 2]), "split": 1}


def request_chunked(ix: Intruder, topic: str, payload: bytes, timeout: float = 120.0) -> tuple[str, Any]:
    """``payload`` as one request in 200 kB chunks (how a big message travels: its id names the sender
    whose topic it is on), and its answer."""
    cid = ix.cid()
    for part in split_message(payload, max_chunk=200_000, msg_id=f"{topic.rsplit('/', 1)[-1]}#{cid}"):
        ix.publish(topic, frame("req", cid, chunk=part))
    return ix.wait(cid, timeout)


def misdeclared(ix: Intruder, rep: Report, *, victim: str, mb: int, round: int, log: Any = print) -> None:
    """``mb`` MiB of int8 bytes declared float64 (8x the bytes once decoded), as an activation of the
    victim for ``round``: refused before any float64 array exists (docs/protocol.md, "Check before
    decode"); the coordinator's peak RSS is reported beside the clean run's."""
    n = mb * 2**20
    z = {"__t": 1, "dtype": "float64", "shape": [n // 64, 64], "data": bytes(n), "enc": "int8", "scale": 0.5}
    body = {"z": z, "y": tensor(np.zeros(n // 64, np.int64)[:2]), "split": 2}
    payload = pack("activation", body, run=ix.run, round=round, seq=10**12, sender=victim)
    started = time.monotonic()
    # refused either way: on the tensor's decode budget ("error"), or, when other partial messages fill the
    # reassembly cap (after the flood), by the transport before it is whole ("err")
    rep.note(f"misdeclared_{mb}MiB", request_chunked(ix, f"{ix.base}/up/{victim}", payload), expect=("error", "err"))
    got = rep.examples.get(f"misdeclared_{mb}MiB/error") or rep.examples.get(f"misdeclared_{mb}MiB/err", "?")
    log(f"[hostile] {mb} MiB of int8 declared float64: {got[:160]} "
        f"({time.monotonic() - started:.1f} s)")


def attack_idle(ix: Intruder, rep: Report, *, victim: str, other: str, examples: int, seed: int = 0) -> None:
    """The coordinator serves, no round runs yet: garbage, wrong types, disallowed dtypes, terabyte
    shapes, other names, another run, and a hypothesis fuzz of mutated and random messages.

    Long on purpose (over 80 lines): a flat list of attacks, each two lines, that docs/protocol.md's
    table of refusals can be checked against one by one."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    run, up = ix.run, f"{ix.base}/up"
    seqs = itertools.count(10**9)
    small = wire(_SMALL)
    for junk in (b"", b"\x00" * 10, os.urandom(64), msgpack.packb([1, 2, 3]), frame("req", "x" * 100, p=b""),
                 msgpack.packb({"tf": 1, "op": "req", "cid": "c", "p": [[]] * 1000}),
                 msgpack.packb({"tf": 1, "op": "req", "cid": "c", "p": b"", "x": 1})):
        ix.publish(f"{up}/intruder", junk)  # not a frame: nobody to answer, dropped and counted (garbage)
        rep.sent["garbage_frame"] = rep.sent.get("garbage_frame", 0) + 1
    rep.note("garbage_payload", ix.request(f"{up}/intruder", os.urandom(200)), expect=("error",))
    wrong = {"v": "1", "kind": 7, "run": None, "round": "1", "seq": -1, "sender": ["x"], "body": [1]}
    for key, value in wrong.items():
        env = {"kind": "activation", "run": run, "round": 1, "seq": next(seqs), "sender": victim} | {key: value}
        rep.note(f"wrong_type:{key}", ix.request(f"{up}/{victim}", pack(body=env.pop("body", small), **env)),
                 expect=("error",))
    for key, value in {"z": "zzz", "y": [1, 2], "split": "2"}.items():
        rep.note(f"wrong_type:body.{key}", ix.request(f"{up}/{victim}", pack(
            "activation", small | {key: value}, run=run, round=1, seq=next(seqs), sender=victim)), expect=("error",))
    for kind, b in (("update", {"weights": "all", "num_samples": "many"}), ("probe", {"z1": 1}),
                    ("fetch", {"blocks": "everything"}), ("gradient", {}), ("hello", {"backend": 1})):
        rep.note(f"wrong_type:{kind}", ix.request(f"{up}/{victim}", pack(
            kind, b, run=run, round=1, seq=next(seqs), sender=victim)), expect=("error",))
    for name, t in (("disallowed_dtype", tensor(_SMALL["z"], dtype="complex64")),
                    ("object_dtype", tensor(_SMALL["z"], dtype="object")),
                    ("terabyte_shape", tensor(_SMALL["z"], shape=[2**20, 2**20, 2**10])),
                    ("zero_size_giant", tensor(np.zeros(0, np.float32), shape=[0, 2**62]))):
        rep.note(name, ix.request(f"{up}/{victim}", pack("activation", small | {"z": t}, run=run, round=1,
                                                         seq=next(seqs), sender=victim)), expect=("error",))
    rep.note("claims_another_device", ix.request(f"{up}/intruder", pack(
        "activation", small, run=run, round=1, seq=1, sender=other)), expect=("error",))
    rep.note("wrong_run", ix.request(f"{up}/{victim}", pack(
        "activation", small, run="another-run", round=1, seq=next(seqs), sender=victim)), expect=("error",))
    rep.note("unknown_hello", ix.request(f"{up}/intruder", pack(
        "hello", {"backend": "torch", "num_samples": 479}, run=run, round=0, seq=1, sender="intruder")),
        expect=("error",))

    templates = [encode(Message(k, run, 1, 5, "intruder", b)) for k, b in (
        ("activation", _SMALL), ("update", {"weights": {"blocks.0.w": np.ones((3, 3), np.float32)}, "num_samples": 9,
                                           "train_loss": 0.1, "depth": 1, "split": 1}),
        ("fetch", {"blocks": [0, 1]}), ("hello", {"backend": "torch", "num_samples": 479}),
        ("probe", {"z1": _SMALL["z"], "zref": _SMALL["z"], "y": _SMALL["y"], "o": [0.1, 0.2], "r_prev": 0.3}))]
    outcome: list[tuple[str, tuple[str, Any]]] = []

    @hseed(seed)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data: st.DataObject) -> None:
        what = data.draw(st.sampled_from(["mutated", "mutated", "random_msg", "random_bytes"]))
        if what == "mutated":  # a well-formed message, bytes flipped, cut or doubled
            raw = bytearray(data.draw(st.sampled_from(templates)))
            for _ in range(data.draw(st.integers(1, 4))):
                pos = data.draw(st.integers(0, len(raw) - 1))
                op = data.draw(st.sampled_from(["flip", "flip", "cut", "dup"]))
                if op == "flip":
                    raw[pos] ^= data.draw(st.integers(1, 255))
                elif op == "cut":
                    del raw[pos:]
                else:
                    raw += raw[pos:pos + 16]
                if not raw:
                    raw = bytearray(b"\xc0")
            who = data.draw(st.sampled_from(["intruder", "nobody"]))
            outcome.append((what, ix.request(f"{up}/{who}", bytes(raw), timeout=10)))
        elif what == "random_msg":  # a random kind and body, from a name the run does not know, or claimed
            kind = data.draw(st.sampled_from(["activation", "update", "probe", "fetch", "hello", "bye", "error",
                                              "round_start", "gradient", "ack"]))
            b = data.draw(st.dictionaries(st.sampled_from(["z", "y", "split", "weights", "blocks", "reason",
                                                           "backend", "num_samples", "x"]),
                                          st.one_of(st.none(), st.integers(-9, 9), st.floats(), st.text(max_size=5),
                                                    st.lists(st.integers(0, 5), max_size=3)), max_size=4))
            claim = data.draw(st.sampled_from(["intruder", victim, other]))
            outcome.append((what, ix.request(f"{up}/intruder", pack(
                kind, b, run=run, round=data.draw(st.integers(0, 3)), seq=data.draw(st.integers(0, 2**40)),
                sender=claim), timeout=10)))
        else:
            ix.publish(data.draw(st.sampled_from([f"{up}/intruder", f"{up}/{victim}"])),
                       data.draw(st.binary(max_size=300)))
            outcome.append((what, ("none", None)))

    fuzz()
    for what, answer in outcome:  # frames always parse here, so every request is answered
        rep.note(f"fuzz:{what}", answer, expect=("error",) if what != "random_bytes" else ("none",))


def attack_device(ix: Intruder, rep: Report, *, victim: str, other: str, examples: int, seed: int = 0) -> None:
    """The victim device is up: orders no coordinator would give, on its down topic."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed
    from hypothesis import strategies as st

    run, down = ix.run, f"{ix.base}/down"
    outcome: list[tuple[str, Any]] = []

    @hseed(seed + 1)
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.data())
    def fuzz(data: st.DataObject) -> None:
        if data.draw(st.integers(0, 4)) == 0:
            ix.publish(f"{down}/{victim}", data.draw(st.binary(max_size=300)))  # not a frame: garbage
            rep.sent["device:garbage"] = rep.sent.get("device:garbage", 0) + 1
            return
        kind = data.draw(st.sampled_from(["round_start", "round_start", "activation", "weights", "hello", "ack"]))
        b = data.draw(st.sampled_from([{}, {"split": "x"}, {"train": 1, "weights": {}}, {"weights": []},
                                       {"split": 1, "train": {"lr": "fast"}, "weights": {}},
                                       {"split": 1, "train": {"warp": 9}, "weights": {}},
                                       {"full": True, "train": {}, "weights": "all"}]))
        claim = data.draw(st.sampled_from(["coordinator", "coordinator", other]))
        run_ = data.draw(st.sampled_from([run, run, "another-run"]))
        outcome.append(ix.request(f"{down}/{victim}", pack(
            kind, b, run=run_, round=data.draw(st.sampled_from([0, 1, 2, 3, 2**40])),
            seq=data.draw(st.integers(0, 2**40)), sender=claim), timeout=10))

    fuzz()
    for answer in outcome:  # a device answers a refused order with an error message
        rep.note("device:orders", answer, expect=("error",))
    # Well-formed orders no coordinator gives: a round far in the future (it would make every real
    # round look stale), a bye for it, and a bye claiming another device (docs/protocol.md, "Faults").
    good = {"split": 1, "full": False, "train": {"lr": 0.1}, "weights": {}, "fedsga": None}
    for name, kind, b, rnd, claim in (("forged_round_start_2^64-1", "round_start", good, 2**64 - 1, "coordinator"),
                                      ("forged_bye_far_round", "bye", {}, 2**64 - 1, "coordinator"),
                                      ("forged_bye_from_a_device", "bye", {}, 1, other)):
        rep.note(name, ix.request(f"{down}/{victim}", pack(kind, b, run=run, round=rnd, seq=2**40, sender=claim),
                                  timeout=10), expect=("error",))


def attack_rounds(ix: Intruder, rep: Report, run_dir: Path, *, victim: str, other: str, log: Any = print,
                  misdeclared_mb: int = 100) -> None:
    """Round 1 runs: the must-show, poisoned activations, replays; round 2: round 1's requests again
    (stale)."""
    run, up = ix.run, f"{ix.base}/up"
    act = ix.honest("activation", victim, round=1)  # the template: the victim's first real activation
    t, body = act.msg.round, dict(act.msg.body)
    seq = act.msg.seq + 10**9  # refused messages never move a device's seq on
    nan_body = wire(body | {"z": _spoil_values(body["z"], "nan")})
    rep.must_show["nan_activation"] = ix.request(f"{up}/{victim}", pack(
        "activation", nan_body, run=run, round=t, seq=seq, sender=victim))
    rep.must_show["unknown_device"] = ix.request(f"{up}/intruder", pack(
        "activation", wire(body), run=run, round=t, seq=1, sender="intruder"))
    rep.must_show["other_round"] = ix.request(f"{up}/{victim}", pack(
        "activation", wire(body), run=run, round=t + 1, seq=seq + 1, sender=victim))
    for name, want in (("nan_activation", "non-finite"), ("unknown_device", "not a device"),
                       ("other_round", "round")):
        got = rep.must_show[name]
        if got[0] != "error" or want not in str(got[1]):
            rep.problems.append(f"must-show {name}: expected an error naming {want!r}, got {got}")
    log(f"[hostile] must-show: {rep.must_show}")
    if misdeclared_mb:
        misdeclared(ix, rep, victim=victim, mb=misdeclared_mb, round=t, log=log)

    seqs = itertools.count(seq + 2)
    poison = {
        "inf_activation": nan_body | {"z": tensor(_spoil_values(body["z"], "inf"))},
        "huge_activation": nan_body | {"z": tensor(_spoil_values(body["z"], "huge"))},
        "labels_out_of_range": wire(body | {"y": np.full_like(body["y"], 10**6)}),
        "negative_labels": wire(body | {"y": -np.ones_like(body["y"])}),
        "float_labels": wire(body | {"y": body["y"].astype(np.float32)}),
        "oversized_batch": wire(body | {"z": np.concatenate([body["z"]] * 3), "y": np.concatenate([body["y"]] * 3)}),
        "split_out_of_range": wire(body | {"split": 99}),
    }
    for name, b in poison.items():
        rep.note(name, ix.request(f"{up}/{victim}", pack("activation", b, run=run, round=t, seq=next(seqs),
                                                         sender=victim)), expect=("error",))
    act.answered.wait(60)
    for f in act.frames:  # the very same frames again: QoS 1 duplicates, dropped by the transport
        ix.publish(f"{up}/{act.sender}", f)
    rep.sent["replay_same_frames"] = 1
    rep.note("replay_new_frame_id", ix.request(f"{up}/{act.sender}", act.payload, timeout=60),
             expect=("gradient", "error"))  # the cached reply (the step is not taken again), or a refusal
    changed = bytearray(act.payload)
    changed[-1] ^= 1  # same (sender, seq), other bytes: the Peer handles it afresh, as after a cache turnover
    rep.note("replay_changed_byte", ix.request(f"{up}/{act.sender}", bytes(changed), timeout=60), expect=("error",))

    wait_for(lambda: _round_begun(run_dir, 2), 600, "round 2")
    old = [c for c in ix.captured if c.msg.round == 1 and c.answered.is_set() and c.sender in (victim, other)
           and c.msg.kind in ("activation", "fetch", "update", "probe")]
    for c in old[:8]:  # round 1's requests in round 2, a byte changed so the Peer's cache does not answer
        if logged(run_dir, "run_end"):
            rep.problems.append("stale-round replays came after the run ended (the run was faster than the intruder)")
            break
        changed = bytearray(c.payload)
        changed[-1] ^= 1
        rep.note("stale_round", ix.request(f"{up}/{c.sender}", bytes(changed), timeout=30), expect=("error",))


def flood(ix: Intruder, rep: Report, flood_mb: int, *, log: Any = print) -> list[tuple[str, str, bytes]]:
    """Floods of partial chunked messages from three made-up senders: 300 half-sent ones declaring
    100 MiB each, then ``flood_mb`` MiB of real part bytes in 8 MiB messages never finished. Returns
    (topic, cid, first chunk's frame) of each, for ``touch``."""
    up = f"{ix.base}/up"
    started = time.monotonic()
    firsts: list[tuple[str, str, bytes]] = []
    for k in range(300):
        cid = ix.cid()
        f = frame("req", cid, chunk=_partial_chunk(f"flood-{k % 3}#{cid}", total=100 * 2**20, part=os.urandom(2048)))
        ix.publish(f"{up}/flood-{k % 3}", f)
        firsts.append((f"{up}/flood-{k % 3}", cid, f))
    per, junk, chunks = flood_mb * 2**20 // 3, os.urandom(8 * 2**20), 0
    for k in range(3):
        sent = 0
        while sent < per:
            cid = ix.cid()
            parts = split_message(junk, max_chunk=200_000, msg_id=f"flood-{k}#{cid}")[:-1]
            firsts.append((f"{up}/flood-{k}", cid, frame("req", cid, chunk=parts[0])))
            for c in parts:
                ix.publish(f"{up}/flood-{k}", frame("req", cid, chunk=c))
                sent, chunks = sent + len(c), chunks + 1
                if sent >= per:
                    break
    rep.sent["flood:half_sent_messages"] = len(firsts)
    rep.sent["flood:chunks"] = 300 + chunks
    log(f"[hostile] flood: {len(firsts)} half-sent messages ({flood_mb} MiB of parts) from 3 made-up senders in "
        f"{time.monotonic() - started:.1f} s")
    touch(ix, rep, firsts, "flood:evicted_by_the_flood", log=log)
    return firsts


def touch(ix: Intruder, rep: Report, firsts: list[tuple[str, str, bytes]], tag: str, *, log: Any = print) -> int:
    """Send each half-sent message's first chunk once more: one the coordinator evicted since answers
    with an ``err`` frame saying so (once); one it still holds stays silent (a duplicate chunk)."""
    for topic, _, f in firsts:
        ix.publish(topic, f)
    # The coordinator may still be working through the flood: wait up to 120 s for the first answer,
    # then 10 s more for the rest (the ones it still holds never answer).
    deadline, evicted = time.monotonic() + 120, 0
    for _, cid, _ in firsts:
        op, why = ix.wait(cid, max(0.0, deadline - time.monotonic()))
        if op != "none":
            deadline = min(deadline, time.monotonic() + 10)
        evicted += op == "err" and "evicted" in str(why)
    rep.answers[tag] = {"err": evicted, "silent": len(firsts) - evicted}
    log(f"[hostile] {tag}: {evicted} of {len(firsts)} half-sent messages")
    return evicted


def _partial_chunk(msg_id: str, *, total: int, part: bytes) -> bytes:
    """Chunk 0 of a message that will never be finished (passes the transport's chunk checks)."""
    n = -(-total // 200_000)
    return msgpack.packb({"v": 1, "id": msg_id, "i": 0, "n": n, "total": total, "crc": zlib.crc32(part),
                          "part": part}, use_bin_type=True)


def _round_begun(run_dir: Path, t: int) -> bool:
    return any(e.get("event") == "round_begin" and e.get("round") == t for e in read_jsonl(run_dir / "coordinator.log"))


def wait_for(probe: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def logged(run_dir: Path, event: str, **fields: Any) -> bool:
    return any(e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
               for e in read_jsonl(run_dir / "coordinator.log"))


# -- running a field run in stages, with and without the intruder -------------------------------------------

class RssSampler:
    """Peak resident set size per role, sampled every 0.1 s (psutil)."""

    def __init__(self) -> None:
        self.procs: dict[int, str] = {}
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            for pid, role in list(self.procs.items()):
                try:
                    self.peak[role] = max(self.peak.get(role, 0), psutil.Process(pid).memory_info().rss)
                except psutil.Error:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def run_field(out: Path, broker: RunningBroker, flags: list[str], clients: int, *, hostile: dict[str, Any] | None = None,
              log: Any = print) -> dict[str, Any]:
    """``fedsga-edge coordinator`` and ``fedsga-edge device`` x ``clients`` on ``broker``, started in
    stages: the coordinator, then device 0, then the others (their registration starts round 1). With
    ``hostile`` (``examples``, ``flood_mb``, ``run``) an intruder attacks between the stages and during
    the rounds. Returns exit codes, summary, metrics, peak RSS per role, the peak bytes the coordinator's
    transport held (``held``: reassembly, queued) and the intruder's report.

    Long on purpose (over 80 lines): the stages of one field run, in the order they happen, read best
    top to bottom; split, the order would be spread over functions that each make sense only in it."""
    if out.exists():
        shutil.rmtree(out)
    (out / "logs").mkdir(parents=True)
    base = [sys.executable, "-m", "fedsga_edge.cli.main"]
    started = time.monotonic()
    rss = RssSampler()
    procs: dict[str, subprocess.Popen] = {}

    def spawn(name: str, args: list[str]) -> None:
        cmd = [sys.executable, "-c", HELD] if name == "coordinator" else base
        with open(out / "logs" / f"{name}.out", "w") as f:
            procs[name] = subprocess.Popen(cmd + args, stdout=f, stderr=subprocess.STDOUT,
                                           env=os.environ | {"COLUMNS": "200", "FEDSGA_HELD_FILE": str(out / "held.json")})
        rss.procs[procs[name].pid] = "coordinator" if name == "coordinator" else "device"

    def device(i: int) -> None:
        spawn(f"device-{i:03d}", ["device", "--broker", broker.url, "--index", str(i), "--state-dir",
                                  str(out / "devices" / f"client-{i:03d}"), "--threads", "1", *flags])

    def alive_wait(what: str, probe: Any, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while not probe():
            dead = [n for n, p in procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"waiting for {what}: " + (f"{dead} exited" if dead else "timed out"))
            time.sleep(0.1)

    devices = [f"client-{i:03d}" for i in range(clients)]
    rep = Report() if hostile is not None else None
    error = None
    ix = None
    try:
        spawn("coordinator", ["coordinator", "--broker", broker.url, "--run-dir", str(out), "--threads", "1",
                              "--register-timeout", "900", *flags])
        alive_wait("the coordinator to serve", lambda: logged(out, "service_open"))
        if hostile is not None:
            ix = Intruder("127.0.0.1", broker.port, run=hostile["run"])
            try:
                attack_idle(ix, rep, victim=devices[0], other=devices[-1], examples=hostile["examples"])
                log(f"[hostile] before any device: {sum(rep.sent.values())} hostile messages, problems: {rep.problems[:3]}")
            except Exception as exc:  # noqa: BLE001 - reported as a failed check; the run goes on
                error = f"attack_idle: {type(exc).__name__}: {exc}"
        device(0)
        if ix is not None:
            alive_wait("device 0 to register", lambda: logged(out, "hello_ack", device=devices[0]))
        if ix is not None and error is None:
            try:
                attack_device(ix, rep, victim=devices[0], other=devices[-1], examples=max(hostile["examples"] // 3, 10))
                log(f"[hostile] device {devices[0]}'s orders: {rep.answers.get('device:orders')}")
            except Exception as exc:  # noqa: BLE001 - reported as a failed check; the run goes on
                error = f"attack_device: {type(exc).__name__}: {exc}"
        # The flood comes while the coordinator holds round 1 for the devices still to register: then it
        # is certainly alive to answer the touch. (Run beside round 1, a fast machine finished the whole
        # run before the flood got through, and nothing was there to evict it.) Round 1's traffic then
        # queues behind the flood and must get through.
        if ix is not None and error is None:
            try:
                flood(ix, rep, hostile["flood_mb"], log=log)
            except Exception as exc:  # noqa: BLE001 - reported as a failed check; the run goes on
                error = f"flood: {type(exc).__name__}: {exc}"
        for i in range(1, clients):
            device(i)
        if ix is not None and error is None:
            try:
                attack_rounds(ix, rep, out, victim=devices[0], other=devices[-1], log=log,
                              misdeclared_mb=hostile.get("misdeclared_mb", 100))
            except Exception as exc:  # noqa: BLE001 - reported as a failed check; the run goes on
                error = f"attack_rounds: {type(exc).__name__}: {exc}"
        procs["coordinator"].wait(900)
        for p in procs.values():
            p.wait(60)
    finally:
        if ix is not None:
            ix.close()
        for p in procs.values():
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
        rss.close()
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    held = json.loads((out / "held.json").read_text()) if (out / "held.json").exists() else {}
    return {"rc": {n: p.returncode for n, p in procs.items()}, "summary": summary,
            "metrics": read_jsonl(out / "metrics.jsonl"), "peak_rss": rss.peak, "held": held, "report": rep,
            "attack_error": error, "wall_s": round(time.monotonic() - started, 1)}


def compare(clean: Path, hostile: Path) -> dict[str, Any]:
    """Accuracy per round and every tensor of the final checkpoints, bit for bit."""
    import torch

    a = torch.load(clean / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    b = torch.load(hostile / "checkpoint.pt", map_location="cpu", weights_only=True)["model"]
    differ = [k for k in a if k not in b or not torch.equal(a[k], b[k])]
    acc_a = [r.get("test_acc") for r in read_jsonl(clean / "metrics.jsonl")]
    acc_b = [r.get("test_acc") for r in read_jsonl(hostile / "metrics.jsonl")]
    loss_a = [r.get("train_loss") for r in read_jsonl(clean / "metrics.jsonl")]
    loss_b = [r.get("train_loss") for r in read_jsonl(hostile / "metrics.jsonl")]
    return {"acc_clean": acc_a, "acc_hostile": acc_b, "train_loss_equal": loss_a == loss_b,
            "weights_differ": differ[:10], "bit_identical": not differ and acc_a == acc_b and loss_a == loss_b}


def checks(clean: dict[str, Any], hostile: dict[str, Any], cmp: dict[str, Any], run_dir: Path) -> list[dict[str, Any]]:
    """What docs/protocol.md promises, as named pass/fail checks (every one must hold)."""
    out = []

    def check(name: str, ok: bool, detail: Any = None) -> None:
        out.append({"check": name, "ok": bool(ok), "detail": detail})

    rep: Report | None = hostile["report"]
    check("the attack ran to its end", hostile["attack_error"] is None and rep is not None, hostile["attack_error"])
    check("every process of both runs exited 0", all(v == 0 for r in (clean, hostile) for v in r["rc"].values()),
          (clean["rc"], hostile["rc"]))
    check("every hostile request was refused as expected", rep is not None and not rep.problems,
          rep.problems[:10] if rep else None)
    events = read_jsonl(run_dir / "coordinator.log")
    refused = [e for e in events if e.get("event") == "request_refused"]
    rejected = [e for e in events if e.get("event") == "message_rejected"]
    # refused by the Coordinator (request_refused) or already on the envelope, before decode (message_rejected)
    reasons = " | ".join(str(e.get("reason")) for e in refused + rejected)
    check("coordinator.log names the must-show refusals", all(w in reasons for w in
                                                              ("non-finite", "not a device", "round")), reasons[:300])
    check("coordinator.log has the Peer's rejections", len(rejected) >= 3, len(rejected))
    end = next((e for e in reversed(events) if e.get("event") == "run_end"), {})
    counters = end.get("transport_counters", {})
    check("the coordinator counted them", end.get("remote_errors", 0) >= len(refused) > 0
          and end.get("peer_errors", 0) > 0 and counters.get("garbage", 0) > 0, {k: end.get(k) for k in (
              "remote_errors", "peer_errors", "transport_counters")})
    flooded = (rep.answers.get("flood:evicted_by_the_flood") or {}) if rep else {}
    check("the flood hit the reassembly cap: flood messages were evicted (counted as rejected)",
          flooded.get("err", 0) > 0 and counters.get("rejected", 0) > 0,
          {"touched": flooded, "rejected": counters.get("rejected")})
    logs = "".join((run_dir / "logs" / n).read_text(errors="replace") for n in os.listdir(run_dir / "logs")
                   if n.endswith(".out"))
    check("no process crashed (no traceback in any log)", "Traceback" not in logs)
    device_log = (run_dir / "logs" / "device-000.out").read_text(errors="replace")
    check("the attacked device logged its rejections", "rejected" in device_log)
    check("every device in every round", all(not r.get("failures") for r in hostile["metrics"])
          and len(hostile["metrics"]) == len(clean["metrics"]), [r.get("failures") for r in hostile["metrics"]])
    check("same final accuracy", clean["summary"].get("final_acc") == hostile["summary"].get("final_acc"),
          (clean["summary"].get("final_acc"), hostile["summary"].get("final_acc")))
    check("bit-identical weights and metrics", cmp["bit_identical"], cmp)
    # What the transport holds, measured in the coordinator (HELD): the flood filled the reassembly buffer
    # to at least half the cap (else the cap was never tested) and never past it; queued handler payloads
    # stayed under the same cap. RSS rides along for the reader.
    held = hostile.get("held") or {}
    got, queued = held.get("reassembly", -1), held.get("queued", -1)
    check(f"coordinator's transport held at most {REASSEMBLY_CAP >> 20} MiB of partial messages (the flood "
          f"reached over half of it) and at most {REASSEMBLY_CAP >> 20} MiB of queued payloads",
          REASSEMBLY_CAP // 2 <= got <= REASSEMBLY_CAP and 0 < queued <= REASSEMBLY_CAP,
          {"reassembly_bytes": got, "queued_bytes": queued, "cap_bytes": REASSEMBLY_CAP,
           "clean_reassembly_bytes": (clean.get("held") or {}).get("reassembly"),
           "rss_mb": {"clean": clean["peak_rss"].get("coordinator", 0) >> 20,
                      "hostile": hostile["peak_rss"].get("coordinator", 0) >> 20}})
    return out


def run_pair(out: Path, *, clients: int = 2, rounds: int = 2, examples: int = 150, flood_mb: int = 160,
             misdeclared_mb: int = 100,
             concurrent: bool = False, log: Any = print) -> dict[str, Any]:
    """The clean run and the attacked one (each on its own broker; ``concurrent``: at the same time),
    compared bit for bit and checked; see the module doc."""
    flags = [*TINY, "--clients", str(clients), "--rounds", str(rounds)]
    out.mkdir(parents=True, exist_ok=True)
    brokers = [start_broker(out / "broker-clean"), start_broker(out / "broker-hostile")]
    runs: dict[str, dict[str, Any]] = {}
    try:
        def clean() -> None:
            runs["clean"] = run_field(out / "clean", brokers[0], flags, clients)
            log(f"[hostile] clean run: exit {runs['clean']['rc']}, acc {runs['clean']['summary'].get('final_acc')}, "
                f"{runs['clean']['wall_s']} s")

        side = threading.Thread(target=clean, daemon=True) if concurrent else None
        if side is not None:
            side.start()
        else:
            clean()
        runs["hostile"] = run_field(out / "hostile", brokers[1], flags, clients, log=log, hostile={
            "run": "sim-0",  # the run id of seed 0 (fedsga_edge.runbuild.default_run_id)
            "examples": examples, "flood_mb": flood_mb, "misdeclared_mb": misdeclared_mb})
        if side is not None:
            side.join()
    finally:
        for b in brokers:
            b.stop()
    cmp = compare(out / "clean", out / "hostile")
    return {"clean": runs["clean"], "hostile": runs["hostile"], "compare": cmp,
            "checks": checks(runs["clean"], runs["hostile"], cmp, out / "hostile")}


# -- a device's own login against the other devices and the coordinator --------------------------------------

LOGIN_RUN = "sim-0"


def stolen_login(broker: RunningBroker, log_dir: Path, device: str) -> str:
    """``device``'s password as a compromised device would have it: from the trial's ``broker.toml``
    (embedded) or its ``credentials/<device>.env`` (Mosquitto, ``broker-config``'s files)."""
    import tomllib
    from urllib.parse import unquote, urlsplit

    if broker.kind == "embedded":
        conf = tomllib.loads((log_dir / "broker.toml").read_text())
        return conf["v4"]["1"]["connections"]["auth"][device]
    env = (log_dir / "broker" / "credentials" / f"{device}.env").read_text()
    return unquote(urlsplit(env.split("=", 1)[1].strip()).password or "")


class _Victim:
    """An MQTT party of the run (the coordinator or a device) that records every message it acts on."""

    def __init__(self, broker: RunningBroker, me: str, keys: dict[str, bytes] | None, encrypt: bool) -> None:
        from fedsga_edge.transport import Peer
        from fedsga_edge.transport.mqtt import MqttTransport
        from fedsga_edge.transport.sealed import SealedTransport
        from fedsga_edge.wire.auth import Keyring

        self.mqtt = MqttTransport.from_url(broker.url_for(me), run=LOGIN_RUN, client_id=me, request_timeout=5)
        t: Any = self.mqtt if keys is None else SealedTransport(self.mqtt, Keyring(me, keys, encrypt=encrypt), LOGIN_RUN)
        self.peer = Peer(t, me, LOGIN_RUN)
        self.acted: list[Message] = []
        self.peer.register(self._on)

    def _on(self, m: Message) -> Message | None:
        self.acted.append(m)
        if m.kind in ("activation", "hello"):
            return self.peer.reply(m, "ack", {"ok": True})
        return None

    def close(self) -> None:
        self.peer.transport.close()


def _spy(broker: RunningBroker, login: str, password: str,
         client_id: str) -> tuple[Any, list[tuple[str, bytes]], list[str]]:
    """A paho client with a stolen login that subscribes to ``#``: what it hears, and its disconnects."""
    import paho.mqtt.client as mqtt
    from paho.mqtt.enums import CallbackAPIVersion

    heard: list[tuple[str, bytes]] = []
    events: list[str] = []
    c = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id)
    c.username_pw_set(login, password)
    c.on_message = lambda cl, ud, m: heard.append((m.topic, bytes(m.payload)))
    c.on_connect = lambda cl, ud, fl, rc, pr=None: (events.append(f"connect:{rc}"), cl.subscribe("#", qos=1))
    c.on_disconnect = lambda cl, ud, fl, rc, pr=None: events.append(f"disconnect:{rc}")
    c.connect(broker.host, broker.port)
    c.loop_start()
    time.sleep(0.5)
    return c, heard, events


def login_attacks(out: Path, kind: str, *, sealed: bool = True, encrypt: bool = False) -> dict[str, Any]:
    """One login scenario on broker ``kind`` (embedded | mosquitto): client-000's own login (and, when
    the run seals, its own key) against client-001 and the coordinator. Figures:

    * ``tensors_read``: messages heard on ``#`` that hold the bytes of client-001's activation or of its
      round_start's weights (0: nothing of another device's tensors was read);
    * ``forged_orders_acted``: forged ``bye`` / ``round_start`` for client-001 (plain, sealed with client-000's
      key as if the coordinator's, and the coordinator's own round_start replayed) that client-001 acted on;
    * ``forged_requests_acted``: an activation claiming client-001 that the coordinator acted on;
    * ``coordinator_disconnects``: times the coordinator's session dropped while the spy used client id
      ``coordinator``; ``coordinator_answers``: client-001's request after that still answered."""
    from fedsga_edge.broker.launch import RunLogins, start_embedded, start_secured_mosquitto
    from fedsga_edge.wire.auth import Keyring, make_key

    log_dir = out / f"{kind}-{'enc' if encrypt else 'mac' if sealed else 'plain'}"
    logins = RunLogins.generate(["client-000", "client-001"])
    keys = {d: make_key() for d in ("client-000", "client-001")}
    start = (lambda: start_embedded(log_dir, logins=logins)) if kind == "embedded" else (
        lambda: start_secured_mosquitto(log_dir, logins, run=LOGIN_RUN))
    weights = np.full(257, 31337.25, np.float32)
    act = np.full(263, -4242.5, np.float32)
    marks = (weights.tobytes()[:64], act.tobytes()[:64])
    res: dict[str, Any] = {"broker": kind, "sealed": sealed, "encrypt": encrypt}
    with start() as broker:
        password = stolen_login(broker, log_dir, "client-000")
        coord = _Victim(broker, "coordinator", keys if sealed else None, encrypt)
        dev = _Victim(broker, "client-001", {"coordinator": keys["client-001"]} if sealed else None, encrypt)
        spy, heard, _ = _spy(broker, "client-000", password, "client-000")
        try:
            coord.peer.send("client-001", "round_start", 1, {"weights": {"w": weights}})
            rep = dev.peer.call("coordinator", "activation", 1, {"z": act, "y": np.zeros(263, np.int64), "split": 1})
            time.sleep(1.0)
            res["honest_ok"] = rep.kind == "ack" and [m.kind for m in dev.acted] == ["round_start"]
            res["messages_heard"] = len(heard)
            res["tensors_read"] = sum(any(mk in h for mk in marks) for _, h in heard)
            res.update(_forge(spy, heard, dev, coord, keys["client-000"], encrypt))
        finally:
            spy.disconnect()
            spy.loop_stop()
        res.update(_takeover(broker, password, coord, dev))
        for v in (dev, coord):
            v.close()
    return res


def _forge(spy: Any, heard: list[tuple[str, bytes]], dev: _Victim, coord: _Victim, own_key: bytes, encrypt: bool) -> dict[str, Any]:
    """Forged orders to client-001 and a forged request to the coordinator, from client-000's login and key."""
    from fedsga_edge.wire.auth import Keyring

    down, up = f"fedsga/{LOGIN_RUN}/down/client-001", f"fedsga/{LOGIN_RUN}/up/client-001"
    bye = encode(Message("bye", LOGIN_RUN, 1, 10_000, "coordinator", {"reason": "forged"}))
    start = encode(Message("round_start", LOGIN_RUN, 2, 10_001, "coordinator", {"weights": {}}))
    as_coord = Keyring("coordinator", {"client-001": own_key}, encrypt=encrypt)  # its own key, another's name
    forged = [bye, start, as_coord.seal("client-001", bye), as_coord.seal("client-001", start)]
    orders = [frame("req", f"forge-{i}", p=p) for i, p in enumerate(forged)]
    orders += [h for topic, h in heard if topic == down]  # the coordinator's own round_start, replayed whole
    before_dev, before_coord = len(dev.acted), len(coord.acted)
    for f in orders:
        spy.publish(down, f, qos=1).wait_for_publish(5)
    act = encode(Message("activation", LOGIN_RUN, 1, 10_002, "client-001",
                         {"z": np.zeros(4, np.float32), "y": np.zeros(4, np.int64), "split": 1}))
    own = Keyring("client-000", {"coordinator": own_key}, encrypt=encrypt)
    for i, p in enumerate((act, own.seal("coordinator", act))):
        spy.publish(up, frame("req", f"forge-up-{i}", p=p), qos=1).wait_for_publish(5)
    time.sleep(1.5)
    return {"forged_orders_sent": len(orders), "forged_orders_acted": len(dev.acted) - before_dev,
            "forged_requests_acted": len(coord.acted) - before_coord}


def _takeover(broker: RunningBroker, password: str, coord: _Victim, dev: _Victim) -> dict[str, Any]:
    """The spy connects as client id ``coordinator`` with client-000's login: does the coordinator drop, and
    does it still answer client-001 afterwards (its requests sealed: the spy cannot answer them)?"""
    spy, heard, events = _spy(broker, "client-000", password, "coordinator")
    dropped, deadline = False, time.monotonic() + 1.5
    while time.monotonic() < deadline:
        dropped |= not coord.mqtt.connected
        time.sleep(0.02)
    spy.disconnect()
    spy.loop_stop()
    answered = False
    for _ in range(3):  # its reconnect takes a backoff's seconds on a loaded machine: three tries, 10 s each
        try:
            coord.mqtt.wait_ready(10)
            rep = dev.peer.call("coordinator", "activation", 3,
                                {"z": np.zeros(4, np.float32), "y": np.zeros(4, np.int64), "split": 1}, timeout=10)
            answered = rep.kind == "ack"
            break
        except Exception:  # noqa: BLE001 - a lost coordinator is the figure, not a crash of the benchmark
            continue
    return {"takeover_connected": "connect:Success" in events, "coordinator_dropped": dropped,
            "coordinator_answers": answered}

def main_logins(out: Path, json_path: Path | None) -> int:
    """Every login scenario, one line each; 1 when a sealed run lets a tensor be read or a forgery be acted on
    (on the embedded broker the MAC alone does not hide tensors: only the encrypted run must read nothing)."""
    from fedsga_edge.broker.launch import embedded_available

    kinds = [k for k, ok in (("embedded", embedded_available()), ("mosquitto", MOSQUITTO is not None)) if ok]
    rows, bad = [], 0
    for kind in kinds:
        for sealed, encrypt in ((False, False), (True, False), (True, True)):
            r = login_attacks(out, kind, sealed=sealed, encrypt=encrypt)
            rows.append(r)
            hides = encrypt or kind == "mosquitto"
            fails = sealed and (r["forged_orders_acted"] or r["forged_requests_acted"] or not r["coordinator_answers"]
                                or (hides and r["tensors_read"]))
            bad += bool(fails)
            mode = "encrypted" if encrypt else "MAC" if sealed else "plain"
            print(f"[logins] {'FAILED' if fails else 'ok    '} {kind:9s} {mode:9s} heard {r['messages_heard']} "
                  f"tensors read {r['tensors_read']} forged orders acted {r['forged_orders_acted']}/"
                  f"{r['forged_orders_sent']} forged requests acted {r['forged_requests_acted']}/2 "
                  f"coordinator dropped {r['coordinator_dropped']} answers after {r['coordinator_answers']}", flush=True)
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(rows, indent=2))
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/hostile"))
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--examples", type=int, default=150, help="hypothesis examples against the coordinator "
                                                                "(a third of it against a device)")
    ap.add_argument("--flood-mb", type=int, default=160, help="MiB of half-sent chunks (the reassembly cap is 128)")
    ap.add_argument("--misdeclared-mb", type=int, default=100,
                    help="MiB of int8 bytes declared float64 sent as one activation in round 1 (0: none)")
    ap.add_argument("--concurrent", action="store_true", help="run the clean and the attacked run at the same time")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--logins", action="store_true", help="instead: a device's own login against the others "
                    "(eavesdropping, forged orders, the coordinator's client id) on the embedded broker and on "
                    "Mosquitto, with messages plain, MAC-sealed and encrypted")
    args = ap.parse_args(argv)
    if args.logins:
        return main_logins(args.out, args.json)
    if args.rounds < 2 or args.clients < 2:
        ap.error("--rounds and --clients must be >= 2: stale-round replays need a second round, and the "
                 "device-topic attack a device whose round has not started")
    res = run_pair(args.out, clients=args.clients, rounds=args.rounds, examples=args.examples, flood_mb=args.flood_mb,
                   misdeclared_mb=args.misdeclared_mb, concurrent=args.concurrent, log=lambda s: print(s, flush=True))
    clean, hostile, cmp, rep = res["clean"], res["hostile"], res["compare"], res["hostile"]["report"]
    for c in res["checks"]:
        print(f"[hostile] {'ok    ' if c['ok'] else 'FAILED'} {c['check']}" + ("" if c["ok"] else f": {c['detail']}"))
    print(f"[hostile] sent {sum(rep.sent.values()) if rep else 0} hostile messages; answers: "
          f"{json.dumps(rep.answers) if rep else None}")
    print(f"[hostile] accuracy clean {cmp['acc_clean']} hostile {cmp['acc_hostile']}; peak RSS MiB clean "
          f"{ {k: v >> 20 for k, v in clean['peak_rss'].items()} } hostile "
          f"{ {k: v >> 20 for k, v in hostile['peak_rss'].items()} }; wall s {clean['wall_s']} / {hostile['wall_s']}")
    if args.json:
        args.json.write_text(json.dumps({"checks": res["checks"], "compare": cmp, "clean": {**clean, "report": None},
                                         "hostile": {**hostile, "report": vars(rep) if rep else None}},
                                        indent=2, default=str))
    return 0 if all(c["ok"] for c in res["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
