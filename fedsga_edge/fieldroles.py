"""The coordinator and a device as long-lived processes over MQTT: what ``fedsga-edge coordinator`` and
``device`` (and the processes ``trial`` starts) run once their flags are read.

Each takes a built RunConfig, opens the MQTT transport, runs its role (``fedsga_edge.runbuild``) until
the run ends or SIGTERM, and closes the transport whatever happens. A reason not to go on is a
``FieldError`` that names it, so the CLI prints one line instead of a traceback.
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["FIELD_DEADLINE_S", "FieldError", "read_classes", "run_coordinator", "run_device", "with_deadline"]

FIELD_DEADLINE_S = 600.0


class FieldError(Exception):
    """Why a field command cannot go on. ``usage``: the user's flags or files are at fault (the CLI shows
    its usage and exits 2); otherwise the CLI prints ``error: <message>`` and exits with ``code``."""

    def __init__(self, message: str, *, code: int = 1, usage: bool = False) -> None:
        super().__init__(message)
        self.code, self.usage = code, usage


def with_deadline(cfg: Any) -> Any:
    """A field run needs a round deadline (a silent device must not stall a round forever):
    without --round-timeout it gets FIELD_DEADLINE_S."""
    if not cfg.round_timeout > 0:
        cfg.round_timeout = FIELD_DEADLINE_S
    return cfg


def _redacted(url: str) -> str:
    """The broker URL without its password: errors land in journals and CI logs."""
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparsable URL>"
    if parts.password is None:
        return url
    netloc = f"{parts.username}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def read_classes(classes: Path, cfg: Any) -> Any:
    """The run's data description (``--classes``) as RunData; a bad file is the user's to fix."""
    from fedsga_edge.data.local import LocalDataError, read_run_data

    try:
        return read_run_data(classes, cfg.img_size)
    except LocalDataError as exc:
        raise FieldError(str(exc), usage=True) from None


def _transport(broker: str, run: str, client_id: str, max_packet: int, request_timeout: float = 60.0) -> Any:
    from fedsga_edge.transport.mqtt import MqttTransport

    try:
        return MqttTransport.from_url(broker, run=run, client_id=client_id, max_packet=max_packet,
                                      request_timeout=request_timeout)
    except Exception as exc:  # a bad URL or an unreachable broker is the user's to fix, not a traceback
        raise FieldError(f"cannot use broker {_redacted(broker)}: {exc}", code=2) from None


def _sealed(transport: Any, run: str, me: str, keys: dict[str, bytes], encrypt: bool) -> Any:
    """``transport`` with every message sealed by this party's keys (fedsga_edge/transport/sealed.py)."""
    from fedsga_edge.transport.sealed import SealedTransport
    from fedsga_edge.wire import LocalProtocolError
    from fedsga_edge.wire.auth import Keyring

    try:
        return SealedTransport(transport, Keyring(me, keys, encrypt=encrypt), run)
    except LocalProtocolError as exc:  # --encrypt without the cryptography package
        transport.close()
        raise FieldError(str(exc), code=2) from None


def _read_keys(keys: Path | None, key: Path | None) -> dict[str, bytes] | bytes | None:
    """The coordinator's key folder or a device's key file, checked before the broker is reached."""
    from fedsga_edge.wire.auth import KeyFileError, read_key, read_keys

    try:
        return read_keys(keys) if keys is not None else read_key(key) if key is not None else None
    except KeyFileError as exc:
        raise FieldError(str(exc), usage=True) from None


def run_coordinator(cfg: Any, broker: str, run_dir: Path, *, resume: bool, min_devices: int | None,
                    register_timeout: float, max_packet: int, classes: Path | None,
                    test_data: Path | None, keys: Path | None = None, encrypt: bool = False) -> dict[str, Any]:
    """Serve the server side of a run until its last round; the run's summary. ``keys``: the folder of the
    devices' keys (``<device>.key``): every message is then authenticated (and with ``encrypt`` encrypted)."""
    from fedsga_edge.runbuild import coordinator_service, default_run_id

    if test_data is not None and classes is None:
        raise FieldError("--test-data goes with --classes (a coordinator without training data); without "
                         "--classes the test set is the --dataset's", usage=True)
    run_data = read_classes(classes, cfg) if classes is not None else None
    if run_data is not None and test_data is None and not cfg.eval_holdout > 0:
        print("warning: no --test-data and --eval-holdout 0: nothing will measure the model's accuracy",
              file=sys.stderr, flush=True)
    ring = _read_keys(keys, None)
    if encrypt and ring is None:
        raise FieldError("--encrypt needs --keys (the devices' keys)", usage=True)
    transport = _transport(broker, default_run_id(cfg), "coordinator", max_packet)
    if isinstance(ring, dict):
        transport = _sealed(transport, default_run_id(cfg), "coordinator", ring, encrypt)
    try:
        service = coordinator_service(cfg, transport, run_dir, min_devices=min_devices or cfg.clients,
                                      register_timeout=register_timeout, resume=resume,
                                      run_data=run_data, test_data=test_data)
        if isinstance(ring, dict):  # frames refused before decode go to coordinator.log beside the Peer's refusals
            transport.on_reject = service.peer.on_reject
        signal.signal(signal.SIGTERM, lambda *_: service.stop())
        return service.run()
    except ValueError as exc:
        raise FieldError(str(exc), usage=True) from None
    finally:
        transport.close()


