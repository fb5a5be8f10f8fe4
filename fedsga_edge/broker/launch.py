"""MQTT brokers for a trial on one machine: the embedded one pip installs, and Mosquitto.

``fedsga-edge trial`` needs a broker and should not need a system package, so by default it starts
the *embedded* broker: rumqttd (Rust) compiled into the ``iotcore`` wheel (no other dependencies,
part of ``fedsga-edge[train]``). ``start_mosquitto`` runs Mosquitto instead, which a field trial
with logins, ACLs and TLS needs anyway (docs/protocol.md, "A broker for a field trial").

Both launchers run the broker as a child process bound to 127.0.0.1 on a free port, write its log
(and its configuration) into ``log_dir``, and return a ``RunningBroker`` whose ``stop()`` ends the
process and waits for it. A broker never outlives its parent: on Linux the child gets SIGTERM when
the parent dies (PR_SET_PDEATHSIG), and the embedded one also exits when its stdin pipe closes.

What the embedded broker needs, and gets here (tests/test_trial.py checks all but the memory bound):

* **127.0.0.1 only.** iotcore binds 0.0.0.0 by default; the configuration names 127.0.0.1 and has
  no console/metrics listener.
* **Payload limit.** rumqttd's default ``max_payload_size`` is 20 KB and a publisher above it is
  disconnected; here it is ``max_payload`` (default 8 MiB, far above the transport's 256 KiB
  chunks, see docs/protocol.md "Chunking").
* **Bounded memory.** rumqttd keeps every publish in an in-memory log per subscription filter and
  PUBACKs at once, so a fast publisher is never slowed by a slow subscriber; unbounded, 400 x 4 MiB
  publishes held ~1.6 GiB. The log here keeps ``segments`` segments of ``segment_bytes`` per filter
  (default 8 x 8 MiB), and ``inflight`` (default 32) bounds the publishes queued per connection.
  The price: a subscriber that falls more than about ``(segments - 1) * segment_bytes`` (plus its
  inflight window) behind on one filter loses the oldest messages (rumqttd jumps its cursor), which
  the transport sees as a request that times out. Measured (benchmarks/wire.py): 200 x 1 MiB
  published at full speed to a subscriber that takes 50 ms per message, 164 arrived; Mosquitto
  delivers all 200 and holds the backlog in memory instead. The protocol is request/reply in
  lockstep per device, so a filter holds at most about one message per device in flight: the
  default leaves room for 56 MiB of such messages at once (see benchmarks/wire.py for the sizes).
* **Quiet log.** rumqttd wraps each packet in a tracing span that reaches Python's ``logging`` as an
  ERROR record; its logger is muted unless ``FEDSGA_BROKER_DEBUG=1``.
* **TCP_NODELAY.** rumqttd does not set it, and every small reply then waits ~40 ms for a delayed
  ACK (47 ms per request/reply round trip measured, 1.6 ms with it). The child sets it on the
  listening socket, whose accepted connections inherit it (Linux), before it reports ready.
* **Clean stop.** rumqttd has no shutdown API, so it runs in its own process: ``stop()`` terminates
  it and the port is free when ``stop()`` returns.
* **QoS 1, retained messages, last will, persistent sessions** (docs/protocol.md "Status and last
  will", "Connection, sessions, reconnects"): rumqttd 0.20 supports all four.
* **Logins.** 127.0.0.1 still lets every local user in, so the trial gives its broker ``RunLogins``: a
  random password per device login and one for the coordinator, in the ``[v4.1.connections.auth]``
  table of ``broker.toml`` (mode 0600). rumqttd then closes every connection without a listed login
  and password (anonymous ones too), before any subscribe or publish. That is all rumqttd 0.20 can
  do from its configuration: no ACL, so it cannot bind a login to its topics or its client id (its
  ``external_auth`` hook is Rust-only). ``start_secured_mosquitto`` runs Mosquitto on the
  ``broker-config`` files instead (per-login ACL, client id = login), what ``trial --broker
  mosquitto`` uses. ``start_embedded`` without logins is open: for tests and benchmarks only.

The broker process runs only ``iotcore``: it is started as ``python -c`` code, so that nothing of
this project (torch least of all) is loaded into it.
"""

from __future__ import annotations

import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import quote, urlsplit

__all__ = [
    "BrokerError",
    "RunLogins",
    "RunningBroker",
    "check_reachable",
    "embedded_available",
    "free_port",
    "mosquitto_path",
    "run_mosquitto",
    "start_embedded",
    "start_mosquitto",
    "start_secured_mosquitto",
]

MiB = 1024 * 1024


class BrokerError(RuntimeError):
    """A broker could not be started or reached; the message says why and what to do."""


