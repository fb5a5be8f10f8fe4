"""``fedsga-edge broker-config`` against a real Mosquitto started with the config it writes.

Each broker test generates a config listening on a free 127.0.0.1 port, starts
``mosquitto -c <out>/mosquitto.conf`` and checks what docs/protocol.md promises: no anonymous or
wrong-password logins, a device cannot publish on another device's topics nor read them, and TLS
works end to end with the project's ``MqttTransport``. Skips with a reason when Mosquitto is absent.
"""

from __future__ import annotations

import itertools
import os
import pwd
import queue
import re
import shutil
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedsga_edge.broker.config import (BrokerConfigError, BrokerFiles, BrokerSpec, TlsFiles, acl_text,
                                                   check_device_ids, device_ids, hash_password, mosquitto_conf_text,
                                                   parse_devices, read_device_ids, verify_password,
                                                   write_broker_config)

pytest.importorskip("paho.mqtt", reason="paho-mqtt is an optional dependency (fedsga-edge[device])")

import paho.mqtt.client as paho  # noqa: E402
from paho.mqtt.enums import CallbackAPIVersion  # noqa: E402
from test_mqtt import MOSQUITTO, Broker  # noqa: E402  (tests/ is on sys.path, as for _runs)

from fedsga_edge.broker.launch import free_port, run_mosquitto  # noqa: E402
from fedsga_edge.transport import TransportError  # noqa: E402
from fedsga_edge.transport.mqtt import MqttTransport  # noqa: E402

pytestmark = pytest.mark.timeout(60)

RUN = "sim-0"
ROOT = Path(__file__).resolve().parents[1]
MOSQUITTO_PASSWD = shutil.which("mosquitto_passwd")


# ------------------------------------------------------------------ a broker running the generated config


def run_generated(files: BrokerFiles, port: int) -> Broker:
    """Mosquitto on the config broker-config wrote, with two test-only lines appended: as root
    mosquitto would drop to user "mosquitto", who cannot enter pytest's 0700 tmp folders; and log
    to the file we read."""
    with open(files.conf, "a") as f:
        f.write(f"\nuser {pwd.getpwuid(os.geteuid()).pw_name}\nlog_dest stderr\n")
    return run_mosquitto(files.conf, port, log=files.conf.parent / "mosquitto.log", timeout=5.0)


@pytest.fixture
def generated(tmp_path: Path) -> Iterator[Callable[..., tuple[Broker, BrokerFiles]]]:
    """Write a config for ``devices`` listening on 127.0.0.1:<free port> and start Mosquitto on it."""
    if MOSQUITTO is None:
        pytest.skip("no mosquitto binary (apt-get install mosquitto): broker tests need a real broker")
    brokers: list[Broker] = []

    def make(devices: tuple[str, ...] = ("client-000", "client-001"),
             **kw: object) -> tuple[Broker, BrokerFiles]:
        hasher = kw.pop("hasher", "auto")
        port = free_port()
        kw = {"run": RUN, "bind": "127.0.0.1", "port": port, "host": "127.0.0.1", "persistence": False, **kw}
        spec = BrokerSpec(devices=devices, **kw)  # type: ignore[arg-type]
        files = write_broker_config(spec, tmp_path / f"broker{len(brokers)}", hasher=str(hasher))
        brokers.append(run_generated(files, port))
        return brokers[-1], files

    yield make
    for b in brokers:
        b.stop()


def _login(files: BrokerFiles, login: str) -> tuple[str, str]:
    """(user, password) from the credentials file the operator hands to ``login``."""
    line = next(ln for ln in files.credentials[login].read_text().splitlines() if ln.startswith("FEDSGA_EDGE_BROKER="))
    userinfo = line.split("://", 1)[1].split("@", 1)[0]
    user, password = userinfo.split(":", 1)
    return user, password