def run_device(cfg: Any, index: int, broker: str, state_dir: Path, *, backend: str, artifacts: Path | None,
               max_packet: int, threads: int, request_timeout: float, data: Path | None, fleet_link: str,
               latency_profile: Path | None, key: Path | None = None, encrypt: bool = False,
               memory_mb: float | None = None) -> None:
    """Run device ``index``'s agent until the coordinator ends the run (or SIGTERM: it says goodbye). ``key``:
    its key file from enrolment: every message is then authenticated (and with ``encrypt`` encrypted)."""
    from fedsga_edge.data.local import LocalDataError
    from fedsga_edge.runbuild import client_id, default_run_id, device_agent

    if fleet_link not in ("off", "delay", "emulated"):
        raise FieldError(f"--fleet-link must be off, delay or emulated (got {fleet_link!r})", usage=True)
    if memory_mb is not None and latency_profile is None:
        raise FieldError("--memory-mb needs --latency-profile FILE (the peak memory it measured per split)",
                         usage=True)
    latency_report = _latency_report(cfg, latency_profile)
    cid = client_id(index)
    own_key = _read_keys(None, key)
    if encrypt and own_key is None:
        raise FieldError("--encrypt needs --key (this device's key)", usage=True)
    transport = _transport(broker, default_run_id(cfg), cid, max_packet, request_timeout)
    sealed = None
    if isinstance(own_key, bytes):
        transport = sealed = _sealed(transport, default_run_id(cfg), cid, {"coordinator": own_key}, encrypt)
    if fleet_link != "off" and cfg.fleet:
        transport = link = _fleet_link(cfg, index, transport, emulate=fleet_link == "emulated")
    else:  # no fleet class: the link only measures the round (its timing), every trial's devices report it
        from fedsga_edge.transport.link import FleetLink

        transport = link = FleetLink(transport, rtt_ms=0.0, up_mbps=1.0, down_mbps=1.0)
    try:
        try:
            agent = device_agent(cfg, index, transport, state_dir, backend=backend, artifacts=artifacts,
                                 threads=threads or None, data=data, latency_profile=latency_profile,
                                 latency_report=latency_report, memory_mb=memory_mb)
            from fedsga_edge.transport.link import TimingPeer

            agent.client.peer = TimingPeer(agent.client.peer, link)
            if sealed is not None:  # frames refused before decode go to agent.log beside the Peer's refusals
                sealed.on_reject = agent.peer.on_reject
        except TimeoutError as exc:  # --data: the coordinator never described the run
            raise FieldError(f"{cid} is not registered: {exc}") from None
        except LocalDataError as exc:  # --data: its own data cannot be used; nothing was registered
            raise FieldError(f"{cid} did not register: its data: {exc}", code=2) from None
        _serve(agent, cid)
    except ValueError as exc:
        raise FieldError(str(exc), usage=True) from None
    finally:
        transport.close()


def _latency_report(cfg: Any, latency_profile: Path | None) -> Any:
    """``--latency-profile``: the file and its model, checked before the broker (its splits: once the model is
    built)."""
    if latency_profile is None:
        return None
    from fedsga_edge.latency import ProfileError, check_model, read_profile

    try:
        report = read_profile(latency_profile)
        check_model(report, cfg.model, width=cfg.width, where=f"--latency-profile {latency_profile}")
    except ProfileError as exc:
        raise FieldError(str(exc), usage=True) from None
    return report


def _serve(agent: Any, cid: str) -> None:
    """Register, then keep systemd's watchdog fed until the run ends; SIGTERM leaves the run politely."""
    from fedsga_edge.device.agent import RegistrationRefused
    from fedsga_edge.device.systemd import Systemd

    stopping = False

    def on_term(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_term)
    sd = Systemd()  # under systemd (Type=notify, WatchdogSec=): READY once registered, then heartbeats
    try:
        agent.start()
    except (RegistrationRefused, TimeoutError) as exc:  # refused by, or never reached, the coordinator
        agent.stop()
        raise FieldError(f"{cid} is not registered: {exc}") from None
    sd.ready(f"registered as {agent.cid}")
    while not stopping and not agent.finished.is_set():
        sd.watchdog(agent.health()["alive"])  # a dead worker thread stops the heartbeat: systemd restarts us
        time.sleep(0.2)
    sd.stopping()
    if stopping:
        agent.leave("stopped by SIGTERM")
    else:
        agent.stop()


def _fleet_link(cfg: Any, index: int, transport: Any, *, emulate: bool) -> Any:
    """Device ``index``'s transport under its fleet class's link (fedsga_edge/transport/link.py)."""
    from fedsga_edge.fleet import FleetError, load_fleet
    from fedsga_edge.fleetlimits import class_speed
    from fedsga_edge.runbuild import client_id
    from fedsga_edge.transport.link import FleetLink

    try:
        fleet = load_fleet(cfg.fleet)
        cls = fleet.assign([client_id(i) for i in range(cfg.clients)])[client_id(index)]
        speed = class_speed(fleet, cls) if emulate else 1.0
    except FleetError as exc:
        transport.close()
        raise FieldError(str(exc), usage=True) from None
    return FleetLink(transport, rtt_ms=cls.rtt_ms, up_mbps=cls.uplink_mbps, down_mbps=cls.downlink_mbps, speed=speed,
                     emulate=emulate)
