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
    engine: str = typer.Option("inprocess", help="Where the devices compute: inprocess, or ray (actors on this "
                               "machine's CPUs or the cluster at --ray-address; needs the package's scale extra). "
                               "Same seed, same results (docs/scale.md)."),
    ray_address: str = typer.Option("", help="--engine ray: a running Ray cluster (e.g. 10.0.0.5:6379, or auto); "
                                    "empty starts a local Ray."),
    ray_actors: int = typer.Option(0, help="--engine ray: device actors (0: the cluster's CPUs, one each)."),
    world_size: int = typer.Option(1, help="Processes for the per-client server copies (torch.distributed, gloo; "
                                   "NCCL for the average on a GPU): each device's copy trains on one of them "
                                   "(docs/scale.md). Needs --server-copies per-client."),
    **flags: Any,
) -> None:
    """Simulate split federated learning in one process and write metrics for every round."""
    set_threads(threads)
    cfg = run_config(**flags)
    check_engine(cfg, engine, ray_address, ray_actors, world_size)
    from fedsga_edge.data import DatasetError
    from fedsga_edge.rayengine import EngineError, RayEngine
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

    devices = None
    if engine == "ray":
        try:
            devices = RayEngine(address=ray_address or None, actors=ray_actors)
        except ValueError as exc:
            raise typer.BadParameter(str(exc)) from None
    try:
        summary = run_simulation(cfg, out, on_round=on_round, engine=devices, world_size=world_size,
                                 threads=threads)
    except (DatasetError, FileNotFoundError) as exc:
        bar.close()
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    except ValueError as exc:
        bar.close()
        raise typer.BadParameter(str(exc)) from None
    except EngineError as exc:  # no Ray, or no cluster at --ray-address
        bar.close()
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    finally:
        if devices is not None:
            if devices.ready:
                typer.echo(f"ray engine: {len(devices.pool)} actors; Ray and the actors started in "
                           f"{devices.init_s:.1f}s, holding their devices at {devices.setup_s:.1f}s "
                           f"(the run waited {devices.waited_s:.1f}s of it)", err=True)
            devices.close()
    bar.close()
    from fedsga_edge.runfiles import fed_text

    acc = summary["final_acc"]
    fleet = f" fleet={summary['fleet_s']:.1f}s" if "fleet_s" in summary else ""  # --fleet: its virtual seconds
    typer.echo(
        f"final_acc={acc:.4f} best_acc={summary['best_acc']:.4f} "
        f"client_flops/sample={summary['client_flops_per_sample'] / 1e6:.1f}M "
        f"bytes={summary['bytes_total'] / 1e6:.1f}MB wall={summary['wall_s']:.1f}s{fleet}{fed_text(summary)} -> {out}"
    )


def check_engine(cfg: Any, engine: str, ray_address: str, ray_actors: int, world_size: int) -> None:
    """The engine flags against each other and the run: a clear error before anything starts."""
    if engine not in ("inprocess", "ray"):
        raise typer.BadParameter(f"--engine must be inprocess or ray (got {engine!r})")
    if engine != "ray" and (ray_address or ray_actors):
        raise typer.BadParameter("--ray-address and --ray-actors need --engine ray")
    if world_size < 1:
        raise typer.BadParameter(f"--world-size must be >= 1 (got {world_size})")
    if engine == "ray" and cfg.fleet:
        raise typer.BadParameter("--engine ray runs the in-process schedule: leave out --fleet")
    if engine == "ray" and cfg.wire_format == "auto":
        raise typer.BadParameter("--engine ray relays one wire format for the run: give --wire-format fp32, fp16, "
                                 "int8 or int4, not auto")


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
