"""`fedsga-edge trial` and its brokers: the coordinator and device agents as separate OS processes over
the embedded broker (the default) or an external Mosquitto (`--broker mqtt://...`), and the embedded
broker itself (fedsga_edge.broker.launch) through the project's MqttTransport."""

from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from _runs import assert_test_accuracy

from fedsga_edge.broker.launch import (RunLogins, embedded_available, mosquitto_path, start_embedded,
                                            start_mosquitto, start_secured_mosquitto)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MOSQUITTO = mosquitto_path()
needs_embedded = pytest.mark.skipif(not embedded_available(), reason='no iotcore (pip install "fedsga-edge[train]")')
TINY = ["--dataset", "digits", "--model", "resnet18_cifar", "--width", "0.25", "--seed", "0", "--local-epochs", "1",
        "--max-batches", "2", "--batch-size", "32", "--round-timeout", "300"]


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fedsga_edge.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=os.environ | {"COLUMNS": "200"})


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _outsider(port: int, topic: str, login: tuple[str, str] | None = None) -> tuple[bool, list[bytes]]:
    """Another local user: connect (anonymously, or with a made-up login), subscribe to ``#`` and publish a
    forged ``bye`` on ``topic``. Returns (whether the broker let it in, what it read in 1 s)."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    accepted, got = threading.Event(), []
    c = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=f"outsider-{os.getpid()}")
    if login is not None:
        c.username_pw_set(*login)
    c.on_connect = lambda cl, u, f, rc, p: None if rc.is_failure else (accepted.set(), cl.subscribe("#", qos=1))
    c.on_message = lambda cl, u, m: got.append(m.payload)
    c.connect("127.0.0.1", port)
    c.loop_start()
    try:
        accepted.wait(3)
        c.publish(topic, b"bye", qos=1)
        time.sleep(1)
    finally:
        c.disconnect()
        c.loop_stop()
    return accepted.is_set(), got


def _toml_logins(conf: Path) -> dict[str, str]:
    """The ``[v4.1.connections.auth]`` table of the embedded broker's config (no tomllib on Python 3.10)."""
    table = conf.read_text().split("[v4.1.connections.auth]", 1)[1]
    return dict(re.findall(r'^\s*"([^"]+)" = "([^"]+)"$', table, re.M))