class Client:
    """A raw paho client that records what it receives: the test's eyes on the broker."""

    _ids = itertools.count()

    def __init__(self, port: int, files: BrokerFiles, login: str, subscribe: tuple[str, ...] = ()) -> None:
        self.got: queue.Queue[tuple[str, bytes]] = queue.Queue()
        ready, refused = threading.Event(), []
        self.c = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"{login}-{next(self._ids)}")
        self.c.username_pw_set(*_login(files, login))

        def on_connect(cl: paho.Client, u: object, f: object, rc: object, p: object) -> None:
            if getattr(rc, "is_failure", False):
                refused.append(str(rc))
                ready.set()
            elif subscribe:
                cl.subscribe([(t, 1) for t in subscribe])
            else:
                ready.set()

        self.c.on_connect = on_connect
        self.c.on_subscribe = lambda cl, u, mid, rc, p: ready.set()  # one SUBSCRIBE for all topics
        self.c.on_message = lambda cl, u, m: self.got.put((m.topic, m.payload))
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        # Mosquitto 2.0 grants a forbidden 3.1.1 subscription and filters what it delivers.
        assert ready.wait(5) and not refused, f"{login}: not connected and subscribed ({refused})"

    def publish(self, topic: str, payload: bytes) -> None:
        self.c.publish(topic, payload, qos=1).wait_for_publish(5)

    def until(self, payload: bytes, timeout: float = 5.0) -> list[tuple[str, bytes]]:
        """Everything received up to and including ``payload`` (which must arrive)."""
        seen, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                item = self.got.get(timeout=0.1)
            except queue.Empty:
                continue
            seen.append(item)
            if item[1] == payload:
                return seen
        raise AssertionError(f"{payload!r} never arrived; got {seen}")

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


# ------------------------------------------------------------------ without a broker


def test_device_ids_are_the_ids_device_agents_use() -> None:
    from fedsga_edge.runbuild import client_id

    assert device_ids(3) == [client_id(i) for i in range(3)] == parse_devices("3")
    with pytest.raises(BrokerConfigError, match="must be 1-100000"):
        parse_devices("0")


def test_a_device_file_with_bad_ids_gets_one_error_naming_every_bad_line(tmp_path: Path) -> None:
    ok = tmp_path / "ok.txt"
    ok.write_text("# lab A\npi-1\n\n  jetson.2  \nnode:3\n")
    assert read_device_ids(ok) == parse_devices(str(ok)) == ["pi-1", "jetson.2", "node:3"]
    bad = tmp_path / "ids.txt"
    bad.write_text("pi-1\nlab/pi-2\npi+3\npi-4 # a comment\npi-1\ncoordinator\npi 5\n" + "x" * 129 + "\n")
    with pytest.raises(BrokerConfigError) as err:
        read_device_ids(bad)
    msg = str(err.value)
    for needle in ("ids.txt:2: device id 'lab/pi-2' contains '/'", "ids.txt:3: device id 'pi+3' contains '+'",
                   "ids.txt:4: device id 'pi-4 # a comment' contains '#'",
                   "ids.txt:5: device id 'pi-1' repeats ids.txt:1",
                   "ids.txt:6: 'coordinator' is the coordinator's login", "ids.txt:7: device id 'pi 5' may use only",
                   "ids.txt:8: device id", "129 characters"):
        assert needle in msg, msg
    (tmp_path / "empty.txt").write_text("# nobody yet\n\n")
    with pytest.raises(BrokerConfigError, match="lists no device ids"):
        read_device_ids(tmp_path / "empty.txt")
    with pytest.raises(BrokerConfigError, match="neither"):
        parse_devices(str(tmp_path / "missing.txt"))
    with pytest.raises(BrokerConfigError, match="--run 'a/b' contains '/'"):
        BrokerSpec(devices=("pi-1",), run="a/b")
    with pytest.raises(BrokerConfigError, match="repeats"):
        check_device_ids(["a", "a"])
    with pytest.raises(BrokerConfigError, match="--host 'broker/x' must be a host name"):  # it goes into URLs
        BrokerSpec(devices=("pi-1",), host="broker/x")


def test_password_hashes_are_mosquittos_own_format(tmp_path: Path) -> None:
    salt = bytes(range(12))
    h = hash_password("s3cret", salt=salt)
    assert h.startswith("$7$101$AAECAwQFBgcICQoL$") and verify_password("s3cret", h) and not verify_password("s3cre", h)
    assert hash_password("s3cret", salt=salt) == h and hash_password("s3cret") != h  # random salt by default
    if MOSQUITTO_PASSWD is None:
        pytest.skip("no mosquitto_passwd to compare with")
    subprocess.run([MOSQUITTO_PASSWD, "-c", "-b", str(tmp_path / "pw"), "u", "s3cret"], check=True, timeout=10)
    theirs = (tmp_path / "pw").read_text().strip().split(":", 1)[1]
    assert theirs.startswith("$7$") and verify_password("s3cret", theirs) and not verify_password("other", theirs)