@dataclass(frozen=True)
class RunLogins:
    """One run's broker logins: a random password per device and one for the coordinator.

    Secret, so they live in memory, in mode-0600 files and in the environment of the processes a trial
    starts (``FEDSGA_EDGE_BROKER``), never on a command line (``ps`` shows those to every local user)."""

    passwords: Mapping[str, str]
    coordinator: str = "coordinator"

    @classmethod
    def generate(cls, devices: Iterable[str], coordinator: str = "coordinator") -> RunLogins:
        """192 random bits per login, URL- and TOML-safe."""
        return cls({login: secrets.token_urlsafe(24) for login in (coordinator, *devices)}, coordinator)

    @property
    def devices(self) -> list[str]:
        return [login for login in self.passwords if login != self.coordinator]

    def url(self, login: str, host: str, port: int) -> str:
        """The ``--broker`` URL of ``login`` (a KeyError for a login the run does not have)."""
        return f"mqtt://{quote(login, safe='')}:{quote(self.passwords[login], safe='')}@{host}:{port}"


@dataclass
class RunningBroker:
    """A broker child process on 127.0.0.1; ``stop()`` (or leaving a ``with`` block) ends it."""

    kind: str  # "embedded" or "mosquitto"
    host: str
    port: int
    proc: subprocess.Popen
    log: Path
    _files: list[IO[Any]] = field(default_factory=list, repr=False)
    conf: Path | None = None  # Mosquitto's config file: what restart() starts again
    logins: RunLogins | None = field(default=None, repr=False)  # None: the broker takes anonymous clients

    @property
    def url(self) -> str:
        """The broker's address, without a login (safe to print)."""
        return f"mqtt://{self.host}:{self.port}"

    def url_for(self, login: str) -> str:
        """``login``'s URL with its password (secret), or ``url`` on a broker without logins."""
        return self.url if self.logins is None else self.logins.url(login, self.host, self.port)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def running(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate the broker, wait for it (kill after ``timeout``) and close its pipes. Idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        for f in self._files:
            f.close()
        self._files.clear()

    def restart(self, down_s: float = 0.0, timeout: float = 10.0) -> None:
        """Stop, stay down ``down_s`` seconds, start again on the same port and config (Mosquitto).

        For broker-restart tests; the log is appended to, so both lives stay in one log."""
        if self.conf is None:
            raise BrokerError(f"a {self.kind} broker cannot restart here (only a Mosquitto started from a config)")
        self.stop()
        time.sleep(down_s)
        again = run_mosquitto(self.conf, self.port, log=self.log, host=self.host, timeout=timeout)
        self.proc, self._files = again.proc, again._files

    def __enter__(self) -> RunningBroker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# ------------------------------------------------------------------ helpers


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS's pick)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def die_with_parent() -> None:
    """Linux: the child gets SIGTERM when its parent dies, even by SIGKILL (no orphans: brokers,
    and the processes of a trial). Pass as ``preexec_fn``."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:].strip()
    except OSError:
        return ""


def check_reachable(url: str, timeout: float = 5.0) -> None:
    """Fail fast (BrokerError) when nothing accepts TCP connections at ``url``'s host and port."""
    u = urlsplit(url)
    if u.scheme not in ("mqtt", "mqtts") or not u.hostname:
        raise BrokerError(f"broker url must look like mqtt://host:1883 or mqtts://host:8883, got {url!r}")
    try:
        port = u.port or (8883 if u.scheme == "mqtts" else 1883)
    except ValueError:
        raise BrokerError(f"bad port in broker url {url!r}") from None
    try:
        socket.create_connection((u.hostname, port), timeout=timeout).close()
    except OSError as exc:
        raise BrokerError(f"cannot reach broker {url}: {exc.strerror or exc}") from None


# ------------------------------------------------------------------ embedded (iotcore / rumqttd)


def embedded_available() -> bool:
    """Whether the embedded broker's package (``iotcore``) is installed."""
    import importlib.util

    return importlib.util.find_spec("iotcore") is not None


# The broker process: run rumqttd on a thread (run_forever releases the GIL), set TCP_NODELAY on its
# listening socket, then write the ready file. It exits when the parent closes our stdin.
# `-c` code, not `-m fedsga_edge...`: importing this package would import torch into the broker.
_CHILD = r"""
import logging, os, signal, socket, sys, threading, time
if sys.platform.startswith("linux"):  # SIGTERM when the parent dies (set here: no preexec_fn in a threaded parent)
    import ctypes
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass
conf, ready, host, port = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
debug = os.environ.get("FEDSGA_BROKER_DEBUG") == "1"
logging.basicConfig(level=logging.DEBUG if debug else logging.WARNING, stream=sys.stdout,
                    format="%(asctime)s %(levelname)s %(name)s: %(message)s")
logging.getLogger("rumqttd").setLevel(logging.DEBUG if debug else logging.CRITICAL)
from iotcore import __version__
from iotcore.iotcore import IotCoreBroker
broker = IotCoreBroker(config_path=conf)
def serve():
    try:
        broker.run_forever()
    except BaseException as exc:
        print(f"embedded broker stopped: {exc}", flush=True)
    os._exit(3)
threading.Thread(target=serve, daemon=True).start()
def nodelay():
    for name in os.listdir("/proc/self/fd" if os.path.isdir("/proc/self/fd") else "/dev/fd"):
        try:
            s = socket.socket(fileno=int(name))
        except (OSError, ValueError):
            continue
        try:
            if (s.type == socket.SOCK_STREAM and s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
                    and s.getsockname()[:2] == (host, port)):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return True
        except OSError:
            pass
        finally:
            s.detach()
    return False
deadline = time.monotonic() + 10
while not nodelay():
    if time.monotonic() > deadline:
        print("warning: could not set TCP_NODELAY on the listener; round trips wait for delayed ACKs", flush=True)
        break
    time.sleep(0.01)
print(f"embedded broker iotcore {__version__} (rumqttd) listening on {host}:{port}", flush=True)
open(ready, "w").close()
try:
    sys.stdin.buffer.read()  # until the parent closes the pipe or dies
finally:
    os._exit(0)
"""


def _embedded_toml(host: str, port: int, *, max_payload: int, segment_bytes: int, segments: int,
                   inflight: int, max_connections: int, logins: RunLogins | None = None) -> str:
    """rumqttd's configuration: one MQTT 3.1.1 listener, no console, bounded logs, the run's logins (module doc)."""
    auth = ""
    if logins is not None:  # JSON strings are TOML basic strings; ids may hold '.' and ':', which bare keys cannot
        pairs = "".join(f"    {json.dumps(u)} = {json.dumps(pw)}\n" for u, pw in logins.passwords.items())
        auth = "    [v4.1.connections.auth]\n" + pairs
    return f"""# written by fedsga_edge.broker.launch (see its module doc for why each bound)
id = 0

[router]
id = 0
max_connections = {max_connections}
max_outgoing_packet_count = {inflight}
max_segment_size = {segment_bytes}
max_segment_count = {segments}

[v4.1]
name = "v4-1"
listen = "{host}:{port}"
next_connection_delay_ms = 1
    [v4.1.connections]
    connection_timeout_ms = 10000
    max_payload_size = {max_payload}
    max_inflight_count = {inflight}
    dynamic_filters = true
{auth}"""


def _write_private(path: Path, text: str) -> None:
    """Write ``path`` with mode 0600 from its first byte (it may hold passwords)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def start_embedded(
    log_dir: Path,
    *,
    port: int | None = None,
    max_payload: int = 8 * MiB,
    segment_bytes: int = 8 * MiB,
    segments: int = 8,
    inflight: int = 32,
    max_connections: int = 1000,
    timeout: float = 10.0,
    logins: RunLogins | None = None,
    host: str = "127.0.0.1",
) -> RunningBroker:
    """Start the embedded broker on 127.0.0.1 (``port`` or a free one); its log is ``log_dir/broker.out``.

    ``host``: another local address to bind instead (``trial --fleet`` binds the bridge its device
    namespaces reach, fedsga_edge/fleetlimits.py; never 0.0.0.0).

    With ``logins`` it refuses every client without one of them (``trial`` always gives them); without,
    any local user may connect (tests and benchmarks).

    ``max_payload`` is the largest MQTT payload it accepts (publishers above it are disconnected);
    keep every client's ``max_packet`` at or below it. ``segments`` x ``segment_bytes`` bounds what
    it holds per subscription filter, ``inflight`` the publishes queued per connection (module doc).
    """
    if not embedded_available():
        raise BrokerError('the embedded broker needs the iotcore package: pip install "fedsga-edge[train]" '
                          "(or pass --broker mqtt://HOST:PORT to use a running broker such as Mosquitto)")
    for name, value in (("max_payload", max_payload), ("segment_bytes", segment_bytes)):
        if value < 64 * 1024:
            raise BrokerError(f"{name}={value} is too small (at least 64 KiB)")
    if segments < 2 or inflight < 1 or max_connections < 1:
        raise BrokerError("segments must be >= 2, inflight and max_connections >= 1")
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    tries = 1 if port is not None else 3  # a free port may be taken before the broker binds it
    why = ""
    for _ in range(tries):
        p = port if port is not None else free_port(host)
        conf = log_dir / "broker.toml"
        _write_private(conf, _embedded_toml(host, p, max_payload=max_payload, segment_bytes=segment_bytes,
                                            segments=segments, inflight=inflight, max_connections=max_connections,
                                            logins=logins))
        ready = log_dir / ".broker-ready"
        ready.unlink(missing_ok=True)
        log_path = log_dir / "broker.out"
        log = open(log_path, "a")
        proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(conf), str(ready), host, str(p)],
                                stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT)
        broker = RunningBroker("embedded", host, p, proc, log_path, [log], logins=logins)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and proc.poll() is None and not ready.exists():
            time.sleep(0.02)
        if ready.exists() and proc.poll() is None:
            ready.unlink(missing_ok=True)
            return broker
        broker.stop()
        why = _tail(log_path) or "no output"
        if "in use" not in why:
            break
    raise BrokerError(f"the embedded broker did not start within {timeout:g} s: {why} (log: {log_dir / 'broker.out'})")


# ------------------------------------------------------------------ Mosquitto


def mosquitto_path() -> str | None:
    """The mosquitto binary (Debian puts it in /usr/sbin, often not on a user's PATH), or None."""
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)), None)