@needs_embedded
def test_trial_runs_every_device_in_every_round_on_the_embedded_broker(tmp_path, digits) -> None:
    """...and its broker takes only the run's logins, handed to each process in its environment."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "fedsga_edge.cli.main", "trial", "--clients", "3", "--rounds", "2",
                             "--strategy", "fedsga", "--out", str(out), "--quiet", *TINY],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ | {"COLUMNS": "200"})
    try:
        conf = out / "logs" / "broker.toml"
        deadline = time.monotonic() + 300
        while not (conf.is_file() and len(psutil.Process(proc.pid).children()) >= 5) and proc.poll() is None:
            assert time.monotonic() < deadline, "the trial never started its processes"
            time.sleep(0.2)
        assert stat.S_IMODE(conf.stat().st_mode) == 0o600
        logins = _toml_logins(conf)
        assert sorted(logins) == ["client-000", "client-001", "client-002", "coordinator"]
        assert len(set(logins.values())) == 4 and all(len(pw) >= 32 for pw in logins.values())
        port = int(re.search(r'listen = "127\.0\.0\.1:(\d+)"', conf.read_text()).group(1))
        for login in (None, ("coordinator", "guess"), ("intruder", logins["client-000"])):
            inside, read = _outsider(port, "fedsga/sim-0/down/client-000", login)
            assert not inside and read == [], login
        for child in psutil.Process(proc.pid).children(recursive=True):  # what `ps` shows every local user
            line = " ".join(child.cmdline())
            assert not any(pw in line for pw in logins.values()) and "--broker" not in line, line
        stdout, stderr = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, stderr[-3000:] + (out / "logs" / "coordinator.out").read_text()[-3000:]
    assert "4 per-run logins" in stderr and not any(pw in stdout + stderr for pw in logins.values())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r["splits"]) == {"client-000", "client-001", "client-002"} and r["failures"] == {}
    assert "L1" in rows[0]["clients"]["client-000"]  # round 1 calibrates over the wire too
    for r in rows:  # a plain trial measures every device: compute, wire (its link's rate) and waiting seconds
        assert "fleet_s" not in r and set(r["timing"]) == set(r["splits"])
        for cid, tm in r["timing"].items():
            assert tm["split"] == r["splits"][cid] and tm["class"] is None and tm["steps"] >= 1
            assert tm["compute_s"] > 0 and tm["wire_s"] > 0 and tm["link_mbps"] > 0 and tm["wait_s"] >= 0
            assert tm["compute_s"] + tm["wire_s"] <= r["round_s"] + 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["failures"] == 0
    # the headline is the last evaluation's count of right answers over the whole digits test set
    assert summary["final_acc"] == rows[-1]["test_acc"] and summary["best_acc"] == max(r["test_acc"] for r in rows)
    assert_test_accuracy(rows[-1], len(digits.test))
    for name in ("broker.out", "broker.toml", "coordinator.out", "device-000.out", "device-002.out"):
        assert (out / "logs" / name).is_file()
    assert "embedded broker" in (out / "logs" / "broker.out").read_text()  # no per-packet trace either
    assert (out / "logs" / "broker.out").stat().st_size < 2000
    port = int(re.search(r'listen = "127\.0\.0\.1:(\d+)"', (out / "logs" / "broker.toml").read_text()).group(1))
    assert not _accepts(port)  # the trial stopped its broker
    assert (out / "devices" / "client-001").is_dir()  # each agent kept its private state
    log = [json.loads(line) for line in (out / "coordinator.log").read_text().splitlines()]
    assert any(e["event"] == "round_end" for e in log)  # machine-readable JSON lines


@pytest.mark.full("a trial on an external Mosquitto beside simulate (about 30 s on the shared 2 cores); the embedded broker's trial and the Mosquitto login test stay in the default run")
@pytest.mark.skipif(MOSQUITTO is None, reason="no mosquitto binary (apt-get install mosquitto)")
def test_one_device_trial_on_an_external_mosquitto_matches_simulate(tmp_path) -> None:
    """One device: the same computation in one process and over MQTT between three processes."""
    trial, sim = tmp_path / "trial", tmp_path / "sim"
    flags = ["--clients", "1", "--rounds", "1", "--strategy", "static", *TINY]
    with start_mosquitto(tmp_path / "mosquitto") as broker:
        res = _cli("trial", "--broker", broker.url, "--out", str(trial), "--quiet", *flags)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (trial / "logs" / "broker.out").exists()  # an external broker: the trial started none
    res = _cli("simulate", "--out", str(sim), "--quiet", "--threads", "1", *flags)
    assert res.returncode == 0, res.stderr[-3000:]
    a = json.loads((trial / "metrics.jsonl").read_text().splitlines()[0])
    b = json.loads((sim / "metrics.jsonl").read_text().splitlines()[0])
    assert a["train_loss"] == pytest.approx(b["train_loss"], rel=1e-5)
    assert a["test_acc"] == pytest.approx(b["test_acc"], abs=1e-9)
    assert a["splits"] == b["splits"]


@needs_embedded
def test_mergesfl_trial_answers_held_activations_over_mqtt_as_simulate_does(tmp_path, digits) -> None:
    """MergeSFL over the embedded broker, the coordinator and two device agents as processes: the activation
    the coordinator holds for its merged step is answered later on the device's own reply topic, so every
    device finishes, and the round is the in-process simulation's (the merged loss, the same bytes)."""
    from _runs import tiny_config

    from fedsga_edge.simulation import Simulation

    out = tmp_path / "run"
    res = _cli("trial", "--clients", "2", "--rounds", "1", "--strategy", "mergesfl", "--out", str(out), "--quiet",
               *TINY)
    assert res.returncode == 0, res.stderr[-3000:] + (out / "logs" / "coordinator.out").read_text()[-3000:]
    (row,) = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert row["failures"] == {} and sorted(row["splits"]) == ["client-000", "client-001"]
    ref = Simulation(tiny_config("mergesfl", clients=2, rounds=1, max_batches=2), digits).run_round(1)
    assert row["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-4)
    # the same messages, each a little longer on the field's wire: every frame is sealed (a MAC, and the trial's
    # AES-GCM: 56-60 bytes), and a field device's update also reports its round's timing (a few hundred bytes)
    for key in ("bytes_up", "bytes_down"):
        assert 0 < row[key] - ref[key] < 2048, (key, row[key], ref[key])


def test_trial_with_an_unreachable_broker_says_so_before_starting_anything(tmp_path) -> None:
    res = _cli("trial", "--clients", "1", "--rounds", "1", "--broker", "mqtt://127.0.0.1:1", "--out",
               str(tmp_path / "run"), "--quiet", *TINY, timeout=300)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "cannot reach broker mqtt://127.0.0.1:1" in res.stderr and "omit --broker" in res.stderr
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "run" / "logs" / "coordinator.out").exists()  # failed before spawning the roles