def test_acl_gives_each_login_only_its_own_topics() -> None:
    spec = BrokerSpec(devices=("a", "b"), run=RUN, host="h")
    users: dict[str, list[str]] = {}
    for line in acl_text(spec).splitlines():
        if line.startswith("user "):
            current = users.setdefault(line.split()[1], [])
        elif line.startswith("topic "):
            current.append(line.removeprefix("topic "))
    assert users == {
        "coordinator": [f"read fedsga/{RUN}/up/+", f"write fedsga/{RUN}/down/+", f"write fedsga/{RUN}/bcast",
                        f"read fedsga/{RUN}/status/+", f"write fedsga/{RUN}/status/coordinator"],
        "a": [f"write fedsga/{RUN}/up/a", f"read fedsga/{RUN}/down/a", f"read fedsga/{RUN}/bcast",
              f"readwrite fedsga/{RUN}/status/a"],
        "b": [f"write fedsga/{RUN}/up/b", f"read fedsga/{RUN}/down/b", f"read fedsga/{RUN}/bcast",
              f"readwrite fedsga/{RUN}/status/b"],
    }
    assert "pattern" not in acl_text(spec) and "fedsga/+/up/a" in acl_text(BrokerSpec(devices=("a",), host="h"))


def test_with_tls_the_only_plaintext_listener_is_loopback(tmp_path: Path) -> None:
    tls = TlsFiles(Path("/etc/c/server.crt"), Path("/etc/c/server.key"), Path("/etc/c/ca.crt"))
    conf = mosquitto_conf_text(BrokerSpec(devices=("a",), tls=tls, loopback_port=1883, host="h"), "/etc/m")
    lines = [ln for ln in conf.splitlines() if ln and not ln.startswith("#")]
    assert [ln for ln in lines if ln.startswith("listener")] == ["listener 8883", "listener 1883 127.0.0.1"]
    assert lines[lines.index("listener 8883") + 1:lines.index("listener 1883 127.0.0.1")] == [
        "use_username_as_clientid true", "certfile /etc/c/server.crt", "keyfile /etc/c/server.key",
        "cafile /etc/c/ca.crt", "tls_version tlsv1.2"]
    for want in ("allow_anonymous false", "per_listener_settings false", "password_file /etc/m/passwd",
                 "acl_file /etc/m/acl"):
        assert want in lines
    plain = mosquitto_conf_text(BrokerSpec(devices=("a",), host="h"), "/etc/m")
    assert "listener 1883" in plain.splitlines() and "certfile" not in plain
    with pytest.raises(BrokerConfigError, match="no such file"):  # checked when written, named by flag
        write_broker_config(BrokerSpec(devices=("a",), tls=tls, host="h"), tmp_path / "x")
    with pytest.raises(BrokerConfigError, match="spaces"):
        mosquitto_conf_text(BrokerSpec(devices=("a",), host="h"), "/etc/my broker")


def test_every_listener_binds_the_client_id_to_the_login() -> None:
    """use_username_as_clientid is a listener setting in Mosquitto 2.0: it must follow each listener line
    (before the first one it would configure Mosquitto's default listener instead)."""
    tls = TlsFiles(Path("/c/s.crt"), Path("/c/s.key"))
    for spec in (BrokerSpec(devices=("a",), host="h"), BrokerSpec(devices=("a",), host="h", loopback_port=1884),
                 BrokerSpec(devices=("a",), host="h", tls=tls, loopback_port=1883)):
        lines = [ln for ln in mosquitto_conf_text(spec, "/etc/m").splitlines() if ln and not ln.startswith("#")]
        listeners = [i for i, ln in enumerate(lines) if ln.startswith("listener ")]
        assert listeners and all(lines[i + 1] == "use_username_as_clientid true" for i in listeners), lines
        assert lines.count("use_username_as_clientid true") == len(listeners)


def test_deploy_examples_are_what_broker_config_writes() -> None:
    """fedsga_edge/broker/deploy/ documents a command; regenerate its output and compare."""
    spec = BrokerSpec(devices=tuple(device_ids(3)), run="sim-0", loopback_port=1883, host="broker.lan",
                      tls=TlsFiles(Path("/etc/mosquitto/certs/server.crt"), Path("/etc/mosquitto/certs/server.key"),
                                   Path("/etc/mosquitto/certs/ca.crt")))
    deploy = ROOT / "fedsga_edge" / "broker" / "deploy"
    assert (deploy / "mosquitto.example.conf").read_text() == mosquitto_conf_text(spec, "/etc/mosquitto/fedsga")
    assert (deploy / "acl.example").read_text() == acl_text(spec)
    readme = (deploy / "README.md").read_text()
    assert "--devices 3 --run sim-0 --out /etc/mosquitto/fedsga" in readme and "--loopback-port 1883" in readme


