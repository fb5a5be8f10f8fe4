"""Root of the ``fedsga-edge`` command: it only registers commands (heavy imports stay inside them)."""

from __future__ import annotations

import typer

from . import simulate

app = typer.Typer(
    name="fedsga-edge",
    help="Adaptive split federated learning (FedSGA) on edge devices.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

simulate.register(app)

for _name in ("export_cmd", "profile_cmd", "plot_cmd", "report_cmd", "field_cmd", "broker_cmd"):  # when present
    try:
        _mod = __import__(f"{__package__}.{_name}", fromlist=["register"])
    except ModuleNotFoundError as _exc:  # pragma: no cover - only while a command is absent
        if _exc.name != f"{__package__}.{_name}":
            raise
    else:
        _mod.register(app)


@app.command()
def version() -> None:
    """Print the installed version."""
    from fedsga_edge import __version__

    typer.echo(__version__)


if __name__ == "__main__":  # pragma: no cover
    app()
