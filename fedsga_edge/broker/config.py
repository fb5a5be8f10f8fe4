"""Mosquitto configuration for a field run: one login per device, an ACL that binds each login to its topics.

docs/protocol.md ("Topics", "The sender is the topic") explains why the broker must enforce who may
publish where: the topic a payload arrives on *is* its sender. This module writes what Mosquitto
needs for that, and nothing here talks to a broker (no paho):

* ``mosquitto.conf``: ``allow_anonymous false``, the password file, the ACL, one listener (TLS when
  a certificate is given; then plaintext only on 127.0.0.1 if asked for), and on every listener
  ``use_username_as_clientid true``: the broker replaces the client id a client sends with its login,
  so one login cannot take over another's MQTT session (a connection with a client id already
  connected makes the broker drop the older one) by connecting with its client id;
* ``acl``: per login, only its own topics (device ``D``: write ``up/D``, read ``down/D`` and
  ``bcast``, its own ``status/D``; the coordinator: read every ``up/+`` and ``status/+``, write
  every ``down/+`` and ``bcast``);
* ``passwd``: random passwords hashed in Mosquitto's own format (by ``mosquitto_passwd -U`` when
  installed, so the format is the one the installed broker reads; else ``$7$`` PBKDF2-SHA512 as
  Mosquitto 2.0 writes it);
* ``credentials/<login>.env``: ``FEDSGA_EDGE_BROKER=mqtts://<login>:<password>@<host>:<port>``,
  mode 0600, one file to hand to each device (docs/deploy.md);
* ``keys/<device>.key``: each device's message key (mode 0600, the folder 0700): every message of the run
  is then authenticated end to end, whatever the broker does (fedsga_edge/wire/auth.py); the device takes
  its own file (``device --key``), the coordinator the folder (``coordinator --keys``).

``fedsga-edge broker-config`` (``fedsga_edge/cli/broker_cmd.py``) is the command around it.
"""

from __future__ import annotations

import base64
import grp
import hashlib
import hmac
import os
import re
import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

from fedsga_edge.transport.base import TransportError, check_address
from fedsga_edge.transport.mqtt import TOPIC_ROOT
from fedsga_edge.wire.auth import enrol

__all__ = [
    "COORDINATOR",
    "BrokerConfigError",
    "BridgeSpec",
    "BrokerFiles",
    "BrokerSpec",
    "TlsFiles",
    "acl_text",
    "bridge_text",
    "broker_url",
    "check_device_ids",
    "device_ids",
    "hash_password",
    "mosquitto_conf_text",
    "parse_devices",
    "parse_site",
    "read_bridge",
    "read_device_ids",
    "verify_password",
    "write_broker_config",
]

COORDINATOR = "coordinator"  # the coordinator's address and login (fedsga_edge.runbuild.COORDINATOR)
TLS_PORT, PLAIN_PORT = 8883, 1883
DEFAULT_MAX_PACKET = 256 * 1024  # >= every client's --max-packet (docs/protocol.md, "Chunking")
PBKDF2_ITERATIONS = 101  # what mosquitto_passwd 2.0 writes; passwords here are random 192-bit, not guessable
CREDENTIALS_ENV = "FEDSGA_EDGE_BROKER"  # the device command's --broker, as an environment variable
_FILE_NAMES = ("mosquitto.conf", "acl", "passwd")
# A listener setting (Mosquitto 2.0): it must follow each `listener` line. The client id becomes the login,
# so a login can only ever replace its own session, never the coordinator's or another device's.
BIND_CLIENT_ID = ("# The client id is the login: no login can take over another's session.",
                  "use_username_as_clientid true")
_MQTT_SPECIAL = {"/": "the topic level separator", "+": "an MQTT wildcard", "#": "an MQTT wildcard"}
_CONF_VALUE = re.compile(r"\S+")  # one token: Mosquitto splits its config lines on whitespace
_HOST = re.compile(r"[A-Za-z0-9._:-]{1,253}")  # a name or an IPv4/IPv6 address: safe in a URL and a config line


class BrokerConfigError(ValueError):
    """The operator's input cannot make a safe broker config; the message says what to change."""


