"""A field trial on one machine: a broker, the coordinator and N device agents as separate OS processes.

``fedsga-edge trial`` declares the flags and hands them here as ``TrialSettings``. ``run_trial`` checks
them (fleet, per-device data and profiles, the run config) before anything starts, exports the train
graphs for torch-free devices, starts the broker (and with ``--fleet`` the devices' namespaces and
cgroups), runs ``fedsga-edge coordinator`` and one ``fedsga-edge device`` per client, shows the rounds as
they land in ``metrics.jsonl``, and stops every process it started however the trial ends. A reason not
to go on is a ``FieldError`` naming it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsga_edge.fieldconfig import ENV_PREFIX
from fedsga_edge.fieldroles import FieldError, read_classes
from fedsga_edge.wire.auth import enrol, key_path

__all__ = ["BROKER_ENV", "TrialSettings", "follow", "run_trial", "stop_all"]

BROKER_ENV = ENV_PREFIX + "BROKER"  # what `coordinator` and `device` read when --broker is not given
CLI = [sys.executable, "-m", "fedsga_edge.cli.main"]


@dataclass
class TrialSettings:
    """The trial's own flags (the run's are in its RunConfig); ``fedsga-edge trial --help`` says what each does."""

    out: Path
    broker: str | None = None
    startup_timeout: float = 300.0
    threads: int = 1
    backend: str = "torch"
    artifacts: Path | None = None
    quiet: bool = False
    device_data: Path | None = None
    classes: Path | None = None
    test_data: Path | None = None
    device_profiles: Path | None = None
    fleet_mode: str = "auto"
    encrypt: bool = True  # AES-GCM on every payload besides the MAC (the trial always authenticates)


@dataclass
class _Plan:
    """Everything settled before the first process starts."""

    cfg: Any
    s: TrialSettings
    cfg_path: Path
    fleet: Any = None
    fleet_mode: str = "auto"
    threads: int = 1
    coordinator_args: list[str] = field(default_factory=list)
    device_args: list[str] = field(default_factory=list)  # every device's
    device_paths: list[Path] = field(default_factory=list)
    profiles: dict[int, Path] = field(default_factory=dict)

    @property
    def devices(self) -> list[str]:
        from fedsga_edge.runbuild import client_id

        return [client_id(i) for i in range(self.cfg.clients)]

    def common(self) -> list[str]:
        return ["--config", str(self.cfg_path), "--threads", str(self.threads)]

    def coordinator_argv(self) -> list[str]:
        return (CLI + ["coordinator", "--run-dir", str(self.s.out), "--register-timeout", str(self.s.startup_timeout)]
                + self.common() + self.coordinator_args + ["--keys", str(self.keys_dir)] + self.crypt())

    def device_argv(self, i: int) -> list[str]:
        return (CLI + ["device", "--index", str(i), "--state-dir", str(self.s.out / "devices" / f"client-{i:03d}")]
                + self.common() + self.device_args
                + (["--data", str(self.device_paths[i])] if self.device_paths else [])
                + (["--latency-profile", str(self.profiles[i])] if i in self.profiles else [])
                + ["--key", str(key_path(self.keys_dir, self.devices[i]))] + self.crypt())

    @property
    def keys_dir(self) -> Path:
        """The run's device keys (mode 0600 each): all for the coordinator, its own for each device."""
        return self.s.out / "keys"

    def crypt(self) -> list[str]:
        return ["--encrypt"] if self.s.encrypt else []


def _say(text: str, *, err: bool = False) -> None:
    print(text, file=sys.stderr if err else sys.stdout, flush=True)


