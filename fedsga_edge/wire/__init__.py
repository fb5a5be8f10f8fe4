"""Wire format: messages, the msgpack tensor codec, chunking. numpy + msgpack only (no torch)."""

from .chunking import BROKER_PACKET_LIMITS, DEFAULT_HEADROOM, Reassembler, max_chunk_for, split_message
from .codec import DTYPES, INT4_BLOCK, MAX_EXPANSION, TENSOR_FORMATS, Admit, decode, encode
from .envelope import Envelope
from .errors import LocalProtocolError, RemoteProtocolError, WireError
from .messages import KINDS, PROTOCOL_VERSION, REQUIRED_FIELDS, Message, Outgoing, check_body

__all__ = [
    "BROKER_PACKET_LIMITS",
    "DEFAULT_HEADROOM",
    "DTYPES",
    "INT4_BLOCK",
    "KINDS",
    "MAX_EXPANSION",
    "PROTOCOL_VERSION",
    "REQUIRED_FIELDS",
    "TENSOR_FORMATS",
    "Admit",
    "Envelope",
    "LocalProtocolError",
    "Message",
    "Outgoing",
    "Reassembler",
    "RemoteProtocolError",
    "WireError",
    "check_body",
    "decode",
    "encode",
    "max_chunk_for",
    "split_message",
]
