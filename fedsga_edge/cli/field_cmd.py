"""``fedsga-edge coordinator | device | trial``: the roles as long-lived processes over MQTT.

The commands only wire: a RunConfig (simulate's flags, or ``--config`` with a saved one), an MQTT
transport, and the coordinator service or a device agent (``fedsga_edge.runbuild``). ``trial``
starts a broker when none is given, then the coordinator and N device agents as separate OS
processes, and shows the rounds as they land in the run's ``metrics.jsonl``.
"""

from __future__ import annotations

import copy
import difflib
import inspect
import json
import os
import signal
import subprocess
import sys
import time
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import typer

from .runflags import run_config, run_flags, with_run_options
from .simulate import set_threads

__all__ = ["register"]


# -- configuration layers: flag > FEDSGA_EDGE_<NAME> > TOML file > default ---------------------------

ENV_PREFIX = "FEDSGA_EDGE_"
CONFIG_FILE_ENV = "FEDSGA_EDGE_CONFIG"  # the TOML file; so --config (a run config JSON) reads another variable
_ENVVAR_OF = {"config": "FEDSGA_EDGE_RUN_CONFIG"}
_SOURCES = {"COMMANDLINE": "command line", "ENVIRONMENT": "environment", "DEFAULT_MAP": "config file"}