def run_trial(cfg: Any, s: TrialSettings) -> dict[str, Any]:
    """Run the trial to its end; the run's summary (with ``fleet_mode`` and ``fleet_classes`` under a fleet)."""
    from fedsga_edge.runbuild import default_run_id

    plan = _plan(cfg, s)
    sandbox = _open_sandbox(plan)
    try:
        local = _start_broker(s.broker, s.out / "logs", plan.devices, default_run_id(cfg),
                              host=sandbox.host if sandbox is not None else "127.0.0.1")
    except BaseException:
        if sandbox is not None:
            sandbox.close()
        raise
    rc, quotas = _run_processes(plan, sandbox, local)
    if rc != 0:
        raise FieldError(f"the coordinator exited with {rc}; see {s.out / 'logs' / 'coordinator.out'}")
    summary = json.loads((s.out / "summary.json").read_text())
    if plan.fleet is not None:
        _fleet_report(s.out, summary, plan.fleet, plan.fleet_mode, quotas)
    return summary


def _plan(cfg: Any, s: TrialSettings) -> _Plan:
    """Check the flags against each other and the run config, write OUT/run_config.json and (``--backend
    onnx`` without ``--artifacts``) export the devices' train graphs."""
    from fedsga_edge.runbuild import validate_config

    plan = _Plan(cfg, s, s.out / "run_config.json", threads=s.threads)
    _check_fleet(plan)
    classes = _check_device_data(plan)
    if s.device_profiles is not None:
        plan.profiles = _device_profiles(s.device_profiles, cfg.clients)
    try:
        validate_config(cfg)
    except ValueError as exc:
        raise FieldError(str(exc), usage=True) from None
    if s.backend not in ("torch", "onnx"):
        raise FieldError(f"--backend must be torch or onnx (got {s.backend!r})", usage=True)
    (s.out / "logs").mkdir(parents=True, exist_ok=True)
    plan.cfg_path.write_text(json.dumps(cfg.to_dict(), indent=2))
    enrol(plan.keys_dir, plan.devices)
    if s.backend == "onnx":
        artifacts = s.artifacts or _export_for_devices(cfg, s.out, s.quiet, classes)
        plan.device_args = ["--backend", "onnx", "--artifacts", str(artifacts)]
    if plan.fleet is not None:
        plan.device_args += ["--fleet-link", "delay" if plan.fleet_mode == "cgroup+netns" else "emulated"]
    return plan


def _check_fleet(plan: _Plan) -> None:
    """``--fleet``: the file fits the run (every class has a speed) and the mode this machine allows; each
    device's torch then runs on one thread (a CPU quota of one core)."""
    cfg, s = plan.cfg, plan.s
    if not cfg.fleet:
        if s.fleet_mode != "auto":
            raise FieldError("--fleet-mode goes with --fleet", usage=True)
        return
    from fedsga_edge.fleet import FleetError, load_fleet
    from fedsga_edge.fleetlimits import class_speed

    cfg.fleet = str(Path(cfg.fleet).resolve())  # the processes read it too
    try:
        plan.fleet = load_fleet(cfg.fleet)
        plan.fleet.assign(plan.devices)
        for cls in plan.fleet.classes:
            class_speed(plan.fleet, cls)
    except FleetError as exc:
        raise FieldError(str(exc), usage=True) from None
    plan.fleet_mode = _fleet_mode(s.fleet_mode, s.broker, s.backend)
    plan.threads = 1


def _check_device_data(plan: _Plan) -> Path | None:
    """``--device-data``: one folder per device and the run's classes; the classes file, or None without it."""
    s = plan.s
    if s.device_data is None:
        if s.classes is not None or s.test_data is not None:
            raise FieldError("--classes and --test-data go with --device-data", usage=True)
        return None
    classes = s.classes or s.device_data / "dataset.json"
    if not classes.exists():
        raise FieldError(f"--device-data {s.device_data} has no dataset.json: give --classes", usage=True)
    plan.device_paths = [p.resolve() for p in _device_folders(s.device_data, plan.cfg.clients)]
    plan.coordinator_args = ["--classes", str(classes.resolve())]
    if s.test_data is not None:
        plan.coordinator_args += ["--test-data", str(s.test_data.resolve())]
    return classes


