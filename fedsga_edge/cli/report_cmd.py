"""``fedsga-edge report``: one self-contained HTML page (and a PNG per plot) from runs, benchmarks and profiles."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    app.command("report", no_args_is_help=True)(report)


def report(
    runs: list[Path] = typer.Argument(..., help="Run folders, or folders of runs (e.g. a benchmark's --out)."),
    profile: Optional[list[Path]] = typer.Option(
        None, "--profile", help="`fedsga-edge profile --json` report (repeatable)."),
    out: Path = typer.Option(..., help="Folder for report.html and the PNGs."),
    band: str = typer.Option("minmax", help="Spread over seeds in the accuracy plot: minmax | std."),
    target_acc: Optional[float] = typer.Option(
        None, "--target-acc", help="Time to accuracy's target, 0-1 (default: the lowest final accuracy compared)."),
) -> None:
    """Accuracy, split depths, estimator calibration, cost trade-off, bytes and device latency in one page."""
    from fedsga_edge.report import RunError, build_report

    if band not in ("minmax", "std"):
        raise typer.BadParameter("--band takes minmax or std")
    if target_acc is not None and not 0.0 < target_acc <= 1.0:
        raise typer.BadParameter("--target-acc takes an accuracy in (0, 1]")
    command = "fedsga-edge " + " ".join(shlex.quote(a) for a in sys.argv[1:]) if sys.argv[1:2] == ["report"] else None
    try:
        rep = build_report(runs, profile or [], out, band=band, command=command, target_acc=target_acc)
    except RunError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    for s in rep.sections:
        typer.echo(f"  {s.key:<20} {s.png.name if s.png else 'skipped: ' + _plain(s.note or '')}")
    for e in rep.errors:
        typer.secho(f"  plot failed: {e}", fg="yellow", err=True)
    typer.echo(f"wrote {rep.html} ({len(rep.runs)} runs, {len(rep.pngs)} plots)")


def _plain(text: str) -> str:
    import re

    return re.sub(r"<[^>]+>", "", text)
