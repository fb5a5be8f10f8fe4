"""``fedsga-edge export``: validated ONNX prefixes + manifest (thin: parse, call, format)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from fedsga_edge.models.catalog import models_help


def register(app: typer.Typer) -> None:
    app.command(name="export", no_args_is_help=True)(export)


def _splits(text: Optional[str]) -> Optional[tuple[int, ...]]:
    if not text:
        return None
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise typer.BadParameter(f"--splits takes comma-separated split indices, got {text!r}") from None


def export(
    model: str = typer.Option(..., help=models_help()),
    out: Path = typer.Option(..., help="Output folder: prefix_kK.onnx files and manifest.json."),
    width: Optional[float] = typer.Option(None, help="ResNet width multiplier (model default 1.0)."),
    img_size: Optional[int] = typer.Option(None, help="Input size (model default)."),
    num_classes: Optional[int] = typer.Option(None, help="Head size (default: the checkpoint's, else the model's)."),
    checkpoint: Optional[Path] = typer.Option(None, help="Local weights: a state dict or {'model': state}."),
    opset: int = typer.Option(18, help="ONNX opset: 17 or 18."),
    prompts: int = typer.Option(4, help="Prompt tokens m, fixed in the graph's `prompts` input."),
    splits: Optional[str] = typer.Option(None, help="Comma-separated split indices k (default: every candidate)."),
    fp16: bool = typer.Option(False, "--fp16", help="Also write fp16 files (fp32 inputs and outputs)."),
    int8: bool = typer.Option(False, "--int8", help="Also write int8 static-quantized files (needs --calib-data)."),
    calib_data: Optional[str] = typer.Option(
        None, help="Dataset spec for calibration and the int8 accuracy check, e.g. digits, cifar10."
    ),
    data_root: Optional[Path] = typer.Option(
        None, help="Dataset root (default $FEDSGA_EDGE_DATA or ~/.cache/fedsga-edge/data)."
    ),
    calib_samples: int = typer.Option(256, help="Calibration images (training split)."),
    eval_samples: int = typer.Option(1000, help="Test images for the int8 deviation and accuracy check (0 = all)."),
    train: bool = typer.Option(
        False, "--train", help="Also write train graphs (forward + backward) for torch-free training."
    ),
    atol: float = typer.Option(1e-4, help="Max abs difference allowed between onnxruntime and torch."),
    seed: int = typer.Option(0, help="Seed for the random initialisation and the validation inputs."),
) -> None:
    """Export every candidate client prefix to a validated ONNX file, with a manifest."""
    from rich.console import Console

    from fedsga_edge.export.pipeline import ExportConfig, ExportError, export_prefixes
    from fedsga_edge.export.report import summary_table

    console = Console(highlight=False)
    if not console.is_terminal:  # piped into a file: do not squeeze the table to 80 columns
        console = Console(highlight=False, width=160)
    cfg = ExportConfig(
        model=model,
        out=out,
        width=width,
        img_size=img_size,
        num_classes=num_classes,
        checkpoint=checkpoint,
        opset=opset,
        prompts=prompts,
        splits=_splits(splits),
        fp16=fp16,
        int8=int8,
        calib_data=calib_data,
        data_root=data_root,
        calib_samples=calib_samples,
        eval_samples=eval_samples,
        train=train,
        atol=atol,
        seed=seed,
    )
    try:
        manifest = export_prefixes(cfg, log=lambda text: console.print(text, markup=False))
    except (ExportError, ValueError, FileNotFoundError) as exc:
        typer.secho(f"error: {exc}", fg="red", err=True)
        raise typer.Exit(2) from None
    console.print(summary_table(manifest))
    bad = [p["file"] for p in manifest["prefixes"] if not p["valid"]]
    console.print(f"manifest: {out / 'manifest.json'}", markup=False)
    if bad:
        typer.secho(f"validation failed for {', '.join(bad)}", fg="red", err=True)
        raise typer.Exit(1)