def test_cli_writes_private_credentials_and_will_not_silently_change_passwords(tmp_path: Path) -> None:
    from fedsga_edge.cli.main import app

    runner, out = CliRunner(), tmp_path / "broker"
    res = runner.invoke(app, ["broker-config", "--devices", "2", "--out", str(out), "--host", "broker.lan"])
    assert res.exit_code == 0, res.output
    assert "mosquitto -c" in res.output and "credentials/<login>.env" in res.output
    assert "no TLS" in res.output  # the warning (CliRunner mixes stderr in)
    assert sorted(p.name for p in (out / "credentials").iterdir()) == ["client-000.env", "client-001.env",
                                                                       "coordinator.env"]
    assert stat.S_IMODE((out / "credentials").stat().st_mode) == 0o700
    for p in (out / "credentials").iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        assert p.read_text().count("FEDSGA_EDGE_BROKER=mqtt://") == 1
    assert stat.S_IMODE((out / "passwd").stat().st_mode) == 0o640
    from fedsga_edge.wire.auth import read_key, read_keys

    keys = read_keys(out / "keys")  # each device enrolled with its own message key, private to it
    assert sorted(keys) == ["client-000", "client-001"] and keys["client-000"] != keys["client-001"]
    assert stat.S_IMODE((out / "keys").stat().st_mode) == 0o700 and "keys/<device>.key" in res.output
    before = (out / "credentials" / "client-000.env").read_text()
    _, pw = before.strip().rsplit("@", 1)[0].rsplit(":", 1)
    user_hash = dict(ln.split(":", 1) for ln in (out / "passwd").read_text().splitlines())
    assert set(user_hash) == {"coordinator", "client-000", "client-001"}
    assert verify_password(pw, user_hash["client-000"])

    again = runner.invoke(app, ["broker-config", "--devices", "2", "--out", str(out)])
    assert again.exit_code == 2 and "pass --force" in _flat(again.output)
    assert (out / "credentials" / "client-000.env").read_text() == before
    forced = runner.invoke(app, ["broker-config", "--devices", "1", "--out", str(out), "--force", "--host", "b"])
    assert forced.exit_code == 0, forced.output
    assert sorted(p.name for p in (out / "credentials").iterdir()) == ["client-000.env", "coordinator.env"]
    assert (out / "credentials" / "client-000.env").read_text() != before
    assert sorted(p.name for p in (out / "keys").iterdir()) == ["client-000.key"]
    assert read_key(out / "keys" / "client-000.key") != keys["client-000"]  # a new enrolment, new keys

    (tmp_path / "ids").write_text("ok\nnot/ok\n")
    bad = runner.invoke(app, ["broker-config", "--devices", str(tmp_path / "ids"), "--out", str(tmp_path / "b2")])
    assert bad.exit_code == 2 and "ids:2: device id 'not/ok' contains '/'" in _flat(bad.output)
    half = runner.invoke(app, ["broker-config", "--devices", "1", "--out", str(tmp_path / "b3"), "--tls-cert", "x"])
    assert half.exit_code == 2 and "--tls-cert and --tls-key go together" in _flat(half.output)


def _flat(output: str) -> str:
    """The CLI's error text without the box rich draws around it and its line breaks."""
    return " ".join(re.sub(r"[│╭╮╰╯─]", " ", output).split())


# ------------------------------------------------------------------ on a real broker


@pytest.mark.parametrize("hasher", ["python", "mosquitto_passwd"])
def test_anonymous_and_wrong_passwords_are_refused(generated: Callable[..., tuple[Broker, BrokerFiles]],
                                                   hasher: str) -> None:
    if hasher == "mosquitto_passwd" and MOSQUITTO_PASSWD is None:
        pytest.skip("no mosquitto_passwd")
    b, files = generated(hasher=hasher)
    assert files.hasher == hasher
    user, password = _login(files, "client-000")
    for who, secret in ((None, None), (user, "wrong"), ("client-001", password), ("nobody", password)):
        with pytest.raises(TransportError, match="refused"):
            MqttTransport("127.0.0.1", b.port, run=RUN, client_id=user, username=who, password=secret,
                          connect_timeout=5, reconnect_min=0.05)  # paho's retry sleep delays the failed close
    t = MqttTransport.from_url(files.urls["client-000"], run=RUN, client_id=user, connect_timeout=5)
    t.close()