# ---------------------------------------------------------------------------------------- device ids


def device_ids(count: int) -> list[str]:
    """The ids ``fedsga-edge device --index 0..count-1`` uses (``fedsga_edge.runbuild.client_id``)."""
    if not 1 <= count <= 100_000:
        raise BrokerConfigError(f"--devices must be 1-100000 (got {count})")
    return [f"client-{i:03d}" for i in range(count)]


def _why_bad(name: str) -> str | None:
    try:
        check_address(name)
    except TransportError:
        special = [f"{c!r} ({why})" for c, why in _MQTT_SPECIAL.items() if c in name]
        if special:
            return f"contains {', '.join(special)}"
        if not name:
            return "is empty"
        if len(name) > 128:
            return f"is {len(name)} characters long (at most 128)"
        return "may use only letters, digits and . _ : - (docs/protocol.md, Topics)"
    return None


def check_device_ids(ids: Iterable[str], *, coordinator: str = COORDINATOR,
                     where: list[str] | None = None) -> list[str]:
    """Return ``ids`` as a list, or raise naming every bad id: MQTT-unsafe, a duplicate, or the coordinator's.

    ``where[i]`` says where id ``i`` came from (e.g. ``"devices.txt:3"``) for the message.
    """
    ids = list(ids)
    where = where or [f"id {i + 1}" for i in range(len(ids))]
    problems, first = [], {}
    for name, at in zip(ids, where, strict=True):
        why = _why_bad(name)
        if why:
            problems.append(f"{at}: device id {name!r:.60} {why}")
        elif name == coordinator:
            problems.append(f"{at}: {name!r} is the coordinator's login, not a device id")
        elif name in first:
            problems.append(f"{at}: device id {name!r} repeats {first[name]}")
        else:
            first[name] = at
    if not ids:
        problems.append("no device ids")
    if problems:
        more = f"; and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise BrokerConfigError("; ".join(problems[:20]) + more)
    return ids


def read_device_ids(path: str | Path) -> list[str]:
    """Ids from a text file, one per line; blank lines and lines starting with ``#`` are skipped."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BrokerConfigError(f"cannot read the device file {path}: {exc}") from None
    ids, where = [], []
    for no, line in enumerate(text.splitlines(), 1):
        name = line.strip()  # no trailing comments: a '#' after an id is an error to report, not to drop
        if name and not name.startswith("#"):
            ids.append(name)
            where.append(f"{path.name}:{no}")
    if not ids:
        raise BrokerConfigError(f"the device file {path} lists no device ids (one per line)")
    return check_device_ids(ids, where=where)


def parse_devices(spec: str) -> list[str]:
    """``--devices``: a count N (ids ``client-000``...), an index range ``I-J`` (``client-I`` .. ``client-J``)
    or the path of a file of ids."""
    spec = spec.strip()
    if spec.isdigit():
        return device_ids(int(spec))
    if re.fullmatch(r"\d+-\d+", spec):  # a site's share of client-000 ...: indices FIRST-LAST
        first, last = (int(x) for x in spec.split("-"))
        if first > last:
            raise BrokerConfigError(f"--devices {spec}: the first index is after the last")
        return device_ids(last + 1)[first:]
    if not Path(spec).is_file():
        raise BrokerConfigError(f"--devices takes a number of devices or a file of device ids; {spec!r} is neither")
    return read_device_ids(spec)


def parse_site(spec: str) -> tuple[str, tuple[str, ...]]:
    """``--site NAME=DEVICES``: a site's name and the devices behind its broker (``parse_devices``' forms)."""
    name, eq, devices = spec.partition("=")
    if not eq or not name.strip() or not devices.strip():
        raise BrokerConfigError(f"--site {spec!r:.80} must be NAME=DEVICES (e.g. lab=0-9)")
    return name.strip(), tuple(parse_devices(devices))


def read_bridge(value: str) -> str:
    """``--bridge``: a broker URL, or a credentials file (``FEDSGA_EDGE_BROKER=<url>``) holding one."""
    path = Path(value)
    if "://" in value or not path.is_file():
        return value
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise BrokerConfigError(f"cannot read --bridge {path}: {exc}") from None
    for line in lines:
        if line.startswith(CREDENTIALS_ENV + "="):
            return line.split("=", 1)[1].strip()
    raise BrokerConfigError(f"--bridge {path} holds no {CREDENTIALS_ENV}= line (a credentials file of broker-config)")


# ---------------------------------------------------------------------------------------- the spec


@dataclass(frozen=True)
class TlsFiles:
    """The broker's certificate and key, and the CA devices use to check it (optional for the broker)."""

    cert: Path
    key: Path
    ca: Path | None = None