def _open_sandbox(plan: _Plan) -> Any:
    """``--fleet-mode cgroup+netns``: the devices' namespaces and cgroups (None in any other mode)."""
    sandbox = None
    if plan.fleet is not None and plan.fleet_mode == "cgroup+netns":
        from fedsga_edge.fleetlimits import FleetSandbox

        try:
            sandbox = FleetSandbox(plan.fleet, plan.devices).open()
        except OSError as exc:
            raise FieldError(f"cannot build the fleet's namespaces and cgroups: {exc} (--fleet-mode emulated "
                             "needs neither)", code=2) from None
    if plan.fleet is not None:
        _say(f"fleet: {plan.fleet_mode}" + (f" (devices in namespaces {sandbox.prefix}d*, broker on {sandbox.host})"
                                            if sandbox is not None else ""), err=True)
    return sandbox


def _run_processes(plan: _Plan, sandbox: Any, local: Any) -> tuple[int, dict[str, float] | None]:
    """Start the coordinator and the devices, follow the rounds until the coordinator exits, then stop every
    process, the broker and the sandbox. (The coordinator's exit status, each class's CPU quota under a
    sandbox.)"""
    from fedsga_edge.broker.launch import die_with_parent

    def env(login: str) -> dict[str, str]:
        """The broker URL (with this process's password) in the environment, not on a command line."""
        return {**os.environ, BROKER_ENV: local.url_for(login) if local is not None else str(plan.s.broker)}

    logs_dir = plan.s.out / "logs"
    signal.signal(signal.SIGTERM, _raise_interrupt)  # run the cleanup below when the trial is stopped
    procs: dict[str, subprocess.Popen] = {}
    logs: list[Any] = []
    try:
        procs["coordinator"] = _spawn(plan.coordinator_argv(), logs_dir / "coordinator.out", logs, die_with_parent,
                                      env("coordinator"))
        for i, cid in enumerate(plan.devices):
            argv, prepare = _device_start(plan, sandbox, i, die_with_parent)
            procs[f"device-{i:03d}"] = _spawn(argv, logs_dir / f"device-{i:03d}.out", logs, prepare, env(cid))
        follow(plan.s.out / "metrics.jsonl", procs["coordinator"], plan.cfg.rounds, plan.s.quiet,
               classes=_fleet_classes(plan.fleet, plan.devices))
        rc = procs["coordinator"].wait()
        quotas = {c.name: sandbox.quota(next(d for d, k in sandbox.classes.items() if k is c))
                  for c in plan.fleet.classes} if sandbox is not None else None
    finally:
        try:
            stop_all(procs, logs, local)
        finally:
            if sandbox is not None:
                sandbox.close()
    return rc, quotas


def _spawn(argv: list[str], log_path: Path, logs: list[Any], prepare: Callable[[], None],
           env: dict[str, str]) -> subprocess.Popen:
    """One process with its output in ``log_path`` (the open log joins ``logs``, closed at the end)."""
    log = open(log_path, "w")
    logs.append(log)
    return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=prepare, env=env)


def _device_start(plan: _Plan, sandbox: Any, i: int,
                  die_with_parent: Callable[[], None]) -> tuple[list[str], Callable[[], None]]:
    """Device ``i``'s command line and what its child runs before exec (in a sandbox: join its namespace and
    cgroup)."""
    argv = plan.device_argv(i)
    if sandbox is None:
        return argv, die_with_parent
    enter = sandbox.join(plan.devices[i])

    def prepare() -> None:
        die_with_parent()
        enter()
    return sandbox.command(i, argv), prepare


def _fleet_mode(asked: str, broker: str | None, backend: str) -> str:
    """``--fleet-mode``: the one asked for, or (auto) real limits where this machine can, else emulated."""
    from fedsga_edge.fleetlimits import MODES, real_limits_problem

    if asked not in ("auto", *MODES):
        raise FieldError(f"--fleet-mode must be auto, {' or '.join(MODES)} (got {asked!r})", usage=True)
    if asked == "emulated":
        return asked
    problem = real_limits_problem()
    if problem is None and broker not in (None, "embedded"):
        problem = "the device namespaces reach only the embedded broker this trial starts (omit --broker)"
    if problem is None and backend != "torch":
        problem = "--backend onnx sets its own threads"
    if problem is None:
        return "cgroup+netns"
    if asked == "cgroup+netns":
        raise FieldError(f"--fleet-mode cgroup+netns cannot run here: {problem}", usage=True)
    _say(f"fleet: real limits unavailable ({problem}): emulated instead", err=True)
    return "emulated"


