"""``fedsga-edge coordinator | device | trial``: the roles as long-lived processes over MQTT.

The commands only wire: a RunConfig (simulate's flags, or ``--config`` with a saved one), an MQTT
transport, and the coordinator service or a device agent (``fedsga_edge.runbuild``). ``trial``
starts a broker when none is given, then the coordinator and N device agents as separate OS
processes, and shows the rounds as they land in the run's ``metrics.jsonl``.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from .simulate import RUN_FLAGS, run_config, set_threads, simulate

__all__ = ["register"]

_HINTS = typing.get_type_hints(simulate)  # real types: typer resolves string annotations in the wrong module
_RUN_PARAMS = [p.replace(annotation=_HINTS[n]) for n, p in inspect.signature(simulate).parameters.items()
               if n in RUN_FLAGS]


def _with_run_flags(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``fn`` simulate's run flags too (typer reads the signature), so every role takes them."""
    hints = typing.get_type_hints(fn)
    own = [p.replace(annotation=hints.get(p.name, p.annotation))
           for p in inspect.signature(fn).parameters.values() if p.kind is not p.VAR_KEYWORD]
    names = {p.name for p in own}
    fn.__signature__ = inspect.Signature(own + [p for p in _RUN_PARAMS if p.name not in names])  # type: ignore[attr-defined]
    return fn


