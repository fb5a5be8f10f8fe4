"""Messages authenticated end to end, whoever carries them: a per-device key, a MAC on every message.

A broker (or anyone on the loopback transport) that can read or write every topic must still not be
able to forge an order or read a tensor. Each device shares one random 256-bit key with the
coordinator, made at enrolment (``broker-config --keys``, the trial's setup); a sealed message is
the encoded message inside a small frame::

    MAGIC (4) | mode (1) | len(sender) (1) | sender | len(recipient) (1) | recipient | ...
      mode 1 (MAC):     payload | HMAC-SHA256(mac key, header + payload) (32)
      mode 2 (AES-GCM): nonce (12) | AES-256-GCM(enc key, payload, aad=header) (payload + 16)

The MAC covers the whole encoded message (its run, sender, kind, round, seq and body) and the
frame's sender and recipient, so a message cannot be altered, moved to another run, sent back to
its sender or claimed by another device; the receiver checks it (constant time) before anything of
the message is decoded. ``MAGIC`` starts with 0xC1, a byte msgpack never uses, so a sealed frame
is never mistaken for a plain message and the other way round. The two keys of a device are derived
from its key with HMAC (one for the MAC, one for AES-GCM), so one key file serves both modes.

Replay: the MAC binds run, round and seq, which the roles check after it (the coordinator refuses a
request whose seq does not grow or whose round is not the open one; a device refuses a
``round_start`` that is not newer than the one it runs, and any order of another run).

numpy-free, torch-free: the device's ONNX path imports it. AES-GCM needs the ``cryptography``
package, imported only when encryption is asked for.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path

from .errors import LocalProtocolError, RemoteProtocolError

__all__ = ["KEY_BYTES", "MAGIC", "KeyFileError", "Keyring", "enrol", "is_sealed", "make_key", "read_key", "read_keys",
           "key_path", "write_key"]

MAGIC = b"\xc1FSA"
KEY_BYTES = 32
_MAC, _GCM = 1, 2
_TAG = 32
_NONCE = 12
_GCM_TAG = 16
_KEY_TEXT = re.compile(r"[0-9a-f]{64}")
_KEY_SUFFIX = ".key"


class KeyFileError(ValueError):
    """A key file that cannot be used (missing, readable by others, not 64 hex digits): the operator's to fix."""


def make_key() -> bytes:
    """A fresh random device key."""
    return secrets.token_bytes(KEY_BYTES)