def test_trial_flags_that_do_not_fit_are_refused_before_anything_is_written(tmp_path) -> None:
    from typer.testing import CliRunner

    from fedsga_edge.cli.main import app
    from fedsga_edge.config import RunConfig
    from fedsga_edge.fieldroles import FieldError
    from fedsga_edge.trial import TrialSettings, run_trial

    out = tmp_path / "run"
    (tmp_path / "profiles").mkdir()
    for settings, message in [
        (TrialSettings(out, classes=tmp_path / "c.json"), "--classes and --test-data go with --device-data"),
        (TrialSettings(out, fleet_mode="emulated"), "--fleet-mode goes with --fleet"),
        (TrialSettings(out, device_data=tmp_path), "has no dataset.json: give --classes"),
        (TrialSettings(out, device_profiles=tmp_path / "profiles"), "has no client-NNN.json for any of the --clients 2"),
        (TrialSettings(out, backend="tpu"), "--backend must be torch or onnx"),
    ]:
        with pytest.raises(FieldError, match=message) as refused:
            run_trial(RunConfig(dataset="digits", clients=2, rounds=1), settings)
        assert refused.value.usage
    assert not out.exists()
    res = CliRunner().invoke(app, ["trial", "--out", str(out), "--dataset", "digits", "--backend", "tpu"])
    assert res.exit_code == 2 and "--backend must be torch or onnx (got 'tpu')" in res.output, res.output
    assert not out.exists()


_WILL_CHILD = """
import sys, time
from fedsga_edge.transport.mqtt import MqttTransport
t = MqttTransport("127.0.0.1", int(sys.argv[1]), run="r", client_id="client-9", connect_timeout=10)
print("up", flush=True)
time.sleep(60)
"""


@needs_embedded
@pytest.mark.timeout(120)
@pytest.mark.exclusive  # the median round trip < 25 ms below
def test_embedded_broker_is_loopback_only_carries_big_messages_keeps_status_and_will_and_stops(tmp_path) -> None:
    import paho.mqtt.client as paho
    from _broker_probe import wait_retained
    from paho.mqtt.enums import CallbackAPIVersion

    from fedsga_edge.transport import Peer
    from fedsga_edge.transport.mqtt import MqttTransport

    broker = start_embedded(tmp_path / "logs")
    made: list[MqttTransport] = []
    try:
        # 127.0.0.1 only, one listener (no console or metrics port)
        listening = [c.laddr for c in psutil.Process(broker.pid).net_connections("inet") if c.status == "LISTEN"]
        assert [(a.ip, a.port) for a in listening] == [("127.0.0.1", broker.port)]

        # > 1 MiB through MqttTransport + Peer, in one publish (max_packet 4 MiB: no chunking; rumqttd's
        # default 20 KB payload limit would disconnect the sender) and chunked under the default 256 KiB
        for max_packet in (4 << 20, 256 << 10):
            run = f"r{max_packet}"
            coord_t = MqttTransport("127.0.0.1", broker.port, run=run, client_id=f"coordinator-{max_packet}",
                                    max_packet=max_packet, connect_timeout=10)
            dev_t = MqttTransport("127.0.0.1", broker.port, run=run, client_id=f"client-1-{max_packet}",
                                  max_packet=max_packet, connect_timeout=10)
            made += [coord_t, dev_t]
            coord, dev = Peer(coord_t, "coordinator", run), Peer(dev_t, "client-1", run)
            coord.register(lambda m, c=coord: c.reply(m, "gradient", {"dz": -m.body["z"], "loss": 0.0}))
            z = np.random.default_rng(0).standard_normal(400_000).astype(np.float32)  # 1.6 MB
            rep = dev.call("coordinator", "activation", 1, {"z": z, "y": np.zeros(4, np.int64), "split": 1}, timeout=30)
            assert rep.kind == "gradient" and np.array_equal(rep.body["dz"], -z)
        # TCP_NODELAY on the broker's sockets: without it a small round trip waits ~40 ms for a delayed ACK
        small = {"z": np.zeros(4, np.float32), "y": np.zeros(1, np.int64), "split": 1}
        times = []
        for _ in range(9):
            t = time.perf_counter()
            dev.call("coordinator", "activation", 1, small, timeout=30)
            times.append(time.perf_counter() - t)
        assert sorted(times)[4] < 0.025, times

        # a persistent session (clean_session=False) gets the QoS 1 messages sent while it was away
        away = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="away", clean_session=False)
        away.connect("127.0.0.1", broker.port)
        away.loop_start()
        assert away.subscribe("fedsga/r/down/away", qos=1)[0] == paho.MQTT_ERR_SUCCESS
        time.sleep(0.3)
        away.loop_stop()
        away.disconnect()
        sender = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="sender")
        sender.connect("127.0.0.1", broker.port)
        sender.loop_start()
        sender.publish("fedsga/r/down/away", b"while-away", qos=1).wait_for_publish(10)
        sender.loop_stop()
        sender.disconnect()
        queued: list[bytes] = []
        back = threading.Event()
        away.on_message = lambda _c, _u, m: (queued.append(m.payload), back.set())
        away.reconnect()
        away.loop_start()
        try:
            assert back.wait(10) and queued == [b"while-away"]
        finally:
            away.loop_stop()
            away.disconnect()

        # retained status and the last will (docs/protocol.md, "Status and last will")
        child = subprocess.Popen([sys.executable, "-c", _WILL_CHILD, str(broker.port)], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "up"
        status = "fedsga/r/status/client-9"
        # the transport publishes "online" after connecting without waiting for its PUBACK, so a
        # subscriber can come before the broker holds it: wait_retained asks fresh subscribers
        assert wait_retained(broker.port, status, b"online") == b"online"  # retained, for a late subscriber
        offline = threading.Event()
        watcher = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id="watcher")
        watcher.on_message = lambda _c, _u, m: offline.set() if m.payload == b"offline" else None
        subscribed = threading.Event()
        watcher.on_subscribe = lambda *_a: subscribed.set()
        watcher.connect("127.0.0.1", broker.port)
        watcher.subscribe(status, qos=1)
        watcher.loop_start()
        try:
            assert subscribed.wait(10)
            child.kill()
            child.wait(10)
            assert offline.wait(10)  # the broker published the will when the connection dropped
        finally:
            watcher.loop_stop()
            watcher.disconnect()
        assert wait_retained(broker.port, status, b"offline") == b"offline"  # the will was retained
    finally:
        for t in made:
            t.close()
        broker.stop()
    assert broker.proc.returncode is not None and not psutil.pid_exists(broker.pid)
    assert broker.pid not in {p.pid for p in psutil.Process().children(recursive=True)}
    assert not _accepts(broker.port)
    assert "embedded broker" in Path(broker.log).read_text()


