"""Codec: round trips, lossy-encoding error bounds, zero-copy decode, and fuzzing."""

from __future__ import annotations

import contextlib
import math

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedsga_edge.wire import (
    DTYPES,
    KINDS,
    PROTOCOL_VERSION,
    LocalProtocolError,
    Message,
    RemoteProtocolError,
    WireError,
    decode,
    encode,
)

FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NO_BODY_KINDS = ["hello", "round_start", "ack", "bye"]  # kinds whose body has no required field

# ------------------------------------------------------------------ helpers


def same(a, b) -> bool:
    """Deep equality: arrays bit-exact (dtype, shape, bytes), floats NaN-aware."""
    if isinstance(a, np.ndarray):
        return (
            isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    return type(a) is type(b) and a == b


def ulp(dtype, value: float) -> float:
    """Spacing of dtype's grid near |value| (an upper bound)."""
    fi = np.finfo(dtype)
    return max(value * float(fi.eps), float(fi.smallest_subnormal))


def envelope(**over):
    env = {"v": PROTOCOL_VERSION, "kind": "hello", "run": "r", "round": 0, "seq": 1, "sender": "c1", "body": {}}
    env.update(over)
    return msgpack.packb(env, use_bin_type=True)


def tensor_map(**over):
    t = {"__t": 1, "dtype": "float32", "shape": [2], "data": b"\0" * 8}
    t.update(over)
    return t


def raises_remote(data: bytes, match: str | None = None) -> None:
    with pytest.raises(RemoteProtocolError, match=match):
        decode(data)


# --------------------------------------------------------------- strategies

arrays = st.sampled_from(sorted(DTYPES)).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4))
)
scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8)
)
keys = st.text(max_size=6).filter(lambda k: k != "__t")
values = st.recursive(
    scalars | arrays,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=10,
)
bodies = st.dictionaries(keys, values, max_size=4)
messages = st.builds(
    Message,
    kind=st.sampled_from(NO_BODY_KINDS),
    run=st.text(max_size=10),
    round=st.integers(0, 2**63),
    seq=st.integers(0, 2**64 - 1),
    sender=st.text(min_size=1, max_size=10),
    body=bodies,
)


# --------------------------------------------------------------- round trip


@FAST
@given(messages)
def test_round_trip_raw_is_exact(msg):
    out = decode(encode(msg))
    assert (out.kind, out.run, out.round, out.seq, out.sender) == (msg.kind, msg.run, msg.round, msg.seq, msg.sender)
    assert same(msg.body, out.body)


@FAST
@given(messages, st.sampled_from(["fp16", "int8"]))
def test_lossy_formats_leave_integer_and_bool_tensors_exact(msg, fmt):
    def ints_only(v):
        if isinstance(v, np.ndarray):
            return v if v.dtype.kind in "iub" else None
        if isinstance(v, dict):
            return {k: ints_only(x) for k, x in v.items()}
        if isinstance(v, list):
            return [ints_only(x) for x in v]
        return v

    msg.body = ints_only(msg.body)  # floats may be non-finite, which int8 refuses
    assert same(msg.body, decode(encode(msg, tensor_format=fmt)).body)


def test_every_kind_with_its_required_fields_round_trips():
    z, y, w = np.ones((2, 3), np.float32), np.arange(2), {"b0.w": np.zeros(3, np.float32)}
    bodies = {
        "activation": {"z": z, "y": y, "split": 1},
        "gradient": {"dz": z, "loss": 0.5},
        "update": {"weights": w, "num_samples": 10},
        "weights": {"weights": w},
        "fetch": {"blocks": [0, 1]},
        "probe": {"z1": z, "zref": z, "y": y, "o": [0.5, 0.1, 0.0], "r_prev": 0.0},
        "probe_result": {},
        "error": {"reason": "x"},
        "evaluate": {"z": z, "y": y, "split": 1},
        "eval_result": {"loss": 3.2, "correct": 1, "count": 2},
        "description": {"classes": ["cat", "dog"], "image_size": 32, "mean": [0.5] * 3, "std": [0.25] * 3},
    }
    for kind in KINDS:
        msg = Message(kind, "run-1", 2, 3, "coordinator", bodies.get(kind, {}))
        assert same(msg.body, decode(encode(msg)).body)