def test_a_device_can_neither_speak_for_nor_listen_to_another(
        generated: Callable[..., tuple[Broker, BrokerFiles]]) -> None:
    b, files = generated(devices=("dev-a", "dev-b"))
    up, down, bcast = f"fedsga/{RUN}/up", f"fedsga/{RUN}/down", f"fedsga/{RUN}/bcast"
    coord = Client(b.port, files, "coordinator", (f"{up}/+",))
    a = Client(b.port, files, "dev-a", (f"{down}/dev-a", f"{down}/dev-b", f"{up}/+", bcast))
    dev_b = Client(b.port, files, "dev-b", (f"{down}/dev-b", bcast))
    try:
        # A forges B's upload and a broadcast, then sends its own: only its own arrives.
        a.publish(f"{up}/dev-b", b"forged-up")
        a.publish(bcast, b"forged-bcast")
        a.publish(f"{up}/dev-a", b"a-up")
        assert coord.until(b"a-up") == [(f"{up}/dev-a", b"a-up")]
        # B's honest upload reaches the coordinator, not A (subscribed to up/+).
        dev_b.publish(f"{up}/dev-b", b"b-up")
        assert coord.until(b"b-up") == [(f"{up}/dev-b", b"b-up")]
        # The coordinator talks to B, then A, then everyone: A sees only its own and the broadcast. (On its one
        # connection: the client id is the login, so a second coordinator connection would replace the first.)
        coord.publish(f"{down}/dev-b", b"for-b")
        coord.publish(f"{down}/dev-a", b"for-a")
        coord.publish(bcast, b"to-all")
        assert dev_b.until(b"to-all") == [(f"{down}/dev-b", b"for-b"), (bcast, b"to-all")]  # no forged-bcast
        assert a.until(b"to-all") == [(f"{down}/dev-a", b"for-a"), (bcast, b"to-all")]  # no for-b, no b-up
        time.sleep(0.2)
        assert a.got.empty() and dev_b.got.empty() and coord.got.empty()
    finally:
        for c in (coord, a, dev_b):
            c.close()


