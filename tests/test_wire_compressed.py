"""``--wire-format int4``: activations and gradients at an eighth of the fp32 bytes.

Per-block 4-bit levels with one float32 scale per ``INT4_BLOCK`` values (docs/protocol.md, "Messages"):
the round trip stays within half a step of each block, the bytes within 0.13 x fp32 on the model's real
interface shapes, malformed int4 tensors are refused with a reason, the torch-free device decodes and
sends int4, and a simulated round runs with it.
"""

from __future__ import annotations

import math
from typing import Any

import msgpack
import numpy as np
import pytest
from _runs import assert_test_accuracy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_device_runtime import _run_without_torch

from fedsga_edge.transport import LoopbackTransport, Peer
from fedsga_edge.wire import INT4_BLOCK, Message, RemoteProtocolError, decode, encode

BATCH = 64  # the benchmarks' batch (benchmarks/accuracy.py --preset cpu)


def _act(z: np.ndarray, batch: int = BATCH) -> Message:
    return Message("activation", "r", 1, 1, "client-000", {"z": z, "y": np.zeros(batch, np.int64), "split": 2})


def _bound(z: np.ndarray) -> np.ndarray:
    """Half a quantisation step per element, from the data alone: max|x| of its block / levels / 2."""
    flat = z.reshape(-1).astype(np.float64)
    levels = 7.0 if (flat < 0).any() else 15.0
    pad = np.zeros(-(-flat.size // INT4_BLOCK) * INT4_BLOCK)
    pad[: flat.size] = np.abs(flat)
    peak = pad.reshape(-1, INT4_BLOCK).max(axis=1)
    return np.repeat(peak / levels / 2, INT4_BLOCK)[: flat.size].reshape(z.shape)


# ------------------------------------------------------------------ round trip


@pytest.mark.parametrize("shape", [(64, 16, 32, 32), (3, 5, 7), (1,), (257,), (2, 0, 3), ()])
@pytest.mark.parametrize("kind", ["relu", "signed", "gradient"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_round_trip_is_within_half_a_step_of_each_block(shape: tuple[int, ...], kind: str, dtype: str) -> None:
    rng = np.random.default_rng(len(shape) * 7 + len(kind))
    z = rng.standard_normal(shape) * rng.choice([1e-3, 1.0, 30.0], size=shape)  # blocks of very different peaks
    z = np.maximum(z, 0) if kind == "relu" else z * 1e-6 if kind == "gradient" else z
    z = np.asarray(z).astype(dtype)
    msg = decode(encode(_act(z), tensor_format="int4"))
    got = msg.body["z"]
    assert got.shape == z.shape and got.dtype == z.dtype and got.flags.writeable
    err = np.abs(got.astype(np.float64) - z.astype(np.float64))
    # float16 output: half an ulp of the decoded value, whose subnormal step is 2**-24
    fp16_rounding = (np.abs(z.astype(np.float64)) + 2 * _bound(z)) * 2**-11 + 2**-25 if dtype == "float16" else 0.0
    assert (err <= _bound(z) * (1 + 1e-5) + fp16_rounding + 1e-30).all(), float(err.max())
    if z.size and kind == "relu":
        assert (got >= 0).all()  # a ReLU's output stays non-negative: the unsigned levels 0..15
    assert np.array_equal(msg.body["y"], np.zeros(BATCH, np.int64))  # labels exact


def test_unsigned_levels_are_twice_as_fine_as_signed_ones() -> None:
    """A tensor without negatives uses 16 levels (step peak/15), one with a negative 15 (step peak/7)."""
    z = np.linspace(0, 1, 4 * INT4_BLOCK, dtype=np.float32)
    e_pos = np.abs(decode(encode(_act(z), tensor_format="int4")).body["z"] - z).max()
    z[0] = -1e-9
    e_sgn = np.abs(decode(encode(_act(z), tensor_format="int4")).body["z"] - z).max()
    assert e_pos <= 1 / 30 * 1.0001 and e_sgn > 1.5 * e_pos


def test_non_finite_values_fail_at_the_sender() -> None:
    from fedsga_edge.wire import LocalProtocolError

    z = np.ones(10, np.float32)
    z[3] = np.nan
    with pytest.raises(LocalProtocolError, match="int4 encoding needs finite values"):
        encode(_act(z), tensor_format="int4")


# ------------------------------------------------------------------ bytes


def test_bytes_are_at_most_013_of_fp32_at_every_split_of_the_model() -> None:
    """The real interface shapes of resnet18_cifar at width 0.25 (the benchmarks' model), batch 64, the
    whole encoded message (envelope and int64 labels included) against the same message in fp32."""
    from fedsga_edge.models import create_model

    model = create_model("resnet18_cifar", num_classes=10, width=0.25)
    rng = np.random.default_rng(0)
    for k in range(1, model.num_splits + 1):
        shape = model.interface_shape(model.depth_of(k))
        z = np.maximum(rng.standard_normal((BATCH, *shape)), 0).astype(np.float32)
        act = len(encode(_act(z), tensor_format="int4")) / len(encode(_act(z)))
        grad_msg = Message("gradient", "r", 1, 2, "coordinator", {"dz": z - 0.5, "loss": 0.0})
        grad = len(encode(grad_msg, tensor_format="int4")) / len(encode(grad_msg))
        assert act <= 0.13 and grad <= 0.13, (k, shape, act, grad)


# ------------------------------------------------------------------ malformed


def _valid_tensor() -> dict[str, Any]:
    z = np.random.default_rng(1).standard_normal((4, 100)).astype(np.float32)  # 400 values: 2 blocks
    return msgpack.unpackb(encode(_act(z), tensor_format="int4"), raw=False)["body"]["z"]


def _pack(z: dict[str, Any]) -> bytes:
    env = {"v": 1, "kind": "activation", "run": "r", "round": 1, "seq": 1, "sender": "client-000",
           "body": {"z": z, "y": {"__t": 1, "dtype": "int64", "shape": [0], "data": b""}, "split": 2}}
    return msgpack.packb(env, use_bin_type=True)


def _nan_scale(t: dict[str, Any]) -> None:
    t["scales"] = np.array([np.nan, 1.0], "<f4").tobytes()


MALFORMED: dict[str, tuple[Any, str]] = {
    "short data": (lambda t: t.update(data=t["data"][:-1]), "needs 200 data bytes"),
    "long data": (lambda t: t.update(data=t["data"] + b"\x11"), "needs 200 data bytes"),
    "short scales": (lambda t: t.update(scales=t["scales"][:4]), "8 scale bytes"),
    "terabyte shape": (lambda t: t.update(shape=[2**40, 2**20]), "needs"),
    "nan scale": (_nan_scale, "scales must be finite"),
    "inf scale": (lambda t: t.update(scales=np.array([np.inf, 1], "<f4").tobytes()), "scales must be finite"),
    "negative scale": (lambda t: t.update(scales=np.array([-1, 1], "<f4").tobytes()), "scales must be finite"),
    "float16 overflow": (lambda t: t.update(dtype="float16", scales=np.array([1e4, 1], "<f4").tobytes()),
                         "overflows float16"),
    "signed not bool": (lambda t: t.update(signed=1), "'signed' must be a bool"),
    "scales not bin": (lambda t: t.update(scales=[1.0, 2.0]), "'scales' must be bin"),
    "no signed": (lambda t: t.pop("signed"), "both and only with it"),
    "no scales": (lambda t: t.pop("scales"), "both and only with it"),
    "scales on int8": (lambda t: t.update(enc="int8", scale=0.1), "both and only with it"),
    "int8 scale on int4": (lambda t: t.update(scale=0.1), "'scale' goes with int8"),
    "float64": (lambda t: t.update(dtype="float64"), "int4 carries"),
    "integer dtype": (lambda t: t.update(dtype="int32"), "only for floating tensors"),
    "nibble 0 signed": (lambda t: t.update(data=b"\x80" + t["data"][1:]), "nibble 0"),
    "high nibble 0 signed": (lambda t: t.update(data=b"\x08" + t["data"][1:]), "nibble 0"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_int4_tensors_are_refused_with_a_reason(case: str) -> None:
    t = _valid_tensor()
    assert t["enc"] == "int4" and t["signed"] is True
    decode(_pack(t))  # the unmutated tensor decodes
    mutate, reason = MALFORMED[case]
    mutate(t)
    with pytest.raises(RemoteProtocolError, match=reason):
        decode(_pack(t))


def test_the_padding_nibble_of_an_odd_count_is_not_checked_as_a_level() -> None:
    z = -np.ones(3, np.float32)  # signed, 3 values: the last byte's high nibble is padding (0)
    assert np.allclose(decode(encode(_act(z), tensor_format="int4")).body["z"], z, rtol=1e-6)


def test_int4_may_decode_to_8x_its_bytes_and_no_more() -> None:
    """The budget charges int4 half its decoded size (4 bits become 32): an honest float32 tensor fits,
    one whose declared shape would need more than 8 x the message is refused before it is built."""
    n = 4 * 1024 * 1024
    z = np.ones(n, np.float32)
    assert decode(encode(_act(z, 2), tensor_format="int4")).body["z"].shape == (n,)
    blocks = -(-n // INT4_BLOCK)
    t = {"__t": 1, "dtype": "float32", "shape": [2, n], "data": b"\x11" * n, "scales": b"\0" * (8 * blocks),
         "signed": False, "enc": "int4"}
    from fedsga_edge.wire import codec

    budget = codec._Budget(n // 2)  # a message half the size those bytes need: the cap is 8 x n/2 + 1 MiB
    with pytest.raises(RemoteProtocolError, match="decodes to"):
        codec._unpack_tensor(t, "body['z']", budget)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_mutated_int4_messages_decode_or_raise_remote_errors(data: st.DataObject) -> None:
    """Any byte of an int4 message flipped: a RemoteProtocolError or a finite tensor of the declared shape."""
    z = np.random.default_rng(2).standard_normal((3, 300)).astype(np.float32)
    raw = bytearray(encode(_act(z, 3), tensor_format="int4"))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
    try:
        msg = decode(bytes(raw))
    except RemoteProtocolError:
        return
    got = msg.body.get("z")
    if isinstance(got, np.ndarray) and got.dtype.kind == "f":
        assert np.isfinite(got).all()


def test_a_peer_answers_a_malformed_int4_activation_with_an_error_and_keeps_serving() -> None:
    t = LoopbackTransport()
    server = Peer(t, "coordinator", "r")
    server.register(lambda m: server.reply(m, "ack"))
    bad = _valid_tensor()
    bad["scales"] = bad["scales"][:4]
    reply = decode(t.request("client-000", "coordinator", _pack(bad)))
    assert reply.kind == "error" and "scale bytes" in reply.body["reason"]
    assert server.errors == 1
    device = Peer(t, "client-000", "r", tensor_format="int4")
    assert device.call("coordinator", "activation", 1, {"z": np.ones((2, 3), np.float32),
                                                         "y": np.zeros(2, np.int64), "split": 1}).kind == "ack"


# ------------------------------------------------------------------ the torch-free device


def test_the_onnx_device_decodes_and_sends_int4_without_torch(tmp_path) -> None:
    """With torch unimportable: the prefix's real activation goes out as int4 through a Peer, an int4
    gradient comes back and the numpy train step takes it."""
    from _export_artifacts import train_artifacts

    art = train_artifacts()
    proc = _run_without_torch(
        f"""
        import numpy as np
        from fedsga_edge.device.runtime import PrefixRunner
        from fedsga_edge.transport import LoopbackTransport, Peer
        from fedsga_edge.wire import decode
        r = PrefixRunner({str(art)!r}, 2)
        rng = np.random.default_rng(0)
        x = rng.standard_normal((8, 3, 32, 32), dtype=np.float32)
        prompts = rng.standard_normal(r.prompts_shape, dtype=np.float32)
        z = r.train_forward(x, prompts)
        t = LoopbackTransport()
        server = Peer(t, "coordinator", "r", tensor_format="int4")
        got = []
        def serve(m):
            got.append(m)
            return server.reply(m, "gradient", {{"dz": (m.body["z"] - 0.5) / m.body["z"].size, "loss": 0.0}})
        server.register(serve)
        device = Peer(t, "client-000", "r", tensor_format="int4")
        sent = []
        send = t.request
        t.request = lambda src, dst, payload, **kw: sent.append(payload) or send(src, dst, payload, **kw)
        reply = device.call("coordinator", "activation", 1, {{"z": z, "y": np.zeros(8, np.int64), "split": 2}})
        assert reply.kind == "gradient", reply.body
        assert len(sent[0]) <= 0.13 * z.nbytes + 400, (len(sent[0]), z.nbytes)
        zq = got[0].body["z"]
        assert zq.shape == z.shape and np.abs(zq - z).max() <= np.abs(z).max() / 30 * 1.0001
        dz = reply.body["dz"]
        assert dz.shape == z.shape and dz.dtype == np.float32 and np.isfinite(dz).all()
        grads = r.train_step(x, dz, prompts, lr=0.1)
        assert all(np.isfinite(g).all() for g in grads.values())
        print("ok", len(sent[0]), z.nbytes)
        """,
        tmp_path,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ok" in proc.stdout


# ------------------------------------------------------------------ a simulated round


def test_a_simulated_round_with_wire_format_int4() -> None:
    from test_wire_format import _one_round

    rec32, kinds32, _ = _one_round("fp32")
    rec4, kinds4, enc4 = _one_round("int4")
    assert enc4["activation"]["z"] == {"int4"} and enc4["activation"]["y"] == {"raw"}
    assert enc4["gradient"]["dz"] == {"int4"}
    assert enc4["update"]["weights"] == {"raw"} and enc4["round_start"]["weights"] == {"raw"}
    for kind in ("activation", "gradient"):
        assert kinds4[kind] <= 0.135 * kinds32[kind], (kind, kinds4[kind] / kinds32[kind])  # small batches of 32
    assert kinds4["update"] == kinds32["update"]  # weights travel fp32 under every format
    assert math.isfinite(rec4["train_loss"]) and rec4["train_loss"] != rec32["train_loss"]  # it really rounded
    assert_test_accuracy(rec4, 360)
