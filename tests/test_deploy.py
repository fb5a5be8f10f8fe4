"""The device's deployment files (device/deploy/) and its systemd notifications (device/systemd.py).

The unit file goes through ``systemd-analyze verify`` when systemd is installed (with ExecStart
pointed at this machine's ``fedsga-edge``, since /opt/fedsga-edge does not exist here), and through
a parser check of the keys docs/deploy.md relies on everywhere. The example TOML must parse and use
only keys the ``device`` command accepts. sd_notify is checked on a real unix datagram socket.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer

from fedsga_edge.device.systemd import Systemd, notify

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "device" / "deploy"
UNIT = DEPLOY / "fedsga-edge-device.service"
EXAMPLE = DEPLOY / "device.example.toml"
INSTALLED_EXE = "/opt/fedsga-edge/venv/bin/fedsga-edge"  # where docs/deploy.md installs it


def _unit(text: str) -> dict[str, dict[str, list[str]]]:
    """systemd's INI dialect: sections of keys that may repeat; '#' and ';' start comments."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for no, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None and "=" in line, f"{UNIT.name}:{no}: not a key=value in a section: {raw!r}"
        key, value = (s.strip() for s in line.split("=", 1))
        current.setdefault(key, []).append(value)
    return sections


def _device_options() -> dict[str, click.Parameter]:
    """The options ``fedsga-edge device`` takes, by the name a TOML key uses."""
    from fedsga_edge.cli.main import app

    cmd = typer.main.get_command(app).commands["device"]  # type: ignore[attr-defined]
    return {p.name: p for p in cmd.get_params(click.Context(cmd)) if p.expose_value and p.name}


def test_unit_file_has_what_the_deploy_guide_relies_on() -> None:
    u = _unit(UNIT.read_text())
    unit, service, install = u["Unit"], u["Service"], u["Install"]
    assert unit["After"] == ["network-online.target"] and unit["Wants"] == ["network-online.target"]
    one = {k: v[-1] for k, v in service.items()}  # systemd: the last assignment wins
    assert one["Type"] == "notify" and one["NotifyAccess"] == "main" and int(one["WatchdogSec"]) > 0
    assert one["Restart"] == "on-failure" and one["User"] == "fedsga" and one["StateDirectory"] == "fedsga-edge"
    assert int(one["TimeoutStartSec"]) > 300  # the agent's registration (hello) may take 300 s before READY=1
    for key, want in {"NoNewPrivileges": "yes", "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
                      "UMask": "0077", "CapabilityBoundingSet": ""}.items():
        assert one.get(key) == want, key
    assert one["EnvironmentFile"] == "/etc/fedsga-edge/credentials.env"
    exe, command, *args = one["ExecStart"].split()
    assert exe == INSTALLED_EXE and command == "device"
    flags = {a.split("=")[0] for a in args if a.startswith("--")}
    from fedsga_edge.cli.main import app

    cmd = typer.main.get_command(app).commands["device"]  # type: ignore[attr-defined]
    known = {o for p in cmd.get_params(click.Context(cmd)) for o in getattr(p, "opts", [])}
    assert flags <= known, f"ExecStart uses flags the device command lacks: {flags - known}"
    assert install["WantedBy"] == ["multi-user.target"]


