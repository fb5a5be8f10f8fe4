"""``fedsga-edge profile``: latency, memory and cost per split depth on this device (thin).

The onnxruntime path imports no torch: nothing heavy is imported at module level here, and the
profiler itself is torch-free unless ``--runtime torch`` is asked for.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer


def register(app: typer.Typer) -> None:
    app.command(name="profile", no_args_is_help=True)(profile)


def _ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise typer.BadParameter(f"{what} takes comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise typer.BadParameter(f"{what} needs positive integers, got {text!r}")
    return values


def _si(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g}{unit}"
    return f"{n:.0f}"


def profile_table(report: dict[str, Any]):
    from rich import box
    from rich.table import Table

    d = report["device"]
    ep = d.get("execution_provider", "")
    title = f"{report['model']['arch']} on {d['cpu']} ({d['cores_logical']} cores), {ep}, threads {d['threads'] or 'default'}"
    table = Table(title=title, box=box.SIMPLE_HEAD, padding=(0, 1), collapse_padding=True)
    cols = (
        "k",
        "depth",
        "var",
        "batch",
        "p50 ms",
        "p90",
        "p99",
        "cv",
        "samples/s",
        "create ms",
        "RSS MB",
        "FLOPs",
        "z bytes fp32/fp16/int8",
        "train ms",
    )
    for col in cols:
        table.add_column(col, justify="right", no_wrap=True)
    for r in report["results"]:
        lat = r["latency_ms"]
        train = r.get("train_step_ms")
        table.add_row(
            str(r["split"]),
            str(r["depth"]),
            r["variant"],
            str(r["batch"]),
            f"{lat['p50']:.3g}",
            f"{lat['p90']:.3g}",
            f"{lat['p99']:.3g}",
            f"{lat['cv']:.2f}",
            f"{lat['throughput_sps']:.4g}",
            f"{1e3 * r['session_create_s']:.3g}",
            f"{r['rss_peak_mb']:.0f}",
            _si(r["flops_per_sample"]),
            "/".join(_si(r["activation_bytes_per_sample"][enc]) for enc in ("fp32", "fp16", "int8")),
            f"{train['p50']:.3g}" if train else "-",
        )
    return table


def profile(
    artifacts: Path = typer.Option(..., help="Folder written by `fedsga-edge export` (holds manifest.json)."),
    runtime: str = typer.Option("onnxruntime", help="onnxruntime (the exported files; no torch) | torch (eager)."),
    batch: str = typer.Option("1,32", help="Comma-separated batch sizes."),
    threads: Optional[int] = typer.Option(None, help="Intra-op threads (default: the runtime's choice)."),
    warmup: int = typer.Option(10, help="Untimed runs before timing."),
    iters: int = typer.Option(100, help="Timed runs per configuration (ignored with --duration)."),
    duration: Optional[float] = typer.Option(None, help="Time each configuration for this many seconds instead."),
    variant: str = typer.Option("fp32", help="Comma-separated: fp32, fp16, int8 (those the export wrote)."),
    splits: Optional[str] = typer.Option(None, help="Comma-separated split indices (default: all)."),
    train: bool = typer.Option(True, "--train/--no-train", help="Also time a train step where train graphs exist."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the full report as JSON here."),
) -> None:
    """Latency / throughput / memory of every exported prefix on this device."""
    from rich.console import Console

    from fedsga_edge.device.profile import profile_artifacts
    from fedsga_edge.device.runtime import ArtifactError

    console = Console(highlight=False)
    if not console.is_terminal:  # piped into a file: do not squeeze the table to 80 columns
        console = Console(highlight=False, width=160)
    try:
        report = profile_artifacts(
            artifacts,
            runtime=runtime,
            batches=_ints(batch, "--batch"),
            threads=threads,
            warmup=warmup,
            iters=iters,
            duration=duration,
            variants=tuple(v.strip() for v in variant.split(",") if v.strip()),
            splits=_ints(splits, "--splits") if splits else None,
            train=train,
        )
    except ArtifactError as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    console.print(profile_table(report))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2) + "\n")
        console.print(f"report: {json_out}", markup=False)