def _fleet_report(out: Path, summary: dict[str, Any], fleet: Any, mode: str, quotas: dict[str, float] | None) -> None:
    """Per class: measured compute per step against the CPU share, wire seconds against the link model;
    printed, and in summary.json (``fleet_mode``, ``fleet_classes``)."""
    from fedsga_edge.fleetlimits import class_speed, class_table, format_class_table
    from fedsga_edge.runfiles import atomic_write

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    shares = quotas if quotas is not None else {c.name: class_speed(fleet, c) for c in fleet.classes}
    rows = class_table(records, fleet, shares)
    _say(format_class_table(rows, mode))
    summary["fleet_mode"], summary["fleet_classes"] = mode, rows
    atomic_write(out / "summary.json", json.dumps(summary, indent=2))


def _device_folders(device_data: Path, clients: int) -> list[Path]:
    """``DIR/client-NNN`` (a folder, or ``client-NNN.npz``) for each device, as ``partition`` writes them."""
    if not device_data.is_dir():
        raise FieldError(f"--device-data {device_data} is not a folder (one sub-folder per device)", usage=True)
    out = []
    for i in range(clients):
        folder, npz = device_data / f"client-{i:03d}", device_data / f"client-{i:03d}.npz"
        if not folder.exists() and not npz.exists():
            raise FieldError(f"--device-data {device_data} has no client-{i:03d}/ (or client-{i:03d}.npz) for "
                             f"device {i} of --clients {clients}; `fedsga-edge partition` writes one per device",
                             usage=True)
        out.append(folder if folder.exists() else npz)
    return out


def _device_profiles(folder: Path, clients: int) -> dict[int, Path]:
    """``DIR/client-NNN.json`` of the devices that have one, by index; none at all is an error (a wrong folder)."""
    if not folder.is_dir():
        raise FieldError(f"--device-profiles {folder} is not a folder", usage=True)
    found = {i: (folder / f"client-{i:03d}.json").resolve() for i in range(clients)
             if (folder / f"client-{i:03d}.json").is_file()}
    if not found:
        raise FieldError(f"--device-profiles {folder} has no client-NNN.json for any of the --clients {clients} "
                         "devices", usage=True)
    return found


def stop_all(procs: dict[Any, subprocess.Popen], logs: list[Any], local: Any) -> None:
    """SIGTERM every process still running, kill what has not exited after 30 s, close logs, stop the broker."""
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
    if local is not None:
        local.stop()