@dataclass(frozen=True)
class BridgeSpec:
    """A site broker's bridge to the central broker: where it is and the site's login there (the URL of the
    central config's ``credentials/site-<name>.env``), and the CA that signed the central's certificate."""

    url: str
    ca: Path | None = None
    qos_in: int = 0  # the QoS of the messages bridged to the site (bridge_text says why 0)

    def __post_init__(self) -> None:
        from urllib.parse import unquote, urlsplit

        parts = urlsplit(self.url)
        problems = [] if self.qos_in in (0, 1) else [f"--bridge-qos must be 0 or 1 (got {self.qos_in})"]
        if parts.scheme not in ("mqtt", "mqtts"):
            problems.append("must start mqtt:// or mqtts://")
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or not _HOST.fullmatch(parts.hostname) or port is None:
            problems.append("must name the central broker's host and port")
        if not parts.username or not parts.password or not _CONF_VALUE.fullmatch(unquote(parts.password)):
            problems.append("must carry the site's login and password (the central config's credentials/site-<name>.env)")
        if problems:
            raise BrokerConfigError(f"--bridge {self.url.split('@')[-1]!r:.80}: " + "; ".join(problems))

    def parts(self) -> tuple[str, int, str, str, bool]:
        """(host, port, login, password, tls)."""
        from urllib.parse import unquote, urlsplit

        u = urlsplit(self.url)
        return u.hostname or "", int(u.port or 0), unquote(u.username or ""), unquote(u.password or ""), \
            u.scheme == "mqtts"


@dataclass(frozen=True)
class BrokerSpec:
    """Everything the generated files depend on, checked on construction."""

    devices: tuple[str, ...]
    run: str | None = None  # None: the logins work for every run (``fedsga/+/...``)
    tls: TlsFiles | None = None
    port: int | None = None  # default: 8883 with TLS, 1883 without
    bind: str | None = None  # None: every interface
    loopback_port: int | None = None  # an extra plaintext listener on 127.0.0.1 (the coordinator on this host)
    host: str = field(default_factory=socket.gethostname)  # what devices put in their broker URL
    coordinator: str = COORDINATOR
    max_packet: int = DEFAULT_MAX_PACKET
    persistence: bool = True
    # the central broker of several sites: each site's bridge login (site-<name>) and the devices behind it
    sites: tuple[tuple[str, tuple[str, ...]], ...] = ()
    bridge: BridgeSpec | None = None  # a site broker: its bridge to the central one

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(check_device_ids(self.devices, coordinator=self.coordinator)))
        problems = []
        placed: dict[str, str] = {}
        for name, devices in self.sites:
            if why := _why_bad(name):
                problems.append(f"--site {name!r:.60} {why}")
            for d in devices:
                if d not in self.devices:
                    problems.append(f"--site {name}: {d} is not one of --devices")
                elif d in placed:
                    problems.append(f"--site {name}: {d} is already behind site {placed[d]}")
                placed[d] = name
        if self.sites and self.bridge is not None:
            problems.append("a broker is either the central one (--site) or a site's (--bridge), not both")
        for what, name in (("--run", self.run), ("coordinator", self.coordinator)):
            if name is not None and (why := _why_bad(name)):
                problems.append(f"{what} {name!r:.60} {why}")
        for what, port in (("--port", self.port), ("--loopback-port", self.loopback_port)):
            if port is not None and not 1 <= port <= 65535:
                problems.append(f"{what} must be 1-65535 (got {port})")
        if self.loopback_port is not None and self.loopback_port == self.listen_port:
            problems.append(f"--loopback-port {self.loopback_port} is the main listener's port too")
        for what, value in (("--bind", self.bind), ("--host", self.host)):
            if value is not None and not _HOST.fullmatch(value):
                problems.append(f"{what} {value!r:.80} must be a host name or an IP address")
        if not 1024 <= self.max_packet <= 256 * 1024 * 1024:
            problems.append(f"--max-packet must be 1024 B - 256 MiB (got {self.max_packet})")
        for what, path in self.tls_files():
            if not _CONF_VALUE.fullmatch(str(path)):
                problems.append(f"{what} {str(path)!r}: Mosquitto cannot read a path with spaces")
        if problems:
            raise BrokerConfigError("; ".join(problems))
        if self.tls is not None:  # the config must name them wherever mosquitto's working directory is
            object.__setattr__(self, "tls", TlsFiles(*(None if p is None else Path(p).absolute()
                                                       for p in (self.tls.cert, self.tls.key, self.tls.ca))))

    def tls_files(self) -> list[tuple[str, Path]]:
        """(flag, path) of every TLS file given."""
        if self.tls is None:
            return []
        return [(what, Path(p)) for what, p in (("--tls-cert", self.tls.cert), ("--tls-key", self.tls.key),
                                                ("--ca", self.tls.ca)) if p is not None]

    @property
    def listen_port(self) -> int:
        return self.port or (TLS_PORT if self.tls else PLAIN_PORT)

    @property
    def run_level(self) -> str:
        return self.run or "+"

    def topic(self, *levels: str) -> str:
        return "/".join((TOPIC_ROOT, self.run_level, *levels))

    @property
    def site_logins(self) -> dict[str, tuple[str, ...]]:
        """The central broker's bridge logins (``site-<name>``) -> the devices behind each."""
        return {f"site-{name}": devices for name, devices in self.sites}


