"""``fedsga-edge coordinator | device | trial``: the roles as long-lived processes over MQTT.

The commands only declare their options and turn them into a RunConfig (simulate's flags, or
``--config`` with a saved one); the work is the wiring's: ``fedsga_edge.fieldroles`` runs the
coordinator service or a device agent over MQTT, ``fedsga_edge.trial`` the whole field trial, and
``fedsga_edge.fieldconfig`` gives every option its environment variable and TOML key.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional, TypeVar

import typer

from fedsga_edge.fieldconfig import explicit, layered

from .runflags import run_config, run_flags, with_run_options
from .simulate import set_threads

__all__ = ["register"]

T = TypeVar("T")


def _config(config: Optional[Path], flags: dict[str, Any], ctx: typer.Context | None = None) -> Any:
    """``--config`` (a RunConfig JSON, as trial writes it) or the run flags, never both: a run flag
    set anywhere (flag, environment, config file) next to ``--config`` is an error, not ignored."""
    from fedsga_edge.config import RunConfig

    if config is not None:
        given = explicit(ctx, run_flags())
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


def _field(work: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run a field command's work; its ``FieldError`` becomes a usage error or one red line and an exit status."""
    from fedsga_edge.fieldroles import FieldError

    try:
        return work(*args, **kwargs)
    except FieldError as exc:
        if exc.usage:
            raise typer.BadParameter(str(exc)) from None
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(exc.code) from None


def _last_line(summary: dict[str, Any], where: Path) -> str:
    """The command's closing line: final accuracy, rounds, failures (and the fleet's seconds) and the run folder."""
    from fedsga_edge.runfiles import fed_text

    flt = f" fleet={summary['fleet_s']:.1f}s" if "fleet_s" in summary else ""
    return (f"final_acc={summary.get('final_acc')}{fed_text(summary)} rounds={summary.get('rounds')} "
            f"failures={summary.get('failures')}{flt} -> {where}")


@layered
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
    keys: Optional[Path] = typer.Option(
        None, help="The devices' keys from enrolment (broker-config --keys: a folder of <device>.key): every message "
        "is then authenticated end to end, and a device without its key is refused (docs/protocol.md, Security)."),
    encrypt: bool = typer.Option(False, "--encrypt", help="With --keys: encrypt every payload (AES-GCM) and refuse "
                                 "clear ones, so a broker login that reads every topic learns nothing."),
    **flags: Any,
) -> None:
    """Serve the server side of a run: wait for devices, run every round with a deadline, write the run files."""
    if run_dir is None and resume is None:
        raise typer.BadParameter("give --run-dir RUN (a new run) or --resume RUN (continue one)")
    if run_dir is not None and resume is not None and run_dir.resolve() != resume.resolve():
        raise typer.BadParameter(f"--run-dir {run_dir} and --resume {resume} name different folders")
    run_dir = resume if run_dir is None else run_dir
    set_threads(threads)
    if resume is not None and config is None and not explicit(ctx, run_flags()):
        cfg = _saved_config(resume)
    else:
        cfg = _config(config, flags, ctx)
    from fedsga_edge.fieldroles import run_coordinator, with_deadline

    summary = _field(run_coordinator, with_deadline(cfg), broker, run_dir, resume=resume is not None,
                     min_devices=min_devices, register_timeout=register_timeout, max_packet=max_packet,
                     classes=classes, test_data=test_data, keys=keys, encrypt=encrypt)
    typer.echo(_last_line(summary, run_dir))


@layered
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
    key: Optional[Path] = typer.Option(
        None, help="This device's key from enrolment (broker-config --keys: <device>.key, mode 0600): every "
        "message is then authenticated end to end, and orders not sealed by the coordinator are refused."),
    encrypt: bool = typer.Option(False, "--encrypt", help="With --key: encrypt every payload (AES-GCM), as the "
                                 "coordinator's --encrypt."),
    memory_mb: Optional[float] = typer.Option(
        None, help="This device's memory budget (MB), checked against the peak memory --latency-profile measured "
        "per split (needs it): an error when no split fits; its hello reports both, and --strategy planner never "
        "gives it a split that does not fit (docs/fleet.md)."),
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
    from fedsga_edge.fieldroles import run_device

    _field(run_device, cfg, index, broker, state_dir, backend=backend, artifacts=artifacts, max_packet=max_packet,
           threads=threads, request_timeout=request_timeout, data=data, fleet_link=fleet_link,
           latency_profile=latency_profile, key=key, encrypt=encrypt, memory_mb=memory_mb)


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
    encrypt: bool = typer.Option(True, "--encrypt/--no-encrypt", help="Encrypt every payload (AES-GCM) besides "
                                 "authenticating it (the trial always gives each device a key): the embedded broker "
                                 "has no ACL, so without it a device's login reads the others' tensors "
                                 "(docs/protocol.md, Security)."),
    **flags: Any,
) -> None:
    """A field trial on this machine: a broker, the coordinator and N device agents as separate processes."""
    from fedsga_edge.fieldroles import with_deadline
    from fedsga_edge.trial import TrialSettings, run_trial

    cfg = with_deadline(run_config(**_run_flags_of(flags)))
    settings = TrialSettings(out, broker=broker, startup_timeout=startup_timeout, threads=threads, backend=backend,
                             artifacts=artifacts, quiet=quiet, device_data=device_data, classes=classes,
                             test_data=test_data, device_profiles=device_profiles, fleet_mode=fleet_mode,
                             encrypt=encrypt)
    summary = _field(run_trial, cfg, settings)
    typer.echo(_last_line(summary, out))


def register(app: typer.Typer) -> None:
    """The run options are rebuilt here from the registry as it is now (a strategy registered since shows up)."""
    app.command("coordinator")(layered(with_run_options(coordinator)))
    app.command("device")(layered(with_run_options(device)))
    app.command("trial")(with_run_options(trial))