def _export_for_devices(cfg: Any, out: Path, quiet: bool, classes: Path | None = None) -> Path:
    """``fedsga-edge export --train`` of the run's model for torch-free devices (weights come each round);
    ``classes``: the run's data description (--device-data) instead of the dataset."""
    if cfg.model_args:
        raise FieldError("--backend onnx: the export takes no --model-arg; export the artifacts yourself "
                         "and pass --artifacts", usage=True)
    if classes is not None:
        run = read_classes(classes, cfg)
        num_classes, img_size = len(run.classes), cfg.img_size or run.image_size
    else:
        from fedsga_edge.data import load_dataset

        bundle = load_dataset(cfg.dataset, cfg.data_root, image_size=cfg.img_size)
        num_classes, img_size = bundle.num_classes, cfg.img_size
    dest = out / "artifacts"
    cmd = CLI + ["export", "--model", cfg.model, "--train", "--num-classes", str(num_classes),
                 "--prompts", str(cfg.fedsga.prompts), "--out", str(dest)]
    if cfg.width is not None:
        cmd += ["--width", str(cfg.width)]
    if img_size:
        cmd += ["--img-size", str(img_size)]
    if not quiet:
        _say(f"exporting the devices' train graphs -> {dest} (log: {out / 'logs' / 'export.out'})")
    with open(out / "logs" / "export.out", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise FieldError(f"the export failed; see {out / 'logs' / 'export.out'}")
    return dest


def _raise_interrupt(*_: Any) -> None:
    raise KeyboardInterrupt


def _fleet_classes(fleet: Any, devices: list[str]) -> dict[str, str] | None:
    """Each device's class name for the live table; None without a fleet (or one that does not fit the run:
    the coordinator says so)."""
    if fleet is None:
        return None
    try:
        return {d: c.name for d, c in fleet.assign(devices).items()}
    except ValueError:
        return None


def follow(metrics: Path, coordinator: Any, rounds: int, quiet: bool, every: float = 10.0,
           poll: float = 0.5, classes: dict[str, str] | None = None) -> None:
    """A progress bar over the rounds the coordinator has written, until it exits, and the devices' live table
    (``fedsga_edge.devicetable``: online, round, split, last step time, link rate) above it: after every round
    and, while devices register, train or leave, at most every ``every`` seconds; ``classes``: each device's
    fleet class (``--fleet``), shown from the start."""
    from tqdm import tqdm

    from fedsga_edge.devicetable import DeviceTable, JsonTail

    bar = tqdm(total=rounds, desc="trial", unit="round", disable=quiet)
    table, events, records = DeviceTable(classes), JsonTail(metrics.parent / "coordinator.log"), JsonTail(metrics)
    shown, pending, running = time.monotonic(), False, True
    while running:
        running = coordinator.poll() is None
        if running:
            time.sleep(poll)
        changed = [table.event(e) for e in events.read()]  # every event, not up to the first that changed it
        pending |= any(changed)
        done = False
        for rec in records.read():
            table.record(rec)
            post = {"devices": len(rec.get("splits", {})), "failures": len(rec.get("failures", {}))}
            if "test_acc" in rec:
                post["acc"] = f"{rec['test_acc']:.4f}"
            bar.set_postfix(post)
            bar.update(1)
            done = True
        if not quiet and table.devices and (done or (pending and time.monotonic() - shown >= every)):
            bar.write(table.format())
            shown, pending = time.monotonic(), False
    bar.close()


def _start_broker(broker: str | None, log_dir: Path, devices: list[str], run: str, host: str = "127.0.0.1") -> Any:
    """The trial's broker: start the embedded one (None) or Mosquitto ('mosquitto') on a free 127.0.0.1
    port with its log in ``log_dir``, or check that a given URL answers. Returns the RunningBroker to stop
    at the end, or None for an external broker. The launchers live in ``fedsga_edge.broker.launch``.

    A local broker takes only this run's logins (a fresh password per device and for the coordinator):
    127.0.0.1 alone would let every local user read and forge the run's traffic. Mosquitto also binds
    each login to its topics and its client id; rumqttd cannot (docs/protocol.md)."""
    from fedsga_edge.broker.launch import (
        BrokerError,
        RunLogins,
        check_reachable,
        start_embedded,
        start_secured_mosquitto,
    )

    try:
        if broker is None or broker == "embedded":
            local = start_embedded(log_dir, logins=RunLogins.generate(devices), host=host)
        elif broker == "mosquitto":
            local = start_secured_mosquitto(log_dir, RunLogins.generate(devices), run=run)
        else:
            check_reachable(broker)  # before starting N processes that would each time out on it
            return None
    except BrokerError as exc:
        hint = " (omit --broker to use the embedded broker)" if broker not in (None, "embedded", "mosquitto") else ""
        raise FieldError(f"{exc}{hint}", code=2) from None
    _say(f"broker: {local.kind} at {local.url}, {len(devices) + 1} per-run logins (log: {local.log})", err=True)
    return local