# ---------------------------------------------------------------------------------------- file texts


def acl_text(spec: BrokerSpec) -> str:
    """Mosquitto ``acl_file``: every login gets exactly its topics (docs/protocol.md, Topics)."""
    t = spec.topic
    scope = f"run {spec.run!r}" if spec.run else "every run (fedsga/+/...)"
    lines = [
        "# fedsga-edge broker ACL, written by `fedsga-edge broker-config` (docs/protocol.md, Topics).",
        f"# Scope: {scope}. Mosquitto silently drops a publish or a delivery a login is not granted here,",
        "# so a device can neither speak for another device nor read another device's traffic. The broker",
        "# uses each login as its client id (use_username_as_clientid), so status/<client id> is status/<login>.",
        "",
        f"user {spec.coordinator}",
        f"topic read {t('up', '+')}",
        f"topic write {t('down', '+')}",
        f"topic write {t('bcast')}",
        f"topic read {t('status', '+')}",
        f"topic write {t('status', spec.coordinator)}",
    ]
    for d in spec.devices:
        lines += ["", f"user {d}", f"topic write {t('up', d)}", f"topic read {t('down', d)}",
                  f"topic read {t('bcast')}", f"topic readwrite {t('status', d)}"]
    for login, devices in spec.site_logins.items():  # a site's bridge carries its devices' topics, no others
        lines += ["", f"# the bridge of {login}: the topics of the {len(devices)} device(s) behind it", f"user {login}",
                  f"topic read {t('bcast')}"]
        for d in devices:
            lines += [f"topic write {t('up', d)}", f"topic read {t('down', d)}", f"topic write {t('status', d)}"]
    return "\n".join(lines) + "\n"