def _config(config: Optional[Path], flags: dict[str, Any]) -> Any:
    """``--config`` (a RunConfig JSON, as trial writes it) wins over flags; else the flags."""
    from fedsga_edge.config import RunConfig

    if config is not None:
        try:
            return RunConfig.from_dict(json.loads(Path(config).read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise typer.BadParameter(f"--config {config}: {exc}") from None
    return run_config(**{k: v for k, v in flags.items() if k in RUN_FLAGS})


FIELD_DEADLINE_S = 600.0


def _with_deadline(cfg: Any) -> Any:
    """A field run needs a round deadline (a silent device must not stall a round forever):
    without --round-timeout it gets FIELD_DEADLINE_S."""
    if not cfg.round_timeout > 0:
        cfg.round_timeout = FIELD_DEADLINE_S
    return cfg


def _transport(broker: str, run: str, client_id: str, max_packet: int) -> Any:
    from fedsga_edge.transport.mqtt import MqttTransport

    try:
        return MqttTransport.from_url(broker, run=run, client_id=client_id, max_packet=max_packet)
    except Exception as exc:  # a bad URL or an unreachable broker is the user's to fix, not a traceback
        typer.secho(f"error: cannot use broker {broker}: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None


@_with_run_flags
def coordinator(
    broker: str = typer.Option(..., help="mqtt://[user:pass@]host:port or mqtts://..."),
    run_dir: Path = typer.Option(..., help="Run folder: config, metrics, summary, checkpoint, coordinator.log."),
    config: Optional[Path] = typer.Option(None, help="A RunConfig JSON (e.g. RUN/run_config.json) instead of flags."),
    min_devices: Optional[int] = typer.Option(None, help="Devices to wait for before round 1 (default: --clients)."),
    register_timeout: float = typer.Option(300.0, help="Seconds to wait for them; then go on with those there are."),
    max_packet: int = typer.Option(256 * 1024, help="Largest MQTT payload; bigger messages are chunked."),
    threads: int = typer.Option(0, help="torch intra-op threads (0 = torch's default)."),
    **flags: Any,
) -> None:
    """Serve the server side of a run: wait for devices, run every round with a deadline, write the run files."""
    set_threads(threads)
    cfg = _with_deadline(_config(config, flags))
    from fedsga_edge.runbuild import coordinator_service, default_run_id

    transport = _transport(broker, default_run_id(cfg), "coordinator", max_packet)
    try:
        service = coordinator_service(cfg, transport, run_dir, min_devices=min_devices or cfg.clients,
                                      register_timeout=register_timeout)
        signal.signal(signal.SIGTERM, lambda *_: service.stop())
        summary = service.run()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    finally:
        transport.close()
    typer.echo(f"final_acc={summary.get('final_acc')} rounds={summary.get('rounds')} "
               f"failures={summary.get('failures')} -> {run_dir}")


@_with_run_flags
def device(
    broker: str = typer.Option(..., help="mqtt://[user:pass@]host:port or mqtts://..."),
    index: int = typer.Option(..., help="Which device of the run this is (0..clients-1): its id and data share."),
    state_dir: Path = typer.Option(..., help="Private state (prompts, r, descriptors) kept across restarts."),
    config: Optional[Path] = typer.Option(None, help="A RunConfig JSON instead of flags."),
    backend: str = typer.Option("torch", help="torch (the ONNX backend comes with the field issue's next step)."),
    max_packet: int = typer.Option(256 * 1024, help="Largest MQTT payload; bigger messages are chunked."),
    threads: int = typer.Option(0, help="torch intra-op threads (0 = torch's default)."),
    **flags: Any,
) -> None:
    """Run one device agent until the coordinator ends the run (or SIGTERM)."""
    if backend != "torch":
        raise typer.BadParameter(f"--backend {backend!r} is not available yet; use torch")
    set_threads(threads)
    cfg = _config(config, flags)
    from fedsga_edge.runbuild import client_id, default_run_id, device_agent

    transport = _transport(broker, default_run_id(cfg), client_id(index), max_packet)
    try:
        agent = device_agent(cfg, index, transport, state_dir, backend=backend)
        stopping = False

        def on_term(*_: Any) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, on_term)
        agent.start()
        while not stopping and not agent.finished.is_set():
            time.sleep(0.2)
        if stopping:
            agent.leave("stopped by SIGTERM")
        else:
            agent.stop()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    finally:
        transport.close()


@_with_run_flags
def trial(
    out: Path = typer.Option(Path("runs/trial"), help="Run folder: simulate's files, one log per process, device state."),
    broker: Optional[str] = typer.Option(None, help="Use this broker; default: start Mosquitto on a free 127.0.0.1 port."),
    startup_timeout: float = typer.Option(300.0, help="Seconds the coordinator waits for every device to register."),
    threads: int = typer.Option(1, help="torch threads per process (processes share the cores)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
    **flags: Any,
) -> None:
    """A field trial on this machine: a broker, the coordinator and N device agents as separate processes."""
    cfg = _with_deadline(run_config(**{k: v for k, v in flags.items() if k in RUN_FLAGS}))
    from fedsga_edge.simulation import validate_config

    try:
        validate_config(cfg)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    cfg_path = out / "run_config.json"
    cfg_path.write_text(json.dumps(cfg.to_dict(), indent=2))
    broker_proc = None
    if broker is None:
        broker, broker_proc = _start_mosquitto(out / "logs")
    base = [sys.executable, "-m", "fedsga_edge.cli.main"]
    signal.signal(signal.SIGTERM, _raise_interrupt)  # run the cleanup below when the trial is stopped
    common = ["--broker", broker, "--config", str(cfg_path), "--threads", str(threads)]
    procs: dict[str, subprocess.Popen] = {}
    logs = []
    try:
        log = open(out / "logs" / "coordinator.out", "w")
        logs.append(log)
        procs["coordinator"] = subprocess.Popen(
            base + ["coordinator", "--run-dir", str(out), "--register-timeout", str(startup_timeout)] + common,
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        for i in range(cfg.clients):
            log = open(out / "logs" / f"device-{i:03d}.out", "w")
            logs.append(log)
            procs[f"device-{i:03d}"] = subprocess.Popen(
                base + ["device", "--index", str(i), "--state-dir", str(out / "devices" / f"client-{i:03d}")] + common,
                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        _follow(out / "metrics.jsonl", procs["coordinator"], cfg.rounds, quiet)
        rc = procs["coordinator"].wait()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        for log in logs:
            log.close()
        if broker_proc is not None:
            broker_proc.terminate()
            broker_proc.wait(10)
    if rc != 0:
        typer.secho(f"error: the coordinator exited with {rc}; see {out / 'logs' / 'coordinator.out'}", fg="red", err=True)
        raise typer.Exit(1)
    summary = json.loads((out / "summary.json").read_text())
    typer.echo(f"final_acc={summary.get('final_acc')} rounds={summary.get('rounds')} "
               f"failures={summary.get('failures')} -> {out}")


def _raise_interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def _die_with_parent() -> None:
    """Linux: the child gets SIGTERM when the trial process dies, even by SIGKILL (no orphans)."""
    if sys.platform.startswith("linux"):
        import ctypes

        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except OSError:
            pass


def _follow(metrics: Path, coordinator: subprocess.Popen, rounds: int, quiet: bool) -> None:
    """A progress bar over the rounds the coordinator has written, until it exits."""
    from tqdm import tqdm

    bar = tqdm(total=rounds, desc="trial", unit="round", disable=quiet)
    seen = 0
    while coordinator.poll() is None:
        time.sleep(0.5)
        if metrics.exists():
            lines = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
            for rec in lines[seen:]:
                post = {"devices": len(rec.get("splits", {})), "failures": len(rec.get("failures", {}))}
                if "test_acc" in rec:
                    post["acc"] = f"{rec['test_acc']:.4f}"
                bar.set_postfix(post)
                bar.update(1)
            seen = len(lines)
    bar.close()


def _mosquitto() -> str | None:
    return shutil.which("mosquitto") or next((p for p in ("/usr/sbin/mosquitto",) if os.path.exists(p)), None)


def _start_mosquitto(log_dir: Path) -> tuple[str, subprocess.Popen]:
    """Mosquitto on a free 127.0.0.1 port, anonymous, for this trial only."""
    exe = _mosquitto()
    if exe is None:
        typer.secho("error: no broker: pass --broker mqtt://HOST:PORT or install Mosquitto "
                    "(Debian/Ubuntu: apt-get install mosquitto)", fg="red", err=True)
        raise typer.Exit(2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conf = Path(tempfile.mkdtemp(prefix="fedsga-broker-")) / "mosquitto.conf"
    conf.write_text(f"listener {port} 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\npersistence false\n")
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=open(log_dir / "broker.out", "w"), stderr=subprocess.STDOUT,
                            preexec_fn=_die_with_parent)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return f"mqtt://127.0.0.1:{port}", proc
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    proc.kill()
    typer.secho(f"error: Mosquitto did not start; see {log_dir / 'broker.out'}", fg="red", err=True)
    raise typer.Exit(2)


def register(app: typer.Typer) -> None:
    app.command("coordinator")(coordinator)
    app.command("device")(device)
    app.command("trial")(trial)