def _make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A private CA and a server certificate for 127.0.0.1 (cryptography if installed, else openssl)."""
    ca_crt, srv_crt, srv_key = d / "ca.crt", d / "server.crt", d / "server.key"
    try:
        import datetime
        import ipaddress

        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID
    except ImportError:
        openssl = shutil.which("openssl")
        if openssl is None:
            pytest.skip("neither the cryptography package nor openssl to make test certificates")
        ec_args = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        for args in (["req", "-x509", *ec_args, "-keyout", "ca.key", "-out", "ca.crt", "-days", "1", "-subj", "/CN=ca"],
                     ["req", *ec_args, "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"]):
            subprocess.run([openssl, *args], check=True, capture_output=True, timeout=30, cwd=d)
        (d / "ext").write_text("subjectAltName=IP:127.0.0.1\n")
        subprocess.run([openssl, "x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
                        "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "ext"],
                       check=True, capture_output=True, timeout=30, cwd=d)
        return ca_crt, srv_crt, srv_key
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fedsga test ca")])
    ca = (x509.CertificateBuilder().subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
          .not_valid_after(now + datetime.timedelta(days=1))
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    srv = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
           .issuer_name(ca_name).public_key(key.public_key()).serial_number(x509.random_serial_number())
           .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
           .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                          critical=False)
           .sign(ca_key, hashes.SHA256()))
    ca_crt.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    srv_crt.write_bytes(srv.public_bytes(serialization.Encoding.PEM))
    srv_key.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return ca_crt, srv_crt, srv_key


def test_tls_end_to_end_with_the_credentials_files(
        tmp_path: Path, generated: Callable[..., tuple[Broker, BrokerFiles]]) -> None:
    certs = tmp_path / "certs"
    certs.mkdir()
    ca, crt, key = _make_certs(certs)
    loopback = free_port()
    b, files = generated(devices=("client-000",), tls=TlsFiles(crt, key, ca), loopback_port=loopback)
    assert files.urls["client-000"].startswith("mqtts://client-000:") and files.urls["coordinator"].startswith(
        "mqtt://coordinator:")  # the coordinator on this host uses the loopback listener
    coord = MqttTransport.from_url(files.urls["coordinator"], run=RUN, client_id="coordinator", connect_timeout=5)
    dev = MqttTransport.from_url(files.urls["client-000"], run=RUN, client_id="client-000", ca=str(ca),
                                 connect_timeout=5)
    try:
        coord.register("coordinator", lambda data: data.upper())
        dev.register("client-000", lambda data: data[::-1])
        assert dev.request("client-000", "coordinator", b"over tls", timeout=5) == b"OVER TLS"
        assert coord.request("coordinator", "client-000", b"down", timeout=5) == b"nwod"
        # The unit file's way to trust the CA (SSL_CERT_FILE; the device command has no ca option).
        code = ("import sys; from fedsga_edge.transport.mqtt import MqttTransport as T; "
                "t = T.from_url(sys.argv[1], run=sys.argv[2], client_id='client-000', connect_timeout=5); "
                "print(t.request('client-000', 'coordinator', b'env ca', timeout=5).decode()); t.close()")
        dev.close()
        res = subprocess.run([sys.executable, "-c", code, files.urls["client-000"], RUN], check=False,
                             capture_output=True, text=True, timeout=60, env={**os.environ, "SSL_CERT_FILE": str(ca)})
        assert res.returncode == 0 and res.stdout.strip() == "ENV CA", res.stderr[-2000:]
    finally:
        dev.close()
        coord.close()
    with pytest.raises(TransportError, match="could not connect"):  # no plaintext on the TLS port
        u, p = _login(files, "client-000")
        MqttTransport("127.0.0.1", b.port, run=RUN, client_id=u, username=u, password=p, connect_timeout=1,
                      reconnect_min=0.05)


# ------------------------------------------------------------------ session takeover by client id

TAKEOVER = "already connected, closing old connection"  # Mosquitto's line when a client id connects twice


def _connect_as(port: int, files: BrokerFiles, login: str, client_id: str) -> bool:
    """One MQTT connection with ``login``'s password but any client id; True when the broker accepted it."""
    accepted = threading.Event()
    c = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id)
    c.username_pw_set(*_login(files, login))
    c.on_connect = lambda cl, u, f, rc, p: None if rc.is_failure else accepted.set()
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        return accepted.wait(5)
    finally:
        c.disconnect()
        c.loop_stop()


def _takeovers(files: BrokerFiles, client_id: str) -> int:
    log = (files.conf.parent / "mosquitto.log").read_text()
    return sum(f"Client {client_id} {TAKEOVER}" in ln for ln in log.splitlines())


def _unbind(b: Broker, files: BrokerFiles) -> None:
    """The control: restart the broker on the config as it was before use_username_as_clientid."""
    text = files.conf.read_text()
    files.conf.write_text("\n".join(ln for ln in text.splitlines() if "use_username_as_clientid" not in ln) + "\n")
    b.restart()


@pytest.mark.parametrize("bound", [True, False], ids=["generated", "without-use_username_as_clientid"])
def test_a_device_login_cannot_take_over_the_coordinators_or_another_devices_session(
        generated: Callable[..., tuple[Broker, BrokerFiles]], bound: bool) -> None:
    b, files = generated(devices=("client-000", "client-001", "client-003"))
    if not bound:
        _unbind(b, files)
    coord = MqttTransport.from_url(files.urls["coordinator"], run=RUN, connect_timeout=5, reconnect_min=0.05)
    dev = MqttTransport.from_url(files.urls["client-001"], run=RUN, connect_timeout=5, reconnect_min=0.05)
    assert (coord.client_id, dev.client_id) == ("coordinator", "client-001")  # no client id given: the login
    try:
        coord.register("coordinator", lambda data: data.upper())
        dev.register("client-001", lambda data: data[::-1])
        for i in range(6):  # client-003's login, with the coordinator's and client-001's ids in turn
            assert _connect_as(b.port, files, "client-003", ("coordinator", "client-001")[i % 2])
            for t in (coord, dev):  # each attempt finds both honest clients connected
                assert t.wait_ready(10)
        assert dev.request("client-001", "coordinator", b"still here", timeout=5) == b"STILL HERE"
        log_path = files.conf.parent / "mosquitto.log"
        deadline = time.monotonic() + 10  # the broker's log is written as it goes: wait for all six attempts
        while time.monotonic() < deadline and log_path.read_text().count(" as client-003 (") < 6 and bound:
            time.sleep(0.1)
        while time.monotonic() < deadline and not bound and (
                _takeovers(files, "coordinator") + _takeovers(files, "client-001")) < 6:
            time.sleep(0.1)
        lost = _takeovers(files, "coordinator") + _takeovers(files, "client-001")
        if bound:
            assert lost == 0 and _takeovers(files, "client-003") == 0  # nobody was connected as client-003
            assert log_path.read_text().count("as client-003 (") == 6  # each attempt was accepted as its own login
        else:  # the control: the attack works without the setting (how many of the six land depends on timing)
            assert lost >= 1, "without the setting an attempt replaces the honest client's connection"
    finally:
        dev.close()
        coord.close()