def bridge_text(spec: BrokerSpec) -> list[str]:
    """The site broker's bridge section: each of its devices' topics, each way; the site's login at the
    central broker. The site's own ACL has already bound each device to its topics.

    Up (site -> central) at QoS 1; down at ``spec.bridge.qos_in``, 0 by default: Mosquitto (2.0.11 measured)
    sets TCP_NODELAY only on the connections it accepts, not on a bridge's own, so the site's PUBACK for a
    QoS-1 message coming in over the bridge sits in Nagle's buffer, and the device's next request, written
    behind it, waits for the central's delayed ACK: ~48 ms per request (docs/deploy.md, "Devices at several
    sites"). At QoS 0 a message crossing when the bridge drops is lost: its device loses the round (its
    request times out), as for any reply lost on the way."""
    assert spec.bridge is not None
    host, port, login, password, tls = spec.bridge.parts()
    t = spec.topic
    lines = ["", "# The bridge to the central broker (the coordinator's): only this site's devices' topics cross it.",
             f"connection {login}", f"address {host}:{port}", f"remote_username {login}",
             f"remote_password {password}", f"remote_clientid {login}", "cleansession false",
             "notifications false", "bridge_protocol_version mqttv311", "try_private true",
             f"topic {t('bcast')} in {spec.bridge.qos_in}"]
    for d in spec.devices:
        lines += [f"topic {t('up', d)} out 1", f"topic {t('status', d)} out 1",
                  f"topic {t('down', d)} in {spec.bridge.qos_in}"]
    if tls:
        lines += ([f"bridge_cafile {Path(spec.bridge.ca).absolute()}"] if spec.bridge.ca else
                  ["bridge_capath /etc/ssl/certs"])
        lines.append("bridge_tls_version tlsv1.2")
    return lines


def mosquitto_conf_text(spec: BrokerSpec, config_dir: str | Path) -> str:
    """Mosquitto's config, naming ``passwd`` and ``acl`` in ``config_dir`` (where they will live).

    It works alone (``mosquitto -c mosquitto.conf``) and as a drop-in next to Debian's
    ``/etc/mosquitto/mosquitto.conf``, which already sets ``persistence_location``, ``log_dest`` and
    ``pid_file`` (Mosquitto refuses some settings twice, so this file leaves them out).
    """
    config_dir = str(config_dir)
    if not _CONF_VALUE.fullmatch(config_dir):
        raise BrokerConfigError(f"--out {config_dir!r}: Mosquitto cannot read a path with spaces")
    scope = f"run {spec.run}" if spec.run else "any run"
    lines = [
        "# Mosquitto for fedsga-edge, written by `fedsga-edge broker-config` (docs/deploy.md, docs/protocol.md).",
        f"# {len(spec.devices)} device login(s) and the coordinator's, for {scope}. Regenerating makes new passwords.",
        "# Use alone: mosquitto -c <this file>; or as a drop-in: /etc/mosquitto/conf.d/fedsga.conf (Debian).",
        "",
        "per_listener_settings false",
        "allow_anonymous false",
        f"password_file {config_dir.rstrip('/')}/passwd",
        f"acl_file {config_dir.rstrip('/')}/acl",
        "",
        "# At least every client's --max-packet (bigger messages are chunked to fit it).",
        f"max_packet_size {spec.max_packet}",
        "# Without it each small reply waits ~40 ms for a delayed ACK (docs/protocol.md).",
        "set_tcp_nodelay true",
        f"persistence {'true' if spec.persistence else 'false'}",
        "",
    ]
    where = f" {spec.bind}" if spec.bind else ""
    if spec.tls is not None:
        lines += ["# Devices (and every client on another host): TLS only.", f"listener {spec.listen_port}{where}",
                  *BIND_CLIENT_ID, f"certfile {spec.tls.cert}", f"keyfile {spec.tls.key}"]
        if spec.tls.ca is not None:
            lines.append(f"cafile {spec.tls.ca}")
        lines.append("tls_version tlsv1.2")
    else:
        lines += ["# Plaintext: logins and payloads cross the network unencrypted. Give --tls-cert/--tls-key for TLS.",
                  f"listener {spec.listen_port}{where}", *BIND_CLIENT_ID]
    if spec.loopback_port is not None:
        lines += ["", "# Plaintext for processes on this host only (e.g. the coordinator); logins and the ACL apply.",
                  f"listener {spec.loopback_port} 127.0.0.1", *BIND_CLIENT_ID]
    if spec.bridge is not None:
        lines += bridge_text(spec)
    return "\n".join(lines) + "\n"