def _layered(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Every option of ``fn`` can also come from ``FEDSGA_EDGE_<NAME>`` and from a TOML file.

    No precedence code of our own: click takes a value from the command line, then the option's
    ``envvar``, then ``ctx.default_map``, then the default. The eager ``--config-file`` (or
    ``$FEDSGA_EDGE_CONFIG``) callback fills ``default_map`` from the file before any other option
    is read. Apply after ``with_run_options`` so the run options get the same layers.
    """
    params = []
    for p in inspect.signature(fn).parameters.values():
        info = p.default
        if isinstance(info, typer.models.OptionInfo) and not info.envvar:
            info = copy.copy(info)  # never change a shared OptionInfo in place
            info.envvar = _ENVVAR_OF.get(p.name, ENV_PREFIX + p.name.upper())
            p = p.replace(default=info)
        params.append(p)
    params.append(inspect.Parameter("config_file", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Optional[Path],
                                    default=typer.Option(
        None, "--config-file", envvar=CONFIG_FILE_ENV, is_eager=True, expose_value=False, callback=_read_config_file,
        help="A TOML file of defaults: keys are the option names with underscores (state_dir = \"...\"). "
             "Command-line flags, then FEDSGA_EDGE_<NAME> variables, override it.")))
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    return fn


def _read_config_file(ctx: typer.Context, param: typer.CallbackParam, value: Optional[Path]) -> Optional[Path]:
    """``--config-file``: the file's keys become the command's defaults (``ctx.default_map``)."""
    if value is not None:
        ctx.default_map = {**(ctx.default_map or {}), **_toml_defaults(ctx, Path(value))}
        ctx.meta["fedsga_config_file"] = str(value)
    return value


def _toml_defaults(ctx: typer.Context, path: Path) -> dict[str, Any]:
    """The file's values, each checked against its option: an unknown key or a wrong type names the
    key and the file (a typo must not silently leave an option at its default)."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10 (pyproject installs tomli there)
        import tomli as tomllib
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except OSError as exc:
        raise typer.BadParameter(f"cannot read {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise typer.BadParameter(f"{path} is not valid TOML: {exc}") from None
    options = {p.name: p for p in ctx.command.params if p.expose_value and p.name}
    for key, value in data.items():
        opt = options.get(key)
        if opt is None:
            near = difflib.get_close_matches(key.replace("-", "_"), list(options), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise typer.BadParameter(f"{path}: unknown key {key!r}{hint}; the keys are this command's option "
                                     "names with underscores (see --help)")
        kind, many = _toml_kind(opt)
        bad = _toml_mismatch(value, kind, many)
        if bad:
            raise typer.BadParameter(f"{path}: key {key!r} must be {bad}, not {_toml_type(value)} {value!r:.80}")
    return data


def _toml_kind(opt: Any) -> tuple[str, bool]:
    """(the TOML type an option takes, whether it takes a list of them), from its annotation."""
    many = bool(getattr(opt, "multiple", False))
    if not hasattr(opt, "type_descriptor"):  # typer before 0.2x: a click parameter type
        name = getattr(getattr(opt, "type", None), "name", "")
        kind = "boolean" if getattr(opt, "is_flag", False) or name == "boolean" else \
            "integer" if name.startswith("integer") else "number" if name.startswith("float") else "string"
        return kind, many
    annotation = opt.type_descriptor.annotation
    if many and typing.get_args(annotation):
        annotation = typing.get_args(annotation)[0]
    if getattr(opt, "is_flag", False) or annotation is bool:
        return "boolean", many
    kinds = {int: "integer", float: "number"}
    return kinds.get(annotation, "string"), many


def _toml_mismatch(value: Any, kind: str, many: bool) -> str | None:
    """What ``value`` should have been, or None when it fits (bool is no number here, unlike Python)."""
    if many:
        if not isinstance(value, list) or any(_toml_mismatch(v, kind, False) for v in value):
            return f"an array of {kind}s"
        return None
    ok = {"boolean": isinstance(value, bool),
          "integer": isinstance(value, int) and not isinstance(value, bool),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool),
          "string": isinstance(value, str)}[kind]
    return None if ok else f"an {kind}" if kind == "integer" else f"a {kind}"


def _toml_type(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
            dict: "a table"}.get(type(value), type(value).__name__)


def _explicit(ctx: typer.Context | None, names: typing.Iterable[str]) -> list[str]:
    """Which of ``names`` were set on purpose, and where (command line, environment, config file)."""
    if ctx is None:
        return []
    given = []
    for name in names:
        source = ctx.get_parameter_source(name)
        where = _SOURCES.get(getattr(source, "name", ""))
        if where == "environment":
            given.append(f"{ENV_PREFIX}{name.upper()} (environment)")
        elif where == "config file":
            given.append(f"{name} (config file {ctx.meta.get('fedsga_config_file')})")
        elif where:
            given.append(f"--{name.replace('_', '-')} (command line)")
    return given


def _config(config: Optional[Path], flags: dict[str, Any], ctx: typer.Context | None = None) -> Any:
    """``--config`` (a RunConfig JSON, as trial writes it) or the run flags, never both: a run flag
    set anywhere (flag, environment, config file) next to ``--config`` is an error, not ignored."""
    from fedsga_edge.config import RunConfig

    if config is not None:
        given = _explicit(ctx, run_flags())
        if given:
            raise typer.BadParameter(f"--config {config} holds the run's settings, but {', '.join(given)} "
                                     "also set run flags: use one or the other")
        try:
            return RunConfig.from_dict(json.loads(Path(config).read_text()))
        except (OSError, ValueError, TypeError) as exc:
            raise typer.BadParameter(f"--config {config}: {exc}") from None
    return run_config(**_run_flags_of(flags))


def _run_flags_of(flags: dict[str, Any]) -> dict[str, Any]:
    """The run options among a command's keyword arguments (typer also hands on ``config_file``)."""
    names = set(run_flags())
    return {k: v for k, v in flags.items() if k in names}


def _saved_config(run_dir: Path) -> Any:
    """The RunConfig a coordinator wrote to RUN/config.json (its extra keys, e.g. client_sizes, dropped)."""
    from fedsga_edge.config import RunConfig

    path = run_dir / "config.json"
    try:
        return RunConfig.from_record(json.loads(path.read_text()))
    except FileNotFoundError:
        raise typer.BadParameter(f"--resume {run_dir}: no config.json there (not a run folder?); pass the run's "
                                 "flags or --config too") from None
    except (OSError, ValueError, TypeError) as exc:
        raise typer.BadParameter(f"--resume {run_dir}: {path}: {exc}") from None


FIELD_DEADLINE_S = 600.0


def _with_deadline(cfg: Any) -> Any:
    """A field run needs a round deadline (a silent device must not stall a round forever):
    without --round-timeout it gets FIELD_DEADLINE_S."""
    if not cfg.round_timeout > 0:
        cfg.round_timeout = FIELD_DEADLINE_S
    return cfg


def _transport(broker: str, run: str, client_id: str, max_packet: int, request_timeout: float = 60.0) -> Any:
    from fedsga_edge.transport.mqtt import MqttTransport

    try:
        return MqttTransport.from_url(broker, run=run, client_id=client_id, max_packet=max_packet,
                                      request_timeout=request_timeout)
    except Exception as exc:  # a bad URL or an unreachable broker is the user's to fix, not a traceback
        typer.secho(f"error: cannot use broker {_redacted(broker)}: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None


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


@_layered
@with_run_options
def coordinator(
    ctx: typer.Context,
    broker: str = typer.Option(..., help="mqtt://host:port or mqtts://host:port (a login: mqtt://user:pass@host:port)."),
    run_dir: Optional[Path] = typer.Option(None, help="Run folder: config, metrics, summary, checkpoint, coordinator.log."),
    config: Optional[Path] = typer.Option(None, help="A RunConfig JSON (e.g. RUN/run_config.json) instead of flags."),
    resume: Optional[Path] = typer.Option(
        None, help="Continue the run in this folder from its last checkpoint (after a crash or kill); its config.json "
        "holds the settings unless flags or --config are given. Devices need not restart."),
    min_devices: Optional[int] = typer.Option(None, help="Devices to wait for before round 1 (default: --clients)."),
    register_timeout: float = typer.Option(300.0, help="Seconds to wait for them; then go on with those there are."),
    max_packet: int = typer.Option(256 * 1024, help="Largest MQTT payload; bigger messages are chunked."),
    threads: int = typer.Option(0, help="torch intra-op threads (0 = torch's default)."),
    classes: Optional[Path] = typer.Option(
        None, help="The devices bring their own data (device --data): the run's classes, and no dataset here. A "
        "dataset.json as `fedsga-edge partition` writes it (classes, image_size, mean, std), a JSON list, or a text "
        "file with one class name per line (then --img-size gives the input size)."),
    test_data: Optional[Path] = typer.Option(
        None, help="With --classes: an optional test set of this coordinator's own (an image folder or npz, as "
        "device --data reads it) for its test_acc beside the devices' federated figure."),
    **flags: Any,
) -> None:
    """Serve the server side of a run: wait for devices, run every round with a deadline, write the run files."""
    if run_dir is None and resume is None:
        raise typer.BadParameter("give --run-dir RUN (a new run) or --resume RUN (continue one)")
    if run_dir is not None and resume is not None and run_dir.resolve() != resume.resolve():
        raise typer.BadParameter(f"--run-dir {run_dir} and --resume {resume} name different folders")
    run_dir = resume if run_dir is None else run_dir
    set_threads(threads)
    if resume is not None and config is None and not _explicit(ctx, run_flags()):
        cfg = _saved_config(resume)
    else:
        cfg = _config(config, flags, ctx)
    cfg = _with_deadline(cfg)
    from fedsga_edge.runbuild import coordinator_service, default_run_id

    if test_data is not None and classes is None:
        raise typer.BadParameter("--test-data goes with --classes (a coordinator without training data); without "
                                 "--classes the test set is the --dataset's")
    run_data = _run_data(classes, cfg) if classes is not None else None
    if run_data is not None and test_data is None and not cfg.eval_holdout > 0:
        typer.secho("warning: no --test-data and --eval-holdout 0: nothing will measure the model's accuracy",
                    fg="yellow", err=True)
    transport = _transport(broker, default_run_id(cfg), "coordinator", max_packet)
    try:
        service = coordinator_service(cfg, transport, run_dir, min_devices=min_devices or cfg.clients,
                                      register_timeout=register_timeout, resume=resume is not None,
                                      run_data=run_data, test_data=test_data)
        signal.signal(signal.SIGTERM, lambda *_: service.stop())
        summary = service.run()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    finally:
        transport.close()
    from fedsga_edge.runfiles import fed_text

    fed = fed_text(summary)
    typer.echo(f"final_acc={summary.get('final_acc')}{fed} rounds={summary.get('rounds')} "
               f"failures={summary.get('failures')} -> {run_dir}")


@_layered
@with_run_options
def device(
    ctx: typer.Context,
    broker: str = typer.Option(..., help="mqtt://host:port or mqtts://host:port (a login: mqtt://user:pass@host:port)."),
    index: int = typer.Option(..., help="Which device of the run this is (0..clients-1): its id and data share."),
    state_dir: Path = typer.Option(..., help="Private state (prompts, r, descriptors) kept across restarts."),
    config: Optional[Path] = typer.Option(None, help="A RunConfig JSON instead of flags."),
    backend: str = typer.Option("torch", help="torch | onnx (onnxruntime + numpy, no torch: needs --artifacts)."),
    artifacts: Optional[Path] = typer.Option(None, help="--backend onnx: the folder `fedsga-edge export --train` wrote."),
    max_packet: int = typer.Option(256 * 1024, help="Largest MQTT payload; bigger messages are chunked."),
    threads: int = typer.Option(0, help="Intra-op threads of torch or onnxruntime (0 = the library's default)."),
    request_timeout: float = typer.Option(60.0, help="Seconds to wait for the coordinator's reply to one request."),
    data: Optional[Path] = typer.Option(
        # not FEDSGA_EDGE_DATA: that variable is the data sets' root (fedsga_edge.data.default_root)
        None, "--data", envvar="FEDSGA_EDGE_DEVICE_DATA",
        help="This device's own data, used whole: a folder with one sub-folder per class (PNG, JPEG, ...) or an "
        "npz (x_train, y_train, classes). The run's classes and input size come from the coordinator (started with "
        "--classes); bad data is an error here, before the device registers. Without it the device rebuilds its "
        "share of --dataset."),
    fleet_link: str = typer.Option(
        "off", help="With --fleet (trial --fleet sets it): off | delay (add the class's round-trip delay in the "
        "transport; rate and CPU are limited outside, by a namespace and a cgroup) | emulated (also sleep for the "
        "bytes over the class's link rates and for the compute a CPU at its speed would add). Either reports the "
        "round's timing in the update (docs/fleet.md)."),
    latency_profile: Optional[Path] = typer.Option(
        None, help="This device's measured latency: the JSON `fedsga-edge profile --json` wrote on this device for "
        "the run's model (every split). Its hello reports the seconds per sample at each split, and --strategy "
        "resource gives it the deepest split that fits by them instead of a fleet's or a drawn speed "
        "(docs/fleet.md). A missing or malformed file, or one of another model, is an error before it registers."),
    **flags: Any,
) -> None:
    """Run one device agent until the coordinator ends the run (or SIGTERM)."""
    if backend not in ("torch", "onnx"):
        raise typer.BadParameter(f"--backend must be torch or onnx (got {backend!r})")
    if backend == "onnx" and artifacts is None:
        raise typer.BadParameter("--backend onnx needs --artifacts DIR (made by `fedsga-edge export --train`)")
    if backend == "torch":
        set_threads(threads)  # the onnx backend passes them to onnxruntime and never imports torch
    cfg = _config(config, flags, ctx)
    from fedsga_edge.data.local import LocalDataError
    from fedsga_edge.runbuild import client_id, default_run_id, device_agent

    if fleet_link not in ("off", "delay", "emulated"):
        raise typer.BadParameter(f"--fleet-link must be off, delay or emulated (got {fleet_link!r})")
    latency_report = None
    if latency_profile is not None:  # the file and its model before the broker (its splits: once the model is built)
        from fedsga_edge.latency import ProfileError, check_model, read_profile

        try:
            latency_report = read_profile(latency_profile)
            check_model(latency_report, cfg.model, width=cfg.width, where=f"--latency-profile {latency_profile}")
        except ProfileError as exc:
            raise typer.BadParameter(str(exc)) from None
    transport = _transport(broker, default_run_id(cfg), client_id(index), max_packet, request_timeout)
    link = None
    if fleet_link != "off" and cfg.fleet:
        transport = link = _fleet_link(cfg, index, transport, emulate=fleet_link == "emulated")
    try:
        try:
            agent = device_agent(cfg, index, transport, state_dir, backend=backend, artifacts=artifacts,
                                 threads=threads or None, data=data, latency_profile=latency_profile,
                                 latency_report=latency_report)
            if link is not None:
                from fedsga_edge.transport.link import TimingPeer

                agent.client.peer = TimingPeer(agent.client.peer, link)
        except TimeoutError as exc:  # --data: the coordinator never described the run
            typer.secho(f"error: {client_id(index)} is not registered: {exc}", fg="red", err=True)
            raise typer.Exit(1) from None
        except LocalDataError as exc:  # --data: its own data cannot be used; nothing was registered
            typer.secho(f"error: {client_id(index)} did not register: its data: {exc}", fg="red", err=True)
            raise typer.Exit(2) from None
        stopping = False

        def on_term(*_: Any) -> None:
            nonlocal stopping
            stopping = True

        signal.signal(signal.SIGTERM, on_term)
        from fedsga_edge.device.agent import RegistrationRefused
        from fedsga_edge.device.systemd import Systemd

        sd = Systemd()  # under systemd (Type=notify, WatchdogSec=): READY once registered, then heartbeats
        try:
            agent.start()
        except (RegistrationRefused, TimeoutError) as exc:  # refused by, or never reached, the coordinator
            agent.stop()
            typer.secho(f"error: {client_id(index)} is not registered: {exc}", fg="red", err=True)
            raise typer.Exit(1) from None
        sd.ready(f"registered as {agent.cid}")
        while not stopping and not agent.finished.is_set():
            sd.watchdog(agent.health()["alive"])  # a dead worker thread stops the heartbeat: systemd restarts us
            time.sleep(0.2)
        sd.stopping()
        if stopping:
            agent.leave("stopped by SIGTERM")
        else:
            agent.stop()
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    finally:
        transport.close()


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
        raise typer.BadParameter(str(exc)) from None
    return FleetLink(transport, rtt_ms=cls.rtt_ms, up_mbps=cls.uplink_mbps, down_mbps=cls.downlink_mbps, speed=speed,
                     emulate=emulate)


@with_run_options
def trial(
    out: Path = typer.Option(Path("runs/trial"), help="Run folder: simulate's files, one log per process, device state."),
    broker: Optional[str] = typer.Option(
        None, help="mqtt://HOST:PORT of a running broker (e.g. Mosquitto), or 'mosquitto' to start one here "
                   "(broker-config's ACL); default ('embedded'): start the broker pip installs (iotcore) on a free "
                   "127.0.0.1 port. A broker started here takes only the run's logins."),
    startup_timeout: float = typer.Option(300.0, help="Seconds the coordinator waits for every device to register."),
    threads: int = typer.Option(1, help="torch threads per process (processes share the cores)."),
    backend: str = typer.Option("torch", help="The devices' backend: torch | onnx (onnxruntime + numpy, no torch)."),
    artifacts: Optional[Path] = typer.Option(
        None, help="--backend onnx: `export --train` artifacts of the run's model; default: export them into OUT/artifacts."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
    device_data: Optional[Path] = typer.Option(
        None, help="Devices with their own data: DIR/client-NNN (a folder or .npz) for each device, as `fedsga-edge "
        "partition` writes them. Each device process is started with its own folder only (device --data) and the "
        "coordinator with no training data (--classes: DIR/dataset.json unless given)."),
    classes: Optional[Path] = typer.Option(None, help="--device-data: the run's classes (see coordinator --classes)."),
    test_data: Optional[Path] = typer.Option(None, help="--device-data: the coordinator's own test set (optional)."),
    device_profiles: Optional[Path] = typer.Option(
        None, help="Devices' measured latencies: DIR/client-NNN.json (`fedsga-edge profile --json`) is passed to "
        "device NNN as its --latency-profile, which its hello reports (--strategy resource: its split); a device "
        "without a file reports none."),
    fleet_mode: str = typer.Option(
        "auto", help="With --fleet: cgroup+netns (each device under its class's CPU quota and in its own network "
        "namespace with rate-limited links: needs root, cgroup v1 cpu, ip and tc, and the embedded broker), emulated "
        "(the devices sleep for their slower CPU and links instead), or auto (the first where the machine can). "
        "Either adds the class's round-trip delay in the device's transport (docs/fleet.md)."),
    **flags: Any,
) -> None:
    """A field trial on this machine: a broker, the coordinator and N device agents as separate processes."""
    cfg = _with_deadline(run_config(**_run_flags_of(flags)))
    fleet = None
    if cfg.fleet:
        from fedsga_edge.fleet import FleetError, load_fleet
        from fedsga_edge.fleetlimits import class_speed

        cfg.fleet = str(Path(cfg.fleet).resolve())  # the processes read it too
        try:
            fleet = load_fleet(cfg.fleet)
            fleet.assign([f"client-{i:03d}" for i in range(cfg.clients)])
            for cls in fleet.classes:
                class_speed(fleet, cls)
        except FleetError as exc:
            raise typer.BadParameter(str(exc)) from None
        fleet_mode = _fleet_mode(fleet_mode, broker, backend)
        threads = 1  # a CPU quota of one core: each device's torch on one thread
    elif fleet_mode != "auto":
        raise typer.BadParameter("--fleet-mode goes with --fleet")
    device_paths: list[Path] = []
    coordinator_args: list[str] = []
    if device_data is not None:
        classes = classes or device_data / "dataset.json"
        if not classes.exists():
            raise typer.BadParameter(f"--device-data {device_data} has no dataset.json: give --classes")
        device_paths = [p.resolve() for p in _device_folders(device_data, cfg.clients)]
        coordinator_args = ["--classes", str(classes.resolve())]
        if test_data is not None:
            coordinator_args += ["--test-data", str(test_data.resolve())]
    elif classes is not None or test_data is not None:
        raise typer.BadParameter("--classes and --test-data go with --device-data")
    profiles = _device_profiles(device_profiles, cfg.clients) if device_profiles is not None else {}
    from fedsga_edge.simulation import validate_config

    try:
        validate_config(cfg)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    cfg_path = out / "run_config.json"
    cfg_path.write_text(json.dumps(cfg.to_dict(), indent=2))
    from fedsga_edge.broker.launch import die_with_parent

    device_args: list[str] = []
    if backend not in ("torch", "onnx"):
        raise typer.BadParameter(f"--backend must be torch or onnx (got {backend!r})")
    if backend == "onnx":
        artifacts = artifacts or _export_for_devices(cfg, out, quiet, classes if device_data is not None else None)
        device_args = ["--backend", "onnx", "--artifacts", str(artifacts)]
    from fedsga_edge.runbuild import client_id, default_run_id

    sandbox = None
    if fleet is not None and fleet_mode == "cgroup+netns":
        from fedsga_edge.fleetlimits import FleetSandbox

        try:
            sandbox = FleetSandbox(fleet, [client_id(i) for i in range(cfg.clients)]).open()
        except OSError as exc:
            typer.secho(f"error: cannot build the fleet's namespaces and cgroups: {exc} (--fleet-mode emulated "
                        "needs neither)", fg="red", err=True)
            raise typer.Exit(2) from None
    if fleet is not None:
        device_args += ["--fleet-link", "delay" if sandbox is not None else "emulated"]
        typer.echo(f"fleet: {fleet_mode}" + (f" (devices in namespaces {sandbox.prefix}d*, broker on {sandbox.host})"
                                             if sandbox is not None else ""), err=True)
    try:
        local = _start_broker(broker, out / "logs", [client_id(i) for i in range(cfg.clients)], default_run_id(cfg),
                              host=sandbox.host if sandbox is not None else "127.0.0.1")
    except BaseException:
        if sandbox is not None:
            sandbox.close()
        raise

    def login_env(login: str) -> dict[str, str]:
        """The broker URL (with this process's password) in the environment, not on a command line."""
        return {**os.environ, BROKER_ENV: local.url_for(login) if local is not None else str(broker)}

    base = [sys.executable, "-m", "fedsga_edge.cli.main"]
    signal.signal(signal.SIGTERM, _raise_interrupt)  # run the cleanup below when the trial is stopped
    common = ["--config", str(cfg_path), "--threads", str(threads)]

    def device_start(i: int) -> tuple[list[str], Callable[[], None]]:
        argv = (base + ["device", "--index", str(i), "--state-dir", str(out / "devices" / f"client-{i:03d}")] + common
                + device_args + (["--data", str(device_paths[i])] if device_paths else [])
                + (["--latency-profile", str(profiles[i])] if i in profiles else []))
        if sandbox is None:
            return argv, die_with_parent
        enter = sandbox.join(client_id(i))

        def prepare() -> None:
            die_with_parent()
            enter()
        return sandbox.command(i, argv), prepare
    procs: dict[str, subprocess.Popen] = {}
    logs = []
    try:
        log = open(out / "logs" / "coordinator.out", "w")
        logs.append(log)
        procs["coordinator"] = subprocess.Popen(
            base + ["coordinator", "--run-dir", str(out), "--register-timeout", str(startup_timeout)] + common
            + coordinator_args,
            stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent, env=login_env("coordinator"))
        for i in range(cfg.clients):
            log = open(out / "logs" / f"device-{i:03d}.out", "w")
            logs.append(log)
            argv, prepare = device_start(i)
            procs[f"device-{i:03d}"] = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, preexec_fn=prepare, env=login_env(client_id(i)))
        _follow(out / "metrics.jsonl", procs["coordinator"], cfg.rounds, quiet,
                classes=_fleet_classes(fleet, [client_id(i) for i in range(cfg.clients)]))
        rc = procs["coordinator"].wait()
        quotas = {c.name: sandbox.quota(next(d for d, k in sandbox.classes.items() if k is c))
                  for c in fleet.classes} if sandbox is not None else None
    finally:
        try:
            _stop_all(procs, logs, local)
        finally:
            if sandbox is not None:
                sandbox.close()
    if rc != 0:
        typer.secho(f"error: the coordinator exited with {rc}; see {out / 'logs' / 'coordinator.out'}", fg="red", err=True)
        raise typer.Exit(1)
    summary = json.loads((out / "summary.json").read_text())
    if fleet is not None:
        _fleet_report(out, summary, fleet, fleet_mode, quotas)
    from fedsga_edge.runfiles import fed_text

    fed = fed_text(summary)
    flt = f" fleet={summary['fleet_s']:.1f}s" if "fleet_s" in summary else ""
    typer.echo(f"final_acc={summary.get('final_acc')}{fed} rounds={summary.get('rounds')} "
               f"failures={summary.get('failures')}{flt} -> {out}")


def _fleet_mode(asked: str, broker: Optional[str], backend: str) -> str:
    """``--fleet-mode``: the one asked for, or (auto) real limits where this machine can, else emulated."""
    from fedsga_edge.fleetlimits import MODES, real_limits_problem

    if asked not in ("auto", *MODES):
        raise typer.BadParameter(f"--fleet-mode must be auto, {' or '.join(MODES)} (got {asked!r})")
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
        raise typer.BadParameter(f"--fleet-mode cgroup+netns cannot run here: {problem}")
    typer.echo(f"fleet: real limits unavailable ({problem}): emulated instead", err=True)
    return "emulated"


def _fleet_report(out: Path, summary: dict[str, Any], fleet: Any, mode: str, quotas: Optional[dict[str, float]]) -> None:
    """Per class: measured compute per step against the CPU share, wire seconds against the link model;
    printed, and in summary.json (``fleet_mode``, ``fleet_classes``)."""
    from fedsga_edge.fleetlimits import class_speed, class_table, format_class_table
    from fedsga_edge.runfiles import atomic_write

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    shares = quotas if quotas is not None else {c.name: class_speed(fleet, c) for c in fleet.classes}
    rows = class_table(records, fleet, shares)
    typer.echo(format_class_table(rows, mode))
    summary["fleet_mode"], summary["fleet_classes"] = mode, rows
    atomic_write(out / "summary.json", json.dumps(summary, indent=2))


def _run_data(classes: Path, cfg: Any) -> Any:
    from fedsga_edge.data.local import LocalDataError, read_run_data

    try:
        return read_run_data(classes, cfg.img_size)
    except LocalDataError as exc:
        raise typer.BadParameter(str(exc)) from None


def _device_folders(device_data: Path, clients: int) -> list[Path]:
    """``DIR/client-NNN`` (a folder, or ``client-NNN.npz``) for each device, as ``partition`` writes them."""
    if not device_data.is_dir():
        raise typer.BadParameter(f"--device-data {device_data} is not a folder (one sub-folder per device)")
    out = []
    for i in range(clients):
        folder, npz = device_data / f"client-{i:03d}", device_data / f"client-{i:03d}.npz"
        if not folder.exists() and not npz.exists():
            raise typer.BadParameter(f"--device-data {device_data} has no client-{i:03d}/ (or client-{i:03d}.npz) for "
                                     f"device {i} of --clients {clients}; `fedsga-edge partition` writes one per "
                                     "device")
        out.append(folder if folder.exists() else npz)
    return out


def _device_profiles(folder: Path, clients: int) -> dict[int, Path]:
    """``DIR/client-NNN.json`` of the devices that have one, by index; none at all is an error (a wrong folder)."""
    if not folder.is_dir():
        raise typer.BadParameter(f"--device-profiles {folder} is not a folder")
    found = {i: (folder / f"client-{i:03d}.json").resolve() for i in range(clients)
             if (folder / f"client-{i:03d}.json").is_file()}
    if not found:
        raise typer.BadParameter(f"--device-profiles {folder} has no client-NNN.json for any of the --clients {clients} "
                                 "devices")
    return found


def _stop_all(procs: dict[str, subprocess.Popen], logs: list[Any], local: Any) -> None:
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


def _export_for_devices(cfg: Any, out: Path, quiet: bool, classes: Optional[Path] = None) -> Path:
    """``fedsga-edge export --train`` of the run's model for torch-free devices (weights come each round);
    ``classes``: the run's data description (--device-data) instead of the dataset."""
    if cfg.model_args:
        raise typer.BadParameter("--backend onnx: the export takes no --model-arg; export the artifacts yourself "
                                 "and pass --artifacts")
    if classes is not None:
        run = _run_data(classes, cfg)
        num_classes, img_size = len(run.classes), cfg.img_size or run.image_size
    else:
        from fedsga_edge.data import load_dataset

        bundle = load_dataset(cfg.dataset, cfg.data_root, image_size=cfg.img_size)
        num_classes, img_size = bundle.num_classes, cfg.img_size
    dest = out / "artifacts"
    cmd = [sys.executable, "-m", "fedsga_edge.cli.main", "export", "--model", cfg.model, "--train",
           "--num-classes", str(num_classes), "--prompts", str(cfg.fedsga.prompts), "--out", str(dest)]
    if cfg.width is not None:
        cmd += ["--width", str(cfg.width)]
    if img_size:
        cmd += ["--img-size", str(img_size)]
    if not quiet:
        typer.echo(f"exporting the devices' train graphs -> {dest} (log: {out / 'logs' / 'export.out'})")
    with open(out / "logs" / "export.out", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        typer.secho(f"error: the export failed; see {out / 'logs' / 'export.out'}", fg="red", err=True)
        raise typer.Exit(1)
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


def _follow(metrics: Path, coordinator: Any, rounds: int, quiet: bool, every: float = 10.0,
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


BROKER_ENV = "FEDSGA_EDGE_BROKER"  # what `coordinator` and `device` read when --broker is not given


def _start_broker(broker: Optional[str], log_dir: Path, devices: list[str], run: str, host: str = "127.0.0.1") -> Any:
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
        typer.secho(f"error: {exc}{hint}", fg="red", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"broker: {local.kind} at {local.url}, {len(devices) + 1} per-run logins (log: {local.log})", err=True)
    return local


def register(app: typer.Typer) -> None:
    """The run options are rebuilt here from the registry as it is now (a strategy registered since shows up)."""
    app.command("coordinator")(_layered(with_run_options(coordinator)))
    app.command("device")(_layered(with_run_options(device)))
    app.command("trial")(with_run_options(trial))