def test_numpy_scalars_tuples_and_foreign_layouts_are_normalised():
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    strided = np.arange(20, dtype=np.float64)[::3]
    fortran = np.asfortranarray(np.arange(6, dtype=np.int16).reshape(2, 3))
    body = {
        "a": np.float32(1.5),
        "b": np.int64(7),
        "c": np.bool_(True),
        "t": (1, 2),
        "be": big_endian,
        "s": strided,
        "f": fortran,
    }
    out = decode(encode(Message("hello", "r", 0, 0, "c", body))).body
    assert out["a"] == 1.5 and type(out["a"]) is float
    assert out["b"] == 7 and type(out["b"]) is int
    assert out["c"] is True and out["t"] == [1, 2]
    assert out["be"].dtype == np.dtype("int32") and out["be"].dtype.isnative
    np.testing.assert_array_equal(out["be"], big_endian)
    np.testing.assert_array_equal(out["s"], strided)
    np.testing.assert_array_equal(out["f"], fortran)


def test_raw_decode_is_zero_copy_and_read_only():
    x = np.arange(1000, dtype=np.float32).reshape(10, 100)
    out = decode(encode(Message("hello", "r", 0, 0, "c", {"x": x}))).body["x"]
    assert not out.flags.writeable and not out.flags.owndata
    base = out
    while isinstance(base, np.ndarray):
        base = base.base
    # The array is a view on exactly its payload bytes: no copy beyond msgpack's bin object.
    assert isinstance(base, bytes) and len(base) == x.nbytes
    assert np.shares_memory(out, np.frombuffer(base, dtype=np.uint8))


# ---------------------------------------------------------- lossy encodings


finite32 = hnp.arrays(
    np.float32,
    hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=8),
    elements=st.floats(-60000, 60000, width=32),
)


@FAST
@given(finite32)
def test_fp16_error_bound(x):
    out = decode(encode(Message("hello", "r", 0, 0, "c", {"x": x}), tensor_format="fp16")).body["x"]
    assert out.dtype == np.float32 and out.shape == x.shape
    # fp16 keeps 11 significant bits; subnormals bottom out at half of 2**-24.
    bound = np.maximum(np.abs(x) * 2.0**-11, 2.0**-25)
    assert np.all(np.abs(out.astype(np.float64) - x) <= bound)


@FAST
@given(
    st.sampled_from([np.float16, np.float32, np.float64]).flatmap(
        lambda dt: hnp.arrays(
            dt,
            hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=8),
            elements=st.floats(-1e4, 1e4, width=np.dtype(dt).itemsize * 8),
        )
    )
)
def test_int8_error_bound(x):
    data = encode(Message("hello", "r", 0, 0, "c", {"x": x}), tensor_format="int8")
    out = decode(data).body["x"]
    assert out.dtype == x.dtype and out.shape == x.shape and out.flags.writeable
    peak = float(np.max(np.abs(x.astype(np.float64)))) if x.size else 0.0
    err = np.abs(out.astype(np.float64) - x.astype(np.float64))
    # Half a quantisation step, plus rounding to the output dtype's grid near the peak.
    assert np.all(err <= peak / 254 * 1.0001 + ulp(x.dtype, peak))


def test_lossy_formats_shrink_float32_payloads():
    x = np.random.default_rng(0).standard_normal((64, 256)).astype(np.float32)
    msg = Message("hello", "r", 0, 0, "c", {"x": x})
    sizes = {f: len(encode(msg, tensor_format=f)) for f in ("raw", "fp16", "int8")}
    assert sizes["fp16"] < 0.51 * sizes["raw"] and sizes["int8"] < 0.26 * sizes["raw"]


@pytest.mark.parametrize(
    "x",
    [
        np.array(4.55e-135),  # float64 far below float32's range
        np.array([1.4e-45, -1e-45], np.float32),  # float32 subnormals
        np.array([6e-8, 1e-7], np.float16),  # float16 subnormals
        np.array([1e300, -3e299]),
        np.array(65504.0, np.float16),
    ],
)
def test_int8_keeps_tiny_and_huge_scales(x):
    out = decode(encode(Message("hello", "r", 0, 0, "c", {"x": x}), tensor_format="int8")).body["x"]
    peak = float(np.max(np.abs(x.astype(np.float64))))
    assert out.dtype == x.dtype and out.shape == x.shape
    assert np.all(np.abs(out.astype(np.float64) - x) <= peak / 254 * 1.0001 + ulp(x.dtype, peak))


