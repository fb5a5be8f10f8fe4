"""Message <-> bytes. msgpack envelope, typed tensors, never pickle.

Layout of one encoded message (a msgpack map)::

    {"v": 1, "kind": str, "run": str, "round": int, "seq": int,
     "sender": str, "body": {...}}

Inside ``body`` every numpy array becomes a *tensor map* (the reserved key
``"__t"`` marks it, so body dicts may not use that key themselves)::

    {"__t": 1, "dtype": "float32", "shape": [64, 128],
     "data": <bin: little-endian, C order>,
     "enc": "fp16" | "int8" | "int4", # absent = raw
     "scale": float,                  # int8 only
     "scales": <bin>, "signed": bool} # int4 only

int4 (docs/protocol.md, "Messages") packs two 4-bit levels a byte (element 2i in the low nibble) with one
little-endian float32 scale per block of ``INT4_BLOCK`` elements: 0.125 + 1/(8 x 256) = 0.1289 x the fp32
bytes. A tensor with no negative value (activations after a ReLU) uses all 16 levels, 0..15 x scale; one
with negatives uses -7..7 x scale, stored as level + 8 (nibble 0 is never sent, and refused).

``dtype`` is always the dtype the receiver gets back; ``enc`` says how ``data``
is laid out on the wire. Lossy encodings touch floating tensors only; integer
and bool tensors always travel raw, so labels and masks are never damaged.

Raw tensors decode as read-only numpy views on the ``bytes`` object msgpack
hands back for the ``bin`` field: no copy beyond msgpack's own (msgpack cannot
expose slices of the input buffer). Call ``.copy()`` before writing in place.
fp16 / int8 tensors decode into fresh, writable arrays.

Decoding checks before it builds: the envelope first (``wire/envelope.py`` reads it without
touching the body, and ``decode(admit=...)`` lets the receiver refuse on it), then each tensor's
declared dtype x shape against its bytes, then the message's budget for fresh arrays.

Anything malformed in the input raises RemoteProtocolError; asking to encode
something the format cannot hold raises LocalProtocolError.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import msgpack
import numpy as np

from .envelope import Envelope, read_envelope
from .errors import LocalProtocolError, RemoteProtocolError, WireError
from .messages import KINDS, PROTOCOL_VERSION, Message, check_body

__all__ = ["DTYPES", "EXPANSION_ALLOWANCE", "INT4_BLOCK", "MAX_DEPTH", "MAX_EXPANSION", "MAX_ITEMS", "TENSOR_FORMATS", "TENSOR_MARK",
           "Admit", "Envelope", "decode", "encode"]

TENSOR_FORMATS: tuple[str, ...] = ("raw", "fp16", "int8", "int4")
DTYPES: frozenset[str] = frozenset(
    {"float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool"}
)
TENSOR_MARK = "__t"
_TENSOR_VERSION = 1
_TENSOR_KEYS = frozenset({TENSOR_MARK, "dtype", "shape", "data", "enc", "scale", "scales", "signed"})
_ENVELOPE_KEYS = frozenset({"v", "kind", "run", "round", "seq", "sender", "body"})

MAX_DEPTH = 32  # nesting of body containers; deeper is a bug or an attack
# Elements in all lists and maps of one message. msgpack spends 1 byte on an empty list that costs
# Python ~60, so without a budget a 100 MB message of nested empty lists would take GBs to decode.
# Honest messages hold a few thousand (a round start: ~6 per tensor plus the configs).
MAX_ITEMS = 200_000
# Fresh arrays one message may decode into (fp16 / int8 tensors; raw ones are views): 4 x its bytes, what
# int8 float32 tensors take (fp16 float32: 2x), plus 1 MiB so small float64 tensors may use int8 (8x) too.
# A message of int8 bytes that declares float64 throughout is refused before anything is allocated.
MAX_EXPANSION = 4
EXPANSION_ALLOWANCE = 1 << 20
# int4: elements per float32 scale. 256 keeps the scales at 1/64 of the packed bytes (0.1289 x fp32 in all,
# under the 0.13 x limit); a smaller block would cut the error and break that limit (128: 0.1328 x).
INT4_BLOCK = 256
# int4 carries float32 and float16 tensors; it is charged half its decoded size against the budget (4 bits
# become 32), so an int4 message may decode to 8 x its size + 2 MiB. float64 never travels int4 (it would be 16x).
_INT4_DTYPES = frozenset({"float32", "float16"})
_BLOCK = 1 << 20  # elements per step of int8 arithmetic done wider than the output (8 MiB of float64 scratch)
_MAX_NDIM = 32
_MAX_ID_LEN = 256  # run id / sender id
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1  # what msgpack can carry


# --------------------------------------------------------------------- encode


def encode(msg: Message, *, tensor_format: str = "raw") -> bytes:
    """Serialise ``msg``; ``tensor_format`` picks raw, fp16, int8 or int4 for floating tensors.

    The body is checked against REQUIRED_FIELDS here too, so a role that builds
    a bad message fails at the sender (LocalProtocolError), not at the peer.
    numpy scalars in the body are sent as plain Python numbers.
    """
    if tensor_format not in TENSOR_FORMATS:
        raise LocalProtocolError(f"unknown tensor_format {tensor_format!r}; use one of {TENSOR_FORMATS}")
    _check_envelope(msg.kind, msg.run, msg.round, msg.seq, msg.sender, type(msg.body).__name__, LocalProtocolError)
    check_body(msg.kind, msg.body, LocalProtocolError)
    envelope = {
        "v": PROTOCOL_VERSION,
        "kind": msg.kind,
        "run": msg.run,
        "round": msg.round,
        "seq": msg.seq,
        "sender": msg.sender,
        "body": _pack(msg.body, tensor_format, 0, "body"),
    }
    try:
        return msgpack.packb(envelope, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # pragma: no cover - _pack screens these
        raise LocalProtocolError(f"cannot encode {msg.kind!r} message: {e}") from e


def _pack(v: Any, fmt: str, depth: int, path: str) -> Any:
    if depth > MAX_DEPTH:
        raise LocalProtocolError(f"{path}: nested deeper than {MAX_DEPTH}")
    if v is None or isinstance(v, (bool, str)):
        return v
    if isinstance(v, np.ndarray):
        return _pack_tensor(v, fmt, path)
    if isinstance(v, np.generic):  # before float: np.float64 subclasses float
        if isinstance(v, np.bool_):
            return bool(v)
        if isinstance(v, np.integer):
            return _pack(int(v), fmt, depth, path)
        if isinstance(v, np.floating):
            return float(v)
        raise LocalProtocolError(f"{path}: cannot encode numpy scalar of dtype {v.dtype}")
    if isinstance(v, int):
        if not _INT_MIN <= v <= _INT_MAX:
            raise LocalProtocolError(f"{path}: integer {v} does not fit in 64 bits")
        return v
    if isinstance(v, float):
        return v
    if isinstance(v, dict):
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise LocalProtocolError(f"{path}: dict keys must be str, got {type(k).__name__} {k!r}")
            if k == TENSOR_MARK:
                raise LocalProtocolError(f"{path}: key {TENSOR_MARK!r} is reserved for tensors")
            out[k] = _pack(x, fmt, depth + 1, f"{path}[{k!r}]")
        return out
    if isinstance(v, (list, tuple)):
        return [_pack(x, fmt, depth + 1, f"{path}[{i}]") for i, x in enumerate(v)]
    raise LocalProtocolError(f"{path}: cannot encode {type(v).__name__}")


def _pack_tensor(a: np.ndarray, fmt: str, path: str) -> dict[str, Any]:
    name = a.dtype.name
    if name not in DTYPES or a.dtype.fields is not None:
        raise LocalProtocolError(f"{path}: dtype {a.dtype} is not allowed; allowed: {sorted(DTYPES)}")
    if a.ndim > _MAX_NDIM:
        raise LocalProtocolError(f"{path}: {a.ndim} dimensions, at most {_MAX_NDIM}")
    t: dict[str, Any] = {TENSOR_MARK: _TENSOR_VERSION, "dtype": name, "shape": list(a.shape)}
    floating = a.dtype.kind == "f"
    if fmt == "fp16" and floating and name != "float16":
        with np.errstate(over="ignore"):  # |x| > 65504 becomes inf, as fp16 does
            wire = np.ascontiguousarray(a, dtype="<f2")
        t["enc"] = "fp16"
    elif fmt == "int8" and floating:
        wire, scale = _quantize_int8(a, path)
        t["enc"] = "int8"
        t["scale"] = scale
    elif fmt == "int4" and name in _INT4_DTYPES:
        wire, scales, signed = _quantize_int4(a, path)
        t["enc"] = "int4"
        t["scales"] = scales.data
        t["signed"] = signed
    else:
        wire = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))
    # A uint8 view of the contiguous buffer: msgpack packs it as bin without an extra copy.
    t["data"] = wire.reshape(-1).view(np.uint8).data
    return t


def _quantize_int8(a: np.ndarray, path: str) -> tuple[np.ndarray, float]:
    """Symmetric per-tensor int8: q = round(x / scale), scale = max|x| / 127."""
    if a.size and not np.isfinite(a).all():
        raise LocalProtocolError(f"{path}: int8 encoding needs finite values (found nan/inf)")
    peak = float(np.max(np.abs(a))) if a.size else 0.0
    scale = peak / 127.0  # a Python float: msgpack sends it as a double, so no range is lost
    if scale == 0:
        return np.zeros(a.shape, dtype=np.int8), 0.0
    x = np.divide(a, scale, dtype=_int8_math(a.dtype, scale))
    return np.clip(np.rint(x), -127, 127).astype(np.int8), scale


def _quantize_int4(a: np.ndarray, path: str) -> tuple[np.ndarray, np.ndarray, bool]:
    """Per-block 4-bit: packed nibbles, float32 scales (max|x| of the block / levels), signed or not.

    A tensor without negatives (a ReLU's output) gets levels 0..15; otherwise -7..7, stored + 8. The
    quantisation uses the float32 scale as sent, so the decoder reproduces exactly what was rounded here.
    """
    if a.size and not np.isfinite(a).all():
        raise LocalProtocolError(f"{path}: int4 encoding needs finite values (found nan/inf)")
    flat = a.reshape(-1).astype(np.float32)
    n = flat.size
    blocks = -(-n // INT4_BLOCK)
    padded = np.zeros(blocks * INT4_BLOCK, np.float32)
    padded[:n] = flat
    rows = padded.reshape(blocks, INT4_BLOCK)
    signed = bool(n and flat.min() < 0)
    levels = 7.0 if signed else 15.0
    peak = np.abs(rows).max(axis=1) if blocks else np.zeros(0, np.float32)
    scales = (peak / np.float32(levels)).astype("<f4")
    safe = np.where(scales > 0, scales, np.float32(1)).astype(np.float32)
    q = np.rint(rows / safe[:, None])
    q = np.clip(q, -7, 7) + 8 if signed else np.clip(q, 0, 15)
    nib = q.astype(np.uint8).reshape(-1)[: n + (n & 1)]
    if n & 1:  # the unused high nibble of the last byte is 0
        nib[n] = 0
    packed = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8)
    return packed, scales, signed


def _int8_math(dtype: np.dtype[Any] | str, scale: float) -> np.dtype[Any]:
    """float32 arithmetic suffices for int8 unless the tensor is float64 or the scale is subnormal there."""
    if np.dtype(dtype) == np.float64 or scale < np.finfo(np.float32).tiny:
        return np.dtype(np.float64)
    return np.dtype(np.float32)


# --------------------------------------------------------------------- decode

Admit = Callable[[Envelope], None]


def decode(data: bytes | bytearray | memoryview, *, admit: Admit | None = None) -> Message:
    """Parse and validate one message; any defect raises RemoteProtocolError.

    Two phases, so a message its receiver would refuse costs no tensor: the envelope (version,
    kind, run, round, seq, sender) is read and checked first, then ``admit(envelope)`` runs
    (it raises RemoteProtocolError to refuse: another run, a sender that is not the topic's, a
    round or kind the role does not take), and only then is the body decoded. Every tensor's
    declared dtype x shape is checked against the bytes present before an array is built, and
    the fresh arrays of one message (fp16 / int8 tensors) may total at most
    ``MAX_EXPANSION x len(data) + EXPANSION_ALLOWANCE`` bytes (docs/protocol.md, "What is rejected").
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise LocalProtocolError(f"decode() takes bytes, got {type(data).__name__}")
    view = memoryview(data).cast("B") if isinstance(data, memoryview) else memoryview(data)
    try:
        fields, span, body_type = read_envelope(view)
    except LookupError:
        _not_a_map(view)
        raise  # pragma: no cover - _not_a_map always raises
    v = fields.get("v")
    if v != PROTOCOL_VERSION or not _is_int(v):
        raise RemoteProtocolError(f"unsupported protocol version {v!r:.80}; this side speaks version {PROTOCOL_VERSION}")
    keys = fields.keys() | ({"body"} if span is not None else set())
    if keys != _ENVELOPE_KEYS:
        missing = sorted(_ENVELOPE_KEYS - keys)
        extra = sorted(f"{k!r:.40}" for k in keys - _ENVELOPE_KEYS)
        raise RemoteProtocolError(f"bad envelope: missing {missing}, unexpected {extra}")
    kind, run, rnd, seq, sender = fields["kind"], fields["run"], fields["round"], fields["seq"], fields["sender"]
    _check_envelope(kind, run, rnd, seq, sender, body_type, RemoteProtocolError)
    if admit is not None:
        admit(Envelope(kind=kind, run=run, round=rnd, seq=seq, sender=sender))
    assert span is not None
    body = _unpack(_unpack_msgpack(view[span[0]:span[1]]), 0, "body", _Budget(len(view)))
    check_body(kind, body, RemoteProtocolError)
    return Message(kind=kind, run=run, round=rnd, seq=seq, sender=sender, body=body)


def _unpack_msgpack(view: memoryview) -> Any:
    """msgpack's objects for ``view``, with the element budget (tensor data stays bytes)."""
    left = [MAX_ITEMS]

    def budget(container: Any) -> Any:  # called as each list / map is finished
        left[0] -= len(container)
        if left[0] < 0:
            raise ValueError(f"more than {MAX_ITEMS} list and map elements")
        return container

    try:
        return msgpack.unpackb(view, raw=False, strict_map_key=True, use_list=True, max_ext_len=0,
                               max_array_len=MAX_ITEMS, max_map_len=MAX_ITEMS, list_hook=budget, object_hook=budget)
    except Exception as e:  # msgpack raises a zoo of ValueError subclasses
        raise RemoteProtocolError(f"not a msgpack message ({len(view)} bytes): {e}") from e


def _not_a_map(view: memoryview) -> None:
    """Say why a message that is not a msgpack map is refused: invalid msgpack, or what it is."""
    top = _unpack_msgpack(view)
    raise RemoteProtocolError(f"message must be a msgpack map, got {type(top).__name__}")


class _Budget:
    """Bytes of fresh arrays one message may still decode into: ``MAX_EXPANSION`` x its size plus
    ``EXPANSION_ALLOWANCE``. Raw tensors are views and cost nothing; fp16 and int8 ones cost their
    decoded size, checked before the array is allocated."""

    __slots__ = ("cap", "left")

    def __init__(self, message_bytes: int) -> None:
        self.cap = self.left = MAX_EXPANSION * message_bytes + EXPANSION_ALLOWANCE

    def take(self, nbytes: int, path: str, what: str) -> None:
        if nbytes > self.left:
            raise RemoteProtocolError(
                f"{path}: {what} decodes to {nbytes} bytes; this message may decode to {self.cap} bytes "
                f"of arrays in all ({MAX_EXPANSION} x its size + {EXPANSION_ALLOWANCE}), {self.left} left"
            )
        self.left -= nbytes


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_envelope(kind: Any, run: Any, rnd: Any, seq: Any, sender: Any, body_type: str, error: type[WireError]) -> None:
    """``body_type`` is the Python type name the body has (or would have, built)."""
    if not isinstance(kind, str) or kind not in KINDS:
        raise error(f"unknown message kind {kind!r:.80}; known: {', '.join(KINDS)}")
    if not isinstance(run, str) or len(run) > _MAX_ID_LEN:
        raise error(f"{kind!r}: run must be a str of at most {_MAX_ID_LEN} chars, got {run!r:.80}")
    if not isinstance(sender, str) or not 0 < len(sender) <= _MAX_ID_LEN:
        raise error(f"{kind!r}: sender must be a non-empty str of at most {_MAX_ID_LEN} chars")
    for name, n in (("round", rnd), ("seq", seq)):
        if not _is_int(n) or not 0 <= n <= _INT_MAX:
            raise error(f"{kind!r}: {name} must be a non-negative 64-bit int, got {n!r:.80}")
    if body_type != "dict":
        raise error(f"{kind!r}: body must be a map, got {body_type}")


def _unpack(v: Any, depth: int, path: str, budget: _Budget) -> Any:
    if depth > MAX_DEPTH:
        raise RemoteProtocolError(f"{path}: nested deeper than {MAX_DEPTH}")
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, list):
        return [_unpack(x, depth + 1, f"{path}[{i}]", budget) for i, x in enumerate(v)]
    if isinstance(v, dict):
        if TENSOR_MARK in v:
            return _unpack_tensor(v, path, budget)
        out = {}
        for k, x in v.items():
            if not isinstance(k, str):
                raise RemoteProtocolError(f"{path}: map keys must be str, got {type(k).__name__}")
            out[k] = _unpack(x, depth + 1, f"{path}[{k!r}]", budget)
        return out
    raise RemoteProtocolError(f"{path}: unexpected {type(v).__name__} value outside a tensor")


