"""``fedsga-edge calibrate-fleet``: a fleet file's host figures measured on this host (thin; the arithmetic is
``fedsga_edge.fleetcalib``, the method docs/fleet.md, "Calibrating a fleet file to its host")."""

from __future__ import annotations

import dataclasses
import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

import typer

__all__ = ["register", "calibrate_fleet"]


def register(app: typer.Typer) -> None:
    app.command("calibrate-fleet", no_args_is_help=True)(calibrate_fleet)


def calibrate_fleet(
    trial: Path = typer.Argument(..., help="A `trial --fleet` run folder (mode cgroup+netns, at least 2 rounds)."),
    out: Path = typer.Option(..., help="The calibrated fleet file to write (TOML)."),
    fleet: Optional[Path] = typer.Option(None, help="The fleet file the trial ran with (default: the one its "
                                         "run_config.json names)."),
) -> None:
    """Measure the fleet file's host gflops and each class's warmup_s on this host from a real trial: simulate
    the trial's own run (same config, seed and fleet) on the virtual clock for each device-round's FLOPs, divide by the CPU
    seconds the trial's devices got, and write the fleet file with those figures. Check `simulate --fleet`
    against another trial (another seed) with the new file, not this one."""
    from fedsga_edge.config import RunConfig
    from fedsga_edge.fleet import FleetError, read_fleet
    from fedsga_edge.fleetcalib import calibrate, calibrated_toml
    from fedsga_edge.report.runs import load_metrics
    from fedsga_edge.simulation import run_simulation

    cfg_path, summary_path = trial / "run_config.json", trial / "summary.json"
    if not cfg_path.is_file() or not (trial / "metrics.jsonl").is_file():
        raise typer.BadParameter(f"{trial} has no run_config.json and metrics.jsonl: not a `trial` run folder")
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    if summary.get("fleet_mode") != "cgroup+netns":
        raise typer.BadParameter(f"{trial} ran in fleet mode {summary.get('fleet_mode')!r}: only a trial under real "
                                 "limits (cgroup+netns) measures the host; an emulated one replays the file's figures")
    try:
        cfg = RunConfig.from_record(json.loads(cfg_path.read_text()))
    except (ValueError, TypeError) as exc:
        raise typer.BadParameter(f"{cfg_path}: {exc}") from None
    fleet_path = fleet or (Path(cfg.fleet) if cfg.fleet else None)
    if fleet_path is None:
        raise typer.BadParameter(f"{trial} ran without --fleet; give the fleet file with --fleet")
    try:
        fl, raw = read_fleet(fleet_path)
    except (FleetError, OSError) as exc:
        raise typer.BadParameter(str(exc)) from None
    sim_dir = trial / "calibration-sim"
    typer.echo(f"simulating the trial's run on the virtual clock -> {sim_dir}")
    run_simulation(dataclasses.replace(cfg, fleet=str(fleet_path)), out=sim_dir)
    try:
        cal = calibrate(fl, load_metrics(trial), load_metrics(sim_dir))
    except FleetError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(1) from None
    note = (f"{fleet_path.name} calibrated to this host by `fedsga-edge calibrate-fleet {trial}`\n"
            f"({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC; docs/fleet.md, \"Calibrating a fleet file to its host\"):\n"
            f"[host] gflops from {cal.device_rounds} device-rounds' FLOPs over their CPU seconds; warmup_s per class "
            "from its devices' first rounds.")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(calibrated_toml(raw, cal, note, fleet_path.parent.resolve()), encoding="utf-8")
    before = {c.name: c.warmup_s for c in fl.classes}
    typer.echo(f"[host] gflops: {fl.host_gflops if fl.host_gflops is not None else '-'} -> {cal.host_gflops:.3f} "
               f"({cal.device_rounds} device-rounds)")
    for name, w in cal.warmup_s.items():
        typer.echo(f"[classes.{name}] warmup_s: {before.get(name, 0.0):g} -> {w:.3f} ({cal.first_rounds[name]} devices)")
    typer.echo(f"wrote {out}")
