"""Root of the ``fedsga-edge`` command: it only registers commands (heavy imports stay inside them)."""

from __future__ import annotations

import typer

from . import broker_cmd, export_cmd, field_cmd, fleet_cmd, partition_cmd, plot_cmd, profile_cmd, report_cmd, simulate

app = typer.Typer(
    name="fedsga-edge",
    help="Adaptive split federated learning (FedSGA) on edge devices.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

simulate.register(app)

for _command in (export_cmd, profile_cmd, plot_cmd, report_cmd, field_cmd, fleet_cmd, broker_cmd, partition_cmd):
    _command.register(app)


@app.command()
def version() -> None:
    """Print the installed version."""
    from fedsga_edge import __version__

    typer.echo(__version__)


if __name__ == "__main__":  # pragma: no cover
    app()