def _unpack_tensor(t: dict[Any, Any], path: str, budget: _Budget) -> np.ndarray:
    if not t.keys() <= _TENSOR_KEYS:
        extra = sorted(f"{k!r:.40}" for k in t.keys() - _TENSOR_KEYS)
        raise RemoteProtocolError(f"{path}: unexpected tensor keys {extra}")
    if t[TENSOR_MARK] != _TENSOR_VERSION or not _is_int(t[TENSOR_MARK]):
        raise RemoteProtocolError(
            f"{path}: tensor format {t[TENSOR_MARK]!r:.40} unsupported; this side reads {_TENSOR_VERSION}"
        )
    dtype, shape, data = t.get("dtype"), t.get("shape"), t.get("data")
    enc = t.get("enc", "raw")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise RemoteProtocolError(f"{path}: dtype {dtype!r:.40} not in allow-list {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM or not all(_is_int(d) and d >= 0 for d in shape):
        raise RemoteProtocolError(f"{path}: shape must be a list of at most {_MAX_NDIM} non-negative ints")
    if not isinstance(data, bytes):
        raise RemoteProtocolError(f"{path}: tensor data must be bin, got {type(data).__name__}")
    if not isinstance(enc, str) or enc not in TENSOR_FORMATS:
        raise RemoteProtocolError(f"{path}: unknown tensor encoding {enc!r:.40}")
    floating = dtype.startswith("float")
    if enc != "raw" and not floating:
        raise RemoteProtocolError(f"{path}: encoding {enc!r} is only for floating tensors, not {dtype}")
    if ("scale" in t) != (enc == "int8"):
        raise RemoteProtocolError(f"{path}: 'scale' goes with int8 encoding and only with it")
    if ("scales" in t or "signed" in t) != (enc == "int4") or (enc == "int4" and not t.keys() >= {"scales", "signed"}):
        raise RemoteProtocolError(f"{path}: 'scales' and 'signed' go with int4 encoding, both and only with it")
    count = math.prod(shape)  # Python ints: a claimed terabyte is a number, not an allocation
    if enc == "int4":
        return _unpack_int4(t, dtype, shape, count, data, path, budget)
    wire = {"raw": np.dtype(dtype).newbyteorder("<"), "fp16": np.dtype("<f2"), "int8": np.dtype("i1")}[enc]
    if count * wire.itemsize != len(data):
        raise RemoteProtocolError(
            f"{path}: shape {shape} of {enc} {dtype} needs {count * wire.itemsize} bytes, got {len(data)}")
    scale = _int8_scale(t, dtype, path) if enc == "int8" else 0.0
    if enc != "raw":  # a fresh array of the declared dtype: inside the message's budget, or refused unbuilt
        budget.take(count * np.dtype(dtype).itemsize, path, f"{enc} {dtype} tensor of shape {shape}")
    try:
        arr = np.frombuffer(data, dtype=wire).reshape(shape)
    except (ValueError, OverflowError) as e:  # e.g. [0, 2**62]: zero bytes, impossible shape
        raise RemoteProtocolError(f"{path}: shape {shape} cannot be built: {e}") from e
    if dtype == "bool" and arr.size and np.frombuffer(data, dtype=np.uint8).max() > 1:
        raise RemoteProtocolError(f"{path}: bool tensor holds bytes other than 0 and 1")
    if enc == "fp16":
        return arr.astype(dtype)
    if enc == "int8":
        return _dequantize(arr, scale, dtype)
    if sys.byteorder == "big" and arr.dtype.byteorder == "<":  # pragma: no cover - little-endian CI
        arr = arr.astype(arr.dtype.newbyteorder("="))
    return arr


def _unpack_int4(t: dict[Any, Any], dtype: str, shape: list[int], count: int, data: bytes, path: str,
                 budget: _Budget) -> np.ndarray:
    """An int4 tensor, checked whole before its array is built: dtype, packed and scale byte counts, finite
    scales >= 0 that cannot overflow ``dtype``, no nibble 0 in signed data; decoded in ``_BLOCK`` steps so
    the scratch stays small."""
    if dtype not in _INT4_DTYPES:
        raise RemoteProtocolError(f"{path}: int4 carries {sorted(_INT4_DTYPES)} tensors, not {dtype}")
    signed, scales_bin = t["signed"], t["scales"]
    if not isinstance(signed, bool):
        raise RemoteProtocolError(f"{path}: int4 'signed' must be a bool, got {type(signed).__name__}")
    if not isinstance(scales_bin, bytes):
        raise RemoteProtocolError(f"{path}: int4 'scales' must be bin, got {type(scales_bin).__name__}")
    blocks = -(-count // INT4_BLOCK)
    if len(data) != (count + 1) // 2 or len(scales_bin) != 4 * blocks:
        raise RemoteProtocolError(
            f"{path}: shape {shape} of int4 {dtype} needs {(count + 1) // 2} data bytes and {4 * blocks} scale "
            f"bytes ({blocks} blocks of {INT4_BLOCK}), got {len(data)} and {len(scales_bin)}")
    budget.take((count * np.dtype(dtype).itemsize + 1) // 2, path, f"int4 {dtype} tensor of shape {shape}")
    scales = np.frombuffer(scales_bin, dtype="<f4")
    top = 7.0 if signed else 15.0
    if blocks and not (np.isfinite(scales).all() and scales.min() >= 0):
        raise RemoteProtocolError(f"{path}: int4 scales must be finite floats >= 0")
    if blocks and float(scales.max()) * top > float(np.finfo(dtype).max) * 1.0001:  # no honest sender makes one
        raise RemoteProtocolError(f"{path}: int4 scale {float(scales.max()):g} x {top:g} overflows {dtype}")
    packed = np.frombuffer(data, dtype=np.uint8)
    # the high nibble of the last byte of an odd count is padding, not an element
    if signed and count and (((packed & 0x0F) == 0).any() or ((packed[: count // 2] >> 4) == 0).any()):
        raise RemoteProtocolError(f"{path}: signed int4 data holds nibble 0, which is no level (-7..7 travel as 1..15)")
    try:
        out = np.empty(shape, dtype=dtype)
    except (ValueError, OverflowError, MemoryError) as e:
        raise RemoteProtocolError(f"{path}: shape {shape} cannot be built: {e}") from e
    flat = out.reshape(-1)
    step = _BLOCK  # a multiple of INT4_BLOCK and of 2: every step starts on a block and a byte
    for i in range(0, count, step):
        m = min(step, count - i)
        chunk = packed[i // 2 : (i + m + 1) // 2]
        nib = np.empty(2 * chunk.size, dtype=np.float32)
        nib[0::2] = chunk & 0x0F
        nib[1::2] = chunk >> 4
        if signed:
            nib -= 8
        nb = -(-m // INT4_BLOCK)
        vals = np.zeros(nb * INT4_BLOCK, np.float32)
        vals[: nib.size] = nib
        vals = (vals.reshape(nb, INT4_BLOCK) * scales[i // INT4_BLOCK : i // INT4_BLOCK + nb, None]).reshape(-1)
        flat[i : i + m] = vals[:m]
    return out


def _int8_scale(t: dict[Any, Any], dtype: str, path: str) -> float:
    """The int8 scale: a finite float >= 0 whose 127 steps fit ``dtype``. An int is refused (it would
    overflow or wrap in int8 arithmetic); 0.0 is what the encoder sends for an all-zero tensor."""
    scale = t["scale"]
    if not isinstance(scale, float) or not 0.0 <= scale < math.inf:
        raise RemoteProtocolError(f"{path}: int8 scale must be a finite float >= 0, got {scale!r:.40}")
    if scale * 127 > float(np.finfo(dtype).max) * 1.0001:  # no honest sender makes one
        raise RemoteProtocolError(f"{path}: int8 scale {scale:g} overflows {dtype}")
    return scale


def _dequantize(q: np.ndarray, scale: float, dtype: str) -> np.ndarray:
    """q * scale as ``dtype``, the one array of the declared size; where the arithmetic needs a wider
    dtype it runs in blocks of ``_BLOCK`` elements, so the scratch stays small (same values as a whole-array
    multiply: the operation is elementwise)."""
    math_dtype = _int8_math(dtype, scale)
    out = np.empty(q.shape, dtype=dtype)
    flat_q, flat_out = q.reshape(-1), out.reshape(-1)
    if math_dtype == out.dtype:
        np.multiply(flat_q, scale, out=flat_out)
        return out
    scratch = np.empty(min(_BLOCK, flat_q.size), dtype=math_dtype)
    for i in range(0, flat_q.size, _BLOCK):
        part = scratch[: min(_BLOCK, flat_q.size - i)]
        np.multiply(flat_q[i : i + _BLOCK], scale, out=part)
        flat_out[i : i + _BLOCK] = part
    return out
