"""``fedsga-edge plot``: the report's accuracy plot and split-depth heatmaps as one PNG (an alias).

The figures are drawn by ``fedsga_edge.report`` (the same functions ``fedsga-edge report`` uses).
"""

from __future__ import annotations

from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    app.command("plot")(plot)


def plot(
    runs: list[Path] = typer.Argument(
        ..., help="Run folders written by `fedsga-edge simulate --out` (or folders of runs)."),
    out: Path = typer.Option(Path("runs/plot.png"), help="PNG to write."),
    group: bool = typer.Option(
        False, "--group/--no-group", help="Average runs of one method and partition over seeds."),
) -> None:
    """Accuracy curves of every run, and the split index each run's clients used per round."""
    from fedsga_edge.report import RunError, plot_runs

    try:
        path = plot_runs(runs, out, group=group)
    except RunError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"wrote {path}")