def test_int8_of_all_zeros_and_empty():
    for x in (np.zeros((3, 3), np.float32), np.zeros((0, 5), np.float32)):
        out = decode(encode(Message("hello", "r", 0, 0, "c", {"x": x}), tensor_format="int8")).body["x"]
        np.testing.assert_array_equal(out, x)


# ------------------------------------------------------- local misuse errors


@pytest.mark.parametrize(
    "body",
    [
        {"x": np.array([object()])},
        {"x": np.zeros(2, np.complex64)},
        {"x": np.array(["a"])},
        {"x": np.zeros(2, dtype=[("a", "f4")])},
        {"x": np.zeros(2, np.uint32)},
        {1: "non-str key"},
        {"__t": 1},
        {"x": 2**64},
        {"x": b"bare bytes"},
        {"x": {1, 2}},
        {"x": object()},
    ],
)
def test_encoding_what_the_format_cannot_hold_is_a_local_error(body):
    with pytest.raises(LocalProtocolError):
        encode(Message("hello", "r", 0, 0, "c", body))


@pytest.mark.parametrize(
    "msg",
    [
        Message("nonsense", "r", 0, 0, "c", {}),
        Message("hello", "r", -1, 0, "c", {}),
        Message("hello", "r", 0, -1, "c", {}),
        Message("hello", "r", 0, True, "c", {}),
        Message("hello", "r", 0, 0, "", {}),
        Message("hello", 5, 0, 0, "c", {}),
        Message("hello", "r", 0, 0, "c", []),
        Message("gradient", "r", 0, 0, "c", {"dz": np.zeros(1, np.float32)}),
        Message("gradient", "r", 0, 0, "c", {"dz": [0.0], "loss": 1.0}),
    ],
)
def test_bad_envelopes_and_bodies_fail_at_the_sender(msg):
    with pytest.raises(LocalProtocolError):
        encode(msg)


def test_bad_tensor_format_and_nonfinite_int8_are_local_errors():
    msg = Message("hello", "r", 0, 0, "c", {"x": np.array([1.0, np.nan], np.float32)})
    with pytest.raises(LocalProtocolError, match="tensor_format"):
        encode(msg, tensor_format="bf16")
    with pytest.raises(LocalProtocolError, match="finite"):
        encode(msg, tensor_format="int8")
    encode(msg, tensor_format="fp16")  # fp16 carries nan fine
    with pytest.raises(LocalProtocolError):
        decode("not bytes")  # type: ignore[arg-type]


def test_deep_nesting_is_refused_both_ways():
    deep: object = 1
    for _ in range(40):
        deep = [deep]
    with pytest.raises(LocalProtocolError, match="deeper"):
        encode(Message("hello", "r", 0, 0, "c", {"d": deep}))
    raises_remote(envelope(body={"d": deep}), match="deeper")


# ---------------------------------------------------- remote (peer) errors


def test_version_mismatch_names_both_versions():
    with pytest.raises(RemoteProtocolError, match=r"version 2.*version 1"):
        decode(envelope(v=2))


def test_required_field_errors_name_kind_and_field():
    raises_remote(envelope(kind="gradient", body={"loss": 1.0}), match=r"'gradient'.*'dz'")
    raises_remote(
        envelope(kind="activation", body={"z": tensor_map(), "y": tensor_map(), "split": "2"}),
        match=r"'activation'.*'split'.*int",
    )


