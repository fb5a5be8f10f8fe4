"""``fedsga-edge simulate``: the coordinator and N devices in one process over the loopback transport.

Its run options come from their declarations (``fedsga_edge.config``, each strategy's ``options``)
through ``runflags``; only where the run goes and how it shows progress are declared here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from .runflags import run_config, run_flags, with_run_options

__all__ = ["register", "simulate", "run_config", "set_threads", "RUN_FLAGS"]


def register(app: typer.Typer) -> None:
    app.command(no_args_is_help=False)(with_run_options(simulate))  # the run options as the registry is now


@with_run_options
def simulate(
    out: Path = typer.Option(Path("runs/sim"), help="Run folder: config.json, metrics.jsonl, summary.json."),
    threads: int = typer.Option(0, help="torch intra-op threads (0 = torch's default). Use 1 when other jobs share the cores."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
    **flags: Any,
) -> None:
    """Simulate split federated learning in one process and write metrics for every round."""
    set_threads(threads)
    cfg = run_config(**flags)
    from fedsga_edge.data import DatasetError
    from fedsga_edge.simulation import run_simulation, validate_config

    try:
        validate_config(cfg)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    from tqdm import tqdm

    bar = tqdm(total=cfg.rounds, desc=f"{cfg.strategy} {cfg.model}", unit="round", disable=quiet)

    def on_round(rec: dict) -> None:
        post = {"loss": f"{rec['train_loss']:.3f}"}
        if "test_acc" in rec:
            post["acc"] = f"{rec['test_acc']:.4f}"
        post["splits"] = ",".join(str(k) for k in sorted(set(rec["splits"].values())))
        bar.set_postfix(post)
        bar.update(1)

    try:
        summary = run_simulation(cfg, out, on_round=on_round)
    except (DatasetError, FileNotFoundError) as exc:
        bar.close()
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    except ValueError as exc:
        bar.close()
        raise typer.BadParameter(str(exc)) from None
    bar.close()
    from fedsga_edge.runfiles import fed_text

    acc = summary["final_acc"]
    fleet = f" fleet={summary['fleet_s']:.1f}s" if "fleet_s" in summary else ""  # --fleet: its virtual seconds
    typer.echo(
        f"final_acc={acc:.4f} best_acc={summary['best_acc']:.4f} "
        f"client_flops/sample={summary['client_flops_per_sample'] / 1e6:.1f}M "
        f"bytes={summary['bytes_total'] / 1e6:.1f}MB wall={summary['wall_s']:.1f}s{fleet}{fed_text(summary)} -> {out}"
    )


def set_threads(threads: int) -> None:
    if threads < 0:
        raise typer.BadParameter("--threads must be >= 0")
    if threads:
        import torch

        torch.set_num_threads(threads)


def __getattr__(name: str) -> Any:
    """``RUN_FLAGS``: the run options' parameter names, as the registry is now (PEP 562)."""
    if name == "RUN_FLAGS":
        return run_flags()
    raise AttributeError(name)