def _attack(port: int, files: BrokerFiles, stop: threading.Event, every: float,
            tally: list[tuple[float, str]]) -> None:
    """client-003's login reconnecting every ``every`` s, as the coordinator and as client-001 in turn."""
    ids = itertools.cycle(("coordinator", "client-001"))
    while not stop.wait(every):
        cid = next(ids)
        if _connect_as(port, files, "client-003", cid):
            tally.append((time.monotonic(), cid))


@pytest.mark.timeout(600)
def test_a_round_completes_while_a_device_login_reconnects_as_the_coordinator_and_as_a_device(
        generated: Callable[..., tuple[Broker, BrokerFiles]], digits, tmp_path: Path) -> None:
    """Three devices and the coordinator on a broker-config Mosquitto, each with
    its own login; a fourth login reconnects every 0.1 s with the client id `coordinator`, then `client-001`,
    through two rounds. Before use_username_as_clientid, every device failed round 1 and client-001 lost its bye."""
    from fedsga_edge.config import RunConfig, TrainConfig
    from fedsga_edge.runbuild import coordinator_service, default_run_id, device_agent

    cfg = RunConfig(strategy="static", dataset="digits", clients=3, rounds=2, model="resnet18_cifar", width=0.25,
                    seed=0, device="cpu", round_timeout=120.0,
                    train=TrainConfig(local_epochs=1, batch_size=32, max_batches=2))
    run = default_run_id(cfg)
    b, files = generated(devices=("client-000", "client-001", "client-002", "client-003"), run=run)
    stop, tally = threading.Event(), []
    every = 0.1  # the run takes a few seconds: the attack must land many times inside it
    attacker = threading.Thread(target=_attack, args=(b.port, files, stop, every, tally), daemon=True)
    made: list[MqttTransport] = []
    agents = []
    try:
        made.append(MqttTransport.from_url(files.urls["coordinator"], run=run, connect_timeout=5))
        service = coordinator_service(cfg, made[0], tmp_path / "run", bundle=digits, register_timeout=60)
        service.start()
        attacker.start()
        for i in range(3):
            made.append(MqttTransport.from_url(files.urls[f"client-00{i}"], run=run, connect_timeout=5))
            agents.append(device_agent(cfg, i, made[-1], tmp_path / f"state-{i}", bundle=digits))
            agents[-1].start(timeout=60)
        began = time.monotonic()  # every device registered: the rounds run from here
        summary = service.wait(300)
        ended = time.monotonic()
        for a in agents:
            assert a.finished.wait(30), f"{a.cid} never got its bye"
    finally:
        stop.set()
        attacker.join(10)
        for a in agents:
            a.stop()
        for t in reversed(made):
            t.close()
    during = [cid for at, cid in tally if began <= at <= ended]
    print(f"\ntakeover: {len(during)} attacker connections accepted during the rounds ({ended - began:.1f} s; "
          f"{len(tally)} in all, one every {every} s, as coordinator and client-001 in turn); "
          f"devices completing each round {[len(r['splits']) for r in service.records]} of 3, "
          f"failures {summary.get('failures')}")
    assert len(service.records) == 2
    for rec in service.records:
        assert set(rec["splits"]) == {"client-000", "client-001", "client-002"} and rec["failures"] == {}
    assert summary["failures"] == 0
    assert during.count("coordinator") >= 2 and during.count("client-001") >= 2, tally  # it ran during the rounds
    assert _takeovers(files, "coordinator") == 0 and _takeovers(files, "client-001") == 0