def write_key(path: str | Path, key: bytes) -> Path:
    """Write ``key`` as hex to ``path``, mode 0600 from the start (never readable by others, even briefly)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key.hex() + "\n")
    return path


def read_key(path: str | Path) -> bytes:
    """A device key from its file; KeyFileError naming the problem (missing, open to others, malformed)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text().strip()
    except OSError as exc:
        raise KeyFileError(f"cannot read the key file {path}: {exc.strerror or exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise KeyFileError(f"key file {path} is open to other users (mode {stat.S_IMODE(mode):o}): chmod 600 it")
    if not _KEY_TEXT.fullmatch(text):
        raise KeyFileError(f"key file {path} does not hold a key (64 lowercase hex digits)")
    return bytes.fromhex(text)


def read_keys(folder: str | Path) -> dict[str, bytes]:
    """Every ``<device>.key`` in ``folder``: the coordinator's keyring (KeyFileError when there is none)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise KeyFileError(f"key folder {folder} does not exist")
    keys = {p.name[: -len(_KEY_SUFFIX)]: read_key(p) for p in sorted(folder.glob("*" + _KEY_SUFFIX))}
    if not keys:
        raise KeyFileError(f"key folder {folder} holds no <device>.key file")
    return keys


def key_path(folder: str | Path, device: str) -> Path:
    """Where ``device``'s key lives in a key folder."""
    return Path(folder) / f"{device}{_KEY_SUFFIX}"


def enrol(folder: str | Path, devices: list[str] | tuple[str, ...]) -> dict[str, Path]:
    """A fresh key per device in ``folder/<device>.key`` (mode 0600, the folder 0700); older keys there go:
    each enrolment's keys are its own. The coordinator reads the folder, each device its own file."""
    folder = Path(folder)
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(folder, 0o700)
    for old in folder.glob("*" + _KEY_SUFFIX):
        old.unlink()
    return {d: write_key(key_path(folder, d), make_key()) for d in devices}


def is_sealed(data: bytes | memoryview) -> bool:
    """Whether ``data`` is a sealed frame (not a plain message)."""
    return bytes(data[: len(MAGIC)]) == MAGIC


def _derive(key: bytes, label: bytes) -> bytes:
    return hmac.new(key, b"fedsga-edge " + label, hashlib.sha256).digest()


def _aead(key: bytes):  # noqa: ANN202 - cryptography's AESGCM, imported only for encryption
    try:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
    except ImportError:
        raise LocalProtocolError("payload encryption needs the 'cryptography' package (pip install cryptography)") from None
    return AESGCM(key)


class Keyring:
    """What one party seals and opens with: its own address and the key it shares with each peer.

    A device holds one entry (the coordinator's address -> its key), the coordinator one per enrolled
    device. ``encrypt``: seal with AES-GCM, and open only encrypted frames (a peer that sends tensors
    in clear is refused, not read)."""

    def __init__(self, me: str, keys: Mapping[str, bytes], *, encrypt: bool = False) -> None:
        for who, key in keys.items():
            if not isinstance(key, bytes) or len(key) != KEY_BYTES:
                raise LocalProtocolError(f"the key shared with {who!r} is not {KEY_BYTES} bytes")
        self.me, self.encrypt = me, encrypt
        self._mac = {who: _derive(k, b"mac") for who, k in keys.items()}
        self._keys = dict(keys)
        self._enc: dict[str, object] = {}
        if encrypt:  # fail now, naming the package, rather than on the first message
            _aead(_derive(bytes(KEY_BYTES), b"aes-gcm"))

    def knows(self, peer: str) -> bool:
        return peer in self._mac

    def seal(self, dst: str, payload: bytes) -> bytes:
        """``payload`` (an encoded message) for ``dst``, authenticated (and encrypted if ``encrypt``)."""
        if dst not in self._mac:
            raise LocalProtocolError(f"no key shared with {dst!r}: it is not enrolled")
        head = MAGIC + bytes([_GCM if self.encrypt else _MAC]) + _name(self.me) + _name(dst)
        if self.encrypt:
            nonce = secrets.token_bytes(_NONCE)
            return head + nonce + self._cipher(dst).encrypt(nonce, bytes(payload), head)
        h = hmac.new(self._mac[dst], head, hashlib.sha256)
        h.update(payload)
        return b"".join((head, payload, h.digest()))

    def sender_of(self, data: bytes) -> str | None:
        """The sender a sealed frame claims (unverified), or None: what a refusal is addressed to."""
        try:
            return _parse(data)[1]
        except RemoteProtocolError:
            return None

    def open(self, data: bytes | bytearray | memoryview) -> tuple[str, bytes]:
        """(sender, payload) of a sealed frame addressed to us; RemoteProtocolError naming what is wrong.

        Nothing of the payload is read before its MAC (or GCM tag) has been checked."""
        if not isinstance(data, bytes):
            data = bytes(data)
        if not is_sealed(data):
            raise RemoteProtocolError("message not authenticated (no MAC): this run authenticates every message; "
                                      "a device needs its key from enrolment")
        mode, sender, recipient, at = _parse(data)
        if recipient != self.me:
            raise RemoteProtocolError(f"authenticated message for {recipient!r}, not {self.me!r}: refused")
        if sender not in self._mac:
            raise RemoteProtocolError(f"no key for sender {sender!r}: not enrolled in this run")
        if mode == _MAC:
            if self.encrypt:
                raise RemoteProtocolError(f"message from {sender!r} is not encrypted: this run encrypts payloads")
            if len(data) < at + _TAG:
                raise RemoteProtocolError(f"authenticated message from {sender!r} is truncated")
            view = memoryview(data)
            h = hmac.new(self._mac[sender], view[:at], hashlib.sha256)
            h.update(view[at:-_TAG])
            if not hmac.compare_digest(view[-_TAG:], h.digest()):
                raise RemoteProtocolError(f"MAC of a message from {sender!r} does not match: forged, altered "
                                          "or sealed with another key")
            return sender, bytes(view[at:-_TAG])
        if mode == _GCM:
            return sender, self._decrypt(sender, bytes(data[:at]), bytes(data[at:]))
        raise RemoteProtocolError(f"authenticated message from {sender!r} has unknown mode {mode}")

    def _cipher(self, peer: str):  # noqa: ANN202 - an AESGCM, made on first use
        aead = self._enc.get(peer)
        if aead is None:
            self._enc[peer] = aead = _aead(_derive(self._keys[peer], b"aes-gcm"))
        return aead

    def _decrypt(self, sender: str, head: bytes, rest: bytes) -> bytes:
        try:
            aead = self._cipher(sender)
        except LocalProtocolError as exc:  # an encrypting peer, and no cryptography here
            raise RemoteProtocolError(f"message from {sender!r} is encrypted: {exc}") from None
        if len(rest) < _NONCE + _GCM_TAG:
            raise RemoteProtocolError(f"encrypted message from {sender!r} is truncated")
        try:
            return aead.decrypt(rest[:_NONCE], rest[_NONCE:], head)
        except Exception:  # cryptography's InvalidTag
            raise RemoteProtocolError(f"encrypted message from {sender!r} fails its tag: forged, altered or "
                                      "sealed with another key") from None


def _name(s: str) -> bytes:
    b = s.encode("utf-8")
    if not 0 < len(b) < 256:
        raise LocalProtocolError(f"address {s!r:.80} cannot be sealed (1-255 bytes)")
    return bytes([len(b)]) + b


def _parse(data: bytes) -> tuple[int, str, str, int]:
    """(mode, sender, recipient, where the rest starts) of a sealed frame's header."""
    try:
        at = len(MAGIC)
        mode = data[at]
        n = data[at + 1]
        sender = data[at + 2 : at + 2 + n].decode("utf-8")
        at += 2 + n
        m = data[at]
        recipient = data[at + 1 : at + 1 + m].decode("utf-8")
        at += 1 + m
        if at > len(data) or len(sender) == 0 or len(recipient) == 0:
            raise IndexError
    except (IndexError, UnicodeDecodeError):
        raise RemoteProtocolError(f"authenticated frame ({len(data)} bytes) has a malformed header") from None
    return mode, sender, recipient, at