def _mosquitto_exe() -> str:
    exe = mosquitto_path()
    if exe is None:
        raise BrokerError("no mosquitto binary: install it (Debian/Ubuntu: apt-get install mosquitto) "
                          "or use the embedded broker")
    return exe


def start_mosquitto(
    log_dir: Path,
    *,
    port: int | None = None,
    max_packet_size: int | None = None,
    extra: tuple[str, ...] = (),
    timeout: float = 10.0,
) -> RunningBroker:
    """Mosquitto on 127.0.0.1 (``port`` or a free one), anonymous unless ``extra`` says otherwise.

    Its configuration is ``log_dir/mosquitto.conf`` and its log ``log_dir/broker.out``.
    ``set_tcp_nodelay`` is on (docs/protocol.md, "Connection, sessions, reconnects").
    """
    _mosquitto_exe()  # before writing anything: a clear error when it is missing
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1"
    p = port if port is not None else free_port(host)
    # `user`: run as root, mosquitto would drop to user "mosquitto", who may not read log_dir.
    lines = [f"listener {p} {host}", "persistence false", "log_dest stderr", "set_tcp_nodelay true",
             f"user {pwd.getpwuid(os.geteuid()).pw_name}", *(extra or ("allow_anonymous true",))]
    if max_packet_size:
        lines.append(f"max_packet_size {max_packet_size}")
    conf = log_dir / "mosquitto.conf"
    conf.write_text("\n".join(lines) + "\n")
    return run_mosquitto(conf, p, log=log_dir / "broker.out", host=host, timeout=timeout)