def _member(port: int, login: str, password: str, topic: str) -> tuple[bool, list[bytes]]:
    """A client with one of the run's logins subscribed to ``topic``: (let in, what it got in 1 s)."""
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    ready, got = threading.Event(), []
    c = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=login)
    c.username_pw_set(login, password)
    c.on_connect = lambda cl, u, f, rc, p: None if rc.is_failure else cl.subscribe(topic, qos=1)
    c.on_subscribe = lambda *_a: ready.set()
    c.on_message = lambda cl, u, m: got.append(m.payload)
    c.connect("127.0.0.1", port)
    c.loop_start()
    return ready.wait(5), got, c  # type: ignore[return-value]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["embedded", "mosquitto"])
def test_a_local_broker_takes_only_the_runs_logins(tmp_path, kind) -> None:
    """Anonymous, wrong-password and made-up logins cannot subscribe to the run's topics nor publish a bye;
    the run's own login can (the control that shows the outsider would have seen something)."""
    if kind == "embedded" and not embedded_available():
        pytest.skip('no iotcore (pip install "fedsga-edge[train]")')
    if kind == "mosquitto" and MOSQUITTO is None:
        pytest.skip("no mosquitto binary (apt-get install mosquitto)")
    logins = RunLogins.generate(["client-000", "client-001"])
    pw = logins.passwords
    start = start_embedded if kind == "embedded" else lambda d, logins: start_secured_mosquitto(d, logins, run="sim-0")
    with start(tmp_path / "logs", logins=logins) as broker:
        if kind == "embedded":
            assert stat.S_IMODE((tmp_path / "logs" / "broker.toml").stat().st_mode) == 0o600
        assert broker.url == f"mqtt://127.0.0.1:{broker.port}" and pw["client-000"] not in broker.url
        assert broker.url_for("client-000") == f"mqtt://client-000:{pw['client-000']}@127.0.0.1:{broker.port}"
        down = "fedsga/sim-0/down/client-000"
        ok, got, member = _member(broker.port, "client-000", pw["client-000"], down)
        try:
            assert ok
            for login in (None, ("coordinator", "guess"), ("intruder", pw["client-000"])):
                inside, read = _outsider(broker.port, down, login)
                assert not inside and read == [], login
            time.sleep(0.5)
            assert got == []  # no forged bye reached the device
            coord = _member(broker.port, "coordinator", pw["coordinator"], "fedsga/sim-0/up/+")[2]
            coord.publish(down, b"real", qos=1).wait_for_publish(5)
            deadline = time.monotonic() + 5
            while not got and time.monotonic() < deadline:
                time.sleep(0.05)
            assert got == [b"real"]
            coord.disconnect()
            coord.loop_stop()
        finally:
            member.disconnect()
            member.loop_stop()