def broker_url(spec: BrokerSpec, login: str, password: str, *, loopback: bool = False) -> str:
    """The ``--broker`` URL for ``login`` (``MqttTransport.from_url`` unquotes the user and password)."""
    if loopback:
        scheme, host, port = "mqtt", "127.0.0.1", spec.loopback_port
    else:
        scheme, host, port = ("mqtts" if spec.tls else "mqtt"), spec.host, spec.listen_port
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{quote(login, safe='')}:{quote(password, safe='')}@{host}:{port}"


# ---------------------------------------------------------------------------------------- passwords


def make_password() -> str:
    """32 URL-safe characters (192 random bits): nothing to quote in a URL or an env file."""
    return secrets.token_urlsafe(24)


def hash_password(password: str, *, salt: bytes | None = None, iterations: int = PBKDF2_ITERATIONS) -> str:
    """Mosquitto 2.0's ``$7$`` hash: ``$7$<iterations>$<b64 salt>$<b64 PBKDF2-HMAC-SHA512, 64 bytes>``."""
    salt = os.urandom(12) if salt is None else salt
    digest = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, iterations, 64)
    return f"$7${iterations}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def verify_password(password: str, hashed: str) -> bool:
    """Check ``password`` against a ``$7$`` (PBKDF2-SHA512) or ``$6$`` (salted SHA-512) Mosquitto hash."""
    parts = hashed.split("$")
    try:
        if len(parts) == 5 and parts[1] == "7":
            salt, want = base64.b64decode(parts[3]), base64.b64decode(parts[4])
            got = hashlib.pbkdf2_hmac("sha512", password.encode("utf-8"), salt, int(parts[2]), len(want))
        elif len(parts) == 4 and parts[1] == "6":
            salt, want = base64.b64decode(parts[2]), base64.b64decode(parts[3])
            got = hashlib.sha512(password.encode("utf-8") + salt).digest()
        else:
            return False
    except ValueError:
        return False
    return hmac.compare_digest(got, want)


def _mosquitto_passwd() -> str | None:
    return shutil.which("mosquitto_passwd") or next(
        (p for p in ("/usr/bin/mosquitto_passwd", "/usr/local/bin/mosquitto_passwd") if os.access(p, os.X_OK)), None)


def _hash_file(path: Path, passwords: Mapping[str, str], hasher: str) -> str:
    """Write Mosquitto's password file at ``path``; returns the hasher used.

    ``mosquitto_passwd -U`` hashes a plaintext file in place, so the passwords never appear on a
    command line (``-b`` would show them to every local user in ``ps``).
    """
    tool = _mosquitto_passwd() if hasher in ("auto", "mosquitto_passwd") else None
    if hasher == "mosquitto_passwd" and tool is None:
        raise BrokerConfigError("mosquitto_passwd is not installed (Debian: apt-get install mosquitto)")
    if hasher not in ("auto", "mosquitto_passwd", "python"):
        raise BrokerConfigError(f"hasher must be auto, mosquitto_passwd or python (got {hasher!r})")
    if tool is None:
        _write(path, "".join(f"{u}:{hash_password(p)}\n" for u, p in passwords.items()), 0o640)
        return "python"
    tmp = path.with_name(f".{path.name}.plain")
    _write(tmp, "".join(f"{u}:{p}\n" for u, p in passwords.items()), 0o600)
    try:
        res = subprocess.run([tool, "-U", str(tmp)], check=False, capture_output=True, text=True, timeout=60)
        if res.returncode != 0:
            raise BrokerConfigError(f"{tool} -U failed: {(res.stderr or res.stdout).strip()[:300]}")
        text = tmp.read_text()
    finally:
        tmp.unlink(missing_ok=True)
    if any(":$" not in line for line in text.splitlines()):
        raise BrokerConfigError(f"{tool} -U left a password unhashed")
    _write(path, text, 0o640)
    return "mosquitto_passwd"


# ---------------------------------------------------------------------------------------- writing


@dataclass(frozen=True)
class BrokerFiles:
    """What ``write_broker_config`` wrote. ``credentials`` maps each login to its env file."""

    conf: Path
    acl: Path
    passwd: Path
    credentials: dict[str, Path]
    urls: dict[str, str]  # login -> the URL in its credentials file (secret)
    hasher: str
    keys: dict[str, Path]  # device -> its message key (keys/<device>.key, mode 0600): the coordinator's --keys