def test_unit_file_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    exe = shutil.which("fedsga-edge") or str(Path(sys.executable).parent / "fedsga-edge")
    if analyze is None:
        pytest.skip("no systemd-analyze (the parser check above still runs)")
    if not os.access(exe, os.X_OK):
        pytest.skip("no installed fedsga-edge script for ExecStart to point at")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(INSTALLED_EXE, exe))
    res = subprocess.run([analyze, "verify", "--man=no", "--generators=no", str(unit)], check=False,
                         capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys and bad values too: any complaint about our file is a failure.
    ours = [ln for ln in (res.stderr + res.stdout).splitlines() if unit.name in ln]
    assert res.returncode == 0 and not ours, res.stderr


def test_unit_file_check_catches_a_typo(tmp_path: Path) -> None:
    """The verify test above can fail: a misspelt key is reported."""
    analyze, exe = shutil.which("systemd-analyze"), shutil.which("fedsga-edge")
    if analyze is None or exe is None:
        pytest.skip("no systemd-analyze or fedsga-edge script")
    unit = tmp_path / UNIT.name
    unit.write_text(UNIT.read_text().replace(INSTALLED_EXE, exe).replace("WatchdogSec=", "WatchdogSecs="))
    res = subprocess.run([analyze, "verify", "--man=no", "--generators=no", str(unit)], check=False,
                         capture_output=True, text=True, timeout=60)
    assert "Unknown key 'WatchdogSecs'" in res.stderr


def test_example_toml_uses_only_the_device_commands_options() -> None:
    options = _device_options()
    text = EXAMPLE.read_text()
    active = tomllib.loads(text)
    # The commented alternatives (`# key = value` lines) must be valid keys too.
    alternatives = tomllib.loads("\n".join(ln.lstrip("# ") for ln in text.splitlines()
                                           if ln.startswith("# ") and " = " in ln and ln[2:3].isalpha()
                                           and ln[2:].split(" = ")[0].replace("_", "").isalnum()))
    assert {"index", "state_dir", "backend"} <= active.keys() and "broker" not in active  # the secret is not here
    assert "config" in alternatives and "backend" in alternatives
    for source, table in (("active", active), ("commented", alternatives)):
        unknown = set(table) - set(options)
        assert not unknown, f"{EXAMPLE.name} ({source}) has keys `fedsga-edge device` does not take: {unknown}"
        for key, value in table.items():
            default = options[key].default
            if isinstance(default, bool):
                assert isinstance(value, bool), key
            elif isinstance(default, (int, float)) and not isinstance(default, bool):
                assert isinstance(value, (int, float)) and not isinstance(value, bool), key
            elif isinstance(default, str) or default is None:
                assert isinstance(value, (str, int, float)), key
    from fedsga_edge.cli.simulate import RUN_FLAGS

    assert not ("config" in active and set(active) & set(RUN_FLAGS)), "`device` refuses --config with run flags"


# ------------------------------------------------------------------ sd_notify


def _listen(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    s.settimeout(2)
    return s


def test_sd_notify_messages_reach_systemds_socket(tmp_path: Path) -> None:
    path = str(tmp_path / "notify")
    now = [100.0]
    with _listen(path) as sock:
        sd = Systemd({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())},
                     clock=lambda: now[0])
        assert sd.enabled and sd.watchdog_s == 2.0
        assert sd.ready("registered as client-000")
        assert sock.recv(4096) == b"READY=1\nSTATUS=registered as client-000"
        assert sd.watchdog() and sock.recv(4096) == b"WATCHDOG=1"
        now[0] += 0.5
        assert not sd.watchdog()  # rate-limited to half of WatchdogSec
        now[0] += 0.6
        assert not sd.watchdog(healthy=False)  # an unhealthy agent stops pinging: systemd restarts it
        assert sd.watchdog() and sock.recv(4096) == b"WATCHDOG=1"
        assert sd.status("round 3\nbusy") and sock.recv(4096) == b"STATUS=round 3 busy"
        assert sd.stopping() and sock.recv(4096) == b"STOPPING=1"
    os.unlink(path)
    assert not notify("READY=1", {"NOTIFY_SOCKET": path})  # systemd went away: False, no exception


def test_sd_notify_abstract_socket_and_no_systemd() -> None:
    name = f"fedsga-test-{os.getpid()}"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + name)
    s.settimeout(2)
    with s:
        assert notify("READY=1", {"NOTIFY_SOCKET": "@" + name}) and s.recv(64) == b"READY=1"
    outside = Systemd({})
    assert not outside.enabled and not outside.ready() and not outside.watchdog() and outside.watchdog_s is None
    # The watchdog belongs to another process (e.g. our parent): never ping for it.
    assert Systemd({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"}).watchdog_s is None
    assert not notify("READY=1", {"NOTIFY_SOCKET": "vsock:2:1234"})


def test_a_broker_error_does_not_print_the_password(tmp_path) -> None:
    from typer.testing import CliRunner

    from fedsga_edge.cli.main import app

    from fedsga_edge.broker.launch import free_port

    port = free_port()  # nothing listens there
    res = CliRunner().invoke(app, ["device", "--broker", f"mqtt://client-000:s3cret-pw@127.0.0.1:{port}",
                                   "--index", "0", "--state-dir", str(tmp_path / "s"), "--dataset", "digits"])
    assert res.exit_code == 2, res.output
    assert "cannot use broker mqtt://client-000:***@127.0.0.1" in res.output and "s3cret-pw" not in res.output