def run_mosquitto(conf: Path, port: int, *, log: Path, host: str = "127.0.0.1", timeout: float = 10.0) -> RunningBroker:
    """Mosquitto on a config file that already exists (it must listen on ``host:port``); the log is
    appended to."""
    exe = _mosquitto_exe()
    log_path = Path(log)
    out = open(log_path, "a")
    proc = subprocess.Popen([exe, "-c", str(conf)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                            preexec_fn=die_with_parent)
    broker = RunningBroker("mosquitto", host, port, proc, log_path, [out], conf=Path(conf))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if _accepts(host, port):
            return broker
        time.sleep(0.05)
    broker.stop()
    raise BrokerError(f"Mosquitto did not start within {timeout:g} s: {_tail(log_path) or 'no output'} "
                      f"(log: {log_path})")


def start_secured_mosquitto(log_dir: Path, logins: RunLogins, *, run: str, port: int | None = None,
                            timeout: float = 10.0) -> RunningBroker:
    """Mosquitto on 127.0.0.1 with the ``broker-config`` files for ``logins`` and run ``run``: no anonymous
    clients, each login only its own topics (ACL), the client id bound to the login.

    The files go to ``log_dir/broker`` (``passwd`` hashed, ``credentials/`` mode 0700); the log is
    ``log_dir/broker.out``."""
    from .config import BrokerConfigError, BrokerSpec, write_broker_config

    _mosquitto_exe()
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    host = "127.0.0.1"
    p = port if port is not None else free_port(host)
    try:
        spec = BrokerSpec(devices=tuple(logins.devices), run=run, port=p, bind=host, host=host,
                          coordinator=logins.coordinator, persistence=False)
        files = write_broker_config(spec, log_dir / "broker", force=True, passwords=logins.passwords)
    except BrokerConfigError as exc:
        raise BrokerError(f"cannot write the trial's Mosquitto config: {exc}") from None
    with open(files.conf, "a") as f:  # as root, mosquitto would drop to user "mosquitto", who may not read log_dir
        f.write(f"\n# trial only\nuser {pwd.getpwuid(os.geteuid()).pw_name}\nlog_dest stderr\n")
    broker = run_mosquitto(files.conf, p, log=log_dir / "broker.out", host=host, timeout=timeout)
    broker.logins = logins
    return broker