@pytest.mark.parametrize(
    "data, match",
    [
        (b"", "msgpack"),
        (b"\xc1", "msgpack"),
        (msgpack.packb([1, 2]), "map"),
        (envelope() + b"\x00", "msgpack"),
        (envelope(kind="shout"), "kind"),
        (envelope(kind=None), "kind"),
        (envelope(round=-1), "round"),
        (envelope(seq=1.0), "seq"),
        (envelope(seq=True), "seq"),
        (envelope(sender=""), "sender"),
        (envelope(run=b"r"), "run"),
        (envelope(body=[]), "body"),
        (envelope(extra=1), "envelope"),
        (envelope(body={"x": b"raw"}), "bytes"),
        (
            msgpack.packb(
                {"v": 1, "kind": "hello", "run": "r", "round": 0, "seq": 0, "sender": "c", "body": {b"k": 1}},
                use_bin_type=True,
            ),
            "keys",
        ),
        (msgpack.packb(msgpack.ExtType(1, b"x")), "msgpack"),
        (envelope(body={"x": tensor_map(dtype="object")}), "allow-list"),
        (envelope(body={"x": tensor_map(dtype="complex64")}), "allow-list"),
        (envelope(body={"x": tensor_map(shape=[-2])}), "shape"),
        (envelope(body={"x": tensor_map(shape=[2.0])}), "shape"),
        (envelope(body={"x": tensor_map(shape=[True, True])}), "shape"),
        (envelope(body={"x": tensor_map(shape="2")}), "shape"),
        (envelope(body={"x": tensor_map(shape=[1] * 33, data=b"\0" * 4)}), "shape"),
        (envelope(body={"x": tensor_map(shape=[3])}), "needs 12 bytes, got 8"),
        (envelope(body={"x": tensor_map(shape=[2**40, 2**40])}), "bytes"),
        (envelope(body={"x": tensor_map(shape=[0, 2**62], data=b"")}), "shape"),
        (envelope(body={"x": tensor_map(shape=[0, 2**64 - 1], data=b"")}), "shape"),
        (envelope(body={"x": tensor_map(data="text")}), "bin"),
        (envelope(body={"x": tensor_map(__t=2)}), "tensor format"),
        (envelope(body={"x": tensor_map(junk=1)}), "tensor keys"),
        (envelope(body={"x": {"__t": 1}}), "allow-list"),
        (envelope(body={"x": tensor_map(enc="zip")}), "encoding"),
        (envelope(body={"x": tensor_map(dtype="int32", enc="fp16", data=b"\0" * 4)}), "floating"),
        (envelope(body={"x": tensor_map(enc="int8", data=b"\0\0")}), "scale"),
        (envelope(body={"x": tensor_map(enc="int8", data=b"\0\0", scale=float("nan"))}), "scale"),
        (envelope(body={"x": tensor_map(enc="int8", data=b"\0\0", scale=-1.0)}), "scale"),
        (envelope(body={"x": tensor_map(enc="int8", data=b"\0\0", scale=1e300)}), "overflows float32"),
        (envelope(body={"x": tensor_map(dtype="bool", data=b"\x01\x07")}), "bool"),
    ],
)
def test_malformed_input_is_a_remote_error_with_a_clear_message(data, match):
    raises_remote(data, match=match)


def _sample_bytes() -> bytes:
    body = {
        "z": np.arange(12, dtype=np.float32).reshape(3, 4),
        "y": np.array([1, 0, 1], np.int64),
        "split": 2,
        "meta": {"ok": True, "lr": 0.1, "names": ["a", "b"]},
    }
    return encode(Message("activation", "run", 3, 9, "client-1", body))


SAMPLE = _sample_bytes()


def _decode_or_remote_error(data) -> None:
    with contextlib.suppress(RemoteProtocolError):  # the only acceptable failure
        decode(data)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_random_bytes(data):
    _decode_or_remote_error(data)


@settings(max_examples=100, deadline=None)
@given(st.integers(0, len(SAMPLE) - 1))
def test_fuzz_truncated(n):
    raises_remote(SAMPLE[:n])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, len(SAMPLE) - 1), st.integers(0, 255)), min_size=1, max_size=4))
def test_fuzz_mutated(edits):
    data = bytearray(SAMPLE)
    for pos, byte in edits:
        data[pos] = byte
    _decode_or_remote_error(bytes(data))
    _decode_or_remote_error(memoryview(data))


json_like = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=5)
    | st.binary(max_size=9),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.text(max_size=6)
            | st.sampled_from(["__t", "dtype", "shape", "data", "enc", "scale", "v", "kind", "body"]),
            inner,
            max_size=5,
        )
    ),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(
    json_like,
    st.sampled_from(["v", "kind", "run", "round", "seq", "sender", "body"]),
    st.dictionaries(st.sampled_from(["__t", "dtype", "shape", "data", "enc", "scale"]), json_like, max_size=6),
)
def test_fuzz_well_formed_msgpack_with_wrong_contents(junk, field, tensorish):
    _decode_or_remote_error(msgpack.packb(junk, use_bin_type=True))
    _decode_or_remote_error(envelope(**{field: junk}))
    _decode_or_remote_error(envelope(body={"x": tensorish}))
    _decode_or_remote_error(envelope(body={"x": {**tensor_map(), **tensorish}}))


def test_error_hierarchy():
    assert issubclass(RemoteProtocolError, WireError) and issubclass(LocalProtocolError, WireError)
    assert not issubclass(RemoteProtocolError, LocalProtocolError)