def _write(path: Path, text: str, mode: int) -> None:
    """Replace ``path`` atomically, with ``mode`` from the first byte (no window with wider permissions)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def _share_with_broker(path: Path) -> None:
    """As root, give the ``mosquitto`` group read access (Debian's broker runs as user mosquitto)."""
    if os.geteuid() != 0:
        return
    try:
        os.chown(path, 0, grp.getgrnam("mosquitto").gr_gid)
    except (KeyError, OSError):
        pass


def write_broker_config(spec: BrokerSpec, out: str | Path, *, force: bool = False, hasher: str = "auto",
                        passwords: Mapping[str, str] | None = None, keys: str | Path | None = None) -> BrokerFiles:
    """Write ``mosquitto.conf``, ``acl``, ``passwd``, ``credentials/<login>.env`` and ``keys/<device>.key``
    (each device's message key, fedsga_edge/wire/auth.py) into ``out``.

    Refuses to overwrite an earlier config unless ``force`` (that would change every password).
    ``passwords`` fixes some logins' passwords (the rest are random). ``keys``: the devices' message keys
    already written (a site broker's devices use the central config's ``keys/``), none made here.
    The central broker of several sites (``spec.sites``) also gets one login per site, ``site-<name>``,
    whose credentials file is the site broker's ``--bridge``; a site broker's config (``spec.bridge``)
    holds that password, so it is written mode 0640 like the password file.
    """
    out = Path(out).absolute()
    logins = [spec.coordinator, *spec.devices, *spec.site_logins]
    creds_dir = out / "credentials"
    existing = [out / n for n in _FILE_NAMES if (out / n).exists()]
    existing += sorted(creds_dir.glob("*.env")) if creds_dir.is_dir() else []
    if existing and not force:
        raise BrokerConfigError(f"{out} already holds a broker config ({', '.join(p.name for p in existing[:4])}); "
                                "regenerating changes every password: pass --force to do it anyway")
    given = {d: Path(keys).absolute() / f"{d}.key" for d in spec.devices} if keys is not None else {}
    missing = [f"{what} {path}: no such file" for what, path in spec.tls_files() if not path.is_file()]
    missing += [f"--keys {keys}: no key for {d} ({p})" for d, p in list(given.items()) if not p.is_file()][:5]
    if missing:
        raise BrokerConfigError("; ".join(missing))
    conf = mosquitto_conf_text(spec, out)  # checks the path before anything is written
    out.mkdir(parents=True, exist_ok=True)
    creds_dir.mkdir(mode=0o700, exist_ok=True)
    os.chmod(creds_dir, 0o700)
    for stale in creds_dir.glob("*.env"):
        stale.unlink()
    pw = {login: (passwords or {}).get(login) or make_password() for login in logins}
    used = _hash_file(out / "passwd", pw, hasher)
    _write(out / "acl", acl_text(spec), 0o640)
    _write(out / "mosquitto.conf", conf, 0o640 if spec.bridge is not None else 0o644)
    for p in (out / "passwd", out / "acl", *([out / "mosquitto.conf"] if spec.bridge is not None else [])):
        _share_with_broker(p)
    urls, creds = {}, {}
    for login in logins:
        local = login == spec.coordinator and spec.loopback_port is not None
        urls[login] = broker_url(spec, login, pw[login], loopback=local)
        role = ("the coordinator" if login == spec.coordinator else
                f"the bridge of {login}" if login in spec.site_logins else f"device {login}")
        text = (f"# Broker login of {role}, written by `fedsga-edge broker-config`. Secret: keep it mode 0600.\n"
                f"# On the device: /etc/fedsga-edge/credentials.env (docs/deploy.md).\n"
                f"{CREDENTIALS_ENV}={urls[login]}\n")
        creds[login] = creds_dir / f"{login}.env"
        _write(creds[login], text, 0o600)
    key_files = enrol(out / "keys", spec.devices) if keys is None else given
    return BrokerFiles(out / "mosquitto.conf", out / "acl", out / "passwd", creds, urls, used, key_files)
