"""``fedsga-edge simulate``: the coordinator and N devices in one process over the loopback transport."""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Optional

import typer

if TYPE_CHECKING:
    from fedsga_edge.config import RunConfig

STRATEGY_HELP = "static (SplitFed at --split) | fedavg | fedprox (--mu) | fedsga | random | resource"


def register(app: typer.Typer) -> None:
    app.command(no_args_is_help=False)(simulate)


def simulate(
    dataset: str = typer.Option("digits", help="digits | cifar10 | cifar100 | tinyimagenet | domainnet[:d1,d2] | npz:PATH"),
    data_root: Optional[Path] = typer.Option(None, help="Folder holding the dataset in its official layout."),
    partition: str = typer.Option("iid", help="iid | dirichlet | domain"),
    alpha: float = typer.Option(0.1, help="Dirichlet concentration (paper: 0.1)."),
    clients: int = typer.Option(20, help="Number of clients N (all participate every round)."),
    rounds: int = typer.Option(100, help="Communication rounds T (paper: 100 on CIFAR-10)."),
    local_epochs: int = typer.Option(5, help="Local epochs per round."),
    batch_size: int = typer.Option(64, help="Batch size."),
    lr: float = typer.Option(0.1, help="SGD learning rate (paper: 0.1 on CIFAR-10, 0.01 elsewhere)."),
    momentum: float = typer.Option(0.0, help="SGD momentum (not stated in the paper: 0)."),
    weight_decay: float = typer.Option(5e-4, help="SGD weight decay (not stated in the paper: 5e-4)."),
    model: str = typer.Option("resnet18_cifar", help="resnet18 | resnet18_cifar | vit_b16 | vit_tiny_c32"),
    width: Optional[float] = typer.Option(None, help="ResNet width multiplier (1.0 standard; 0.25 for CPU runs)."),
    model_arg: list[str] = typer.Option([], "--model-arg", help="Extra model option KEY=VALUE (repeatable), passed to the model factory."),
    img_size: Optional[int] = typer.Option(None, help="Input size (default: the dataset's)."),
    pretrained: Optional[Path] = typer.Option(None, help="Local weights file (torchvision / timm / fedsga-edge)."),
    strategy: str = typer.Option("static", help=STRATEGY_HELP),
    split: int = typer.Option(2, help="1-based split index for --strategy static (ResNet: 1=after layer1 .. 3=after layer3)."),
    mu: float = typer.Option(0.01, help="FedProx proximal weight (used by --strategy fedprox)."),
    seed: int = typer.Option(0, help="Seed for partitions, initialisation and batching."),
    device: str = typer.Option("auto", help="auto (CUDA when present) | cpu | cuda | cuda:N"),
    out: Path = typer.Option(Path("runs/sim"), help="Run folder: config.json, metrics.jsonl, summary.json."),
    train_subset: int = typer.Option(0, help="Use only this many training samples, stratified (0 = all)."),
    max_batches: int = typer.Option(0, help="Cap on batches per local epoch (0 = all)."),
    eval_every: int = typer.Option(1, help="Evaluate every this many rounds (and the last)."),
    augment: Optional[bool] = typer.Option(None, "--augment/--no-augment", help="Crop+flip (default: on except for digits)."),
    rho: float = typer.Option(0.1, help="FedSGA split-policy budget rho (Eq. 8)."),
    beta: float = typer.Option(0.05, help="FedSGA sufficiency margin beta (Eq. 7)."),
    lambda_align: float = typer.Option(0.1, help="Prototype alignment weight lambda (Eq. 10)."),
    tau_a: float = typer.Option(0.5, help="Prototype temperature tau_a (Eq. 9)."),
    tau_m: float = typer.Option(0.5, help="Prompt contribution temperature tau_m (Eq. 2)."),
    prompts: int = typer.Option(4, help="Prompt tokens per client m."),
    mu_proto: float = typer.Option(0.9, help="Prototype EMA coefficient mu."),
    cal_every: int = typer.Option(5, help="Calibrate the estimator every this many rounds (and round 1)."),
    no_adapt: bool = typer.Option(False, "--no-adapt", help="Ablation: no adaptation channel, o = [a, delta]."),
    no_estimator: bool = typer.Option(False, "--no-estimator", help="Ablation: every client at p_ref."),
    no_harmonizer: bool = typer.Option(False, "--no-harmonizer", help="Ablation: pooled features straight to the head."),
    speed_sigma: float = typer.Option(0.5, help="--strategy resource: log-normal spread of device speeds."),
    profile: Optional[Path] = typer.Option(None, help="--strategy resource: a measured `fedsga-edge profile --json`."),
    server_copies: str = typer.Option(
        "shared", help="shared: one server copy trained on the clients in turn (SplitFed-v2 style); "
        "per-client: each client trains its own copy, averaged every round (SplitFed-v1 style)."),
    server_bn: str = typer.Option(
        "ema", help="Server-side BatchNorm running statistics: ema (torch's momentum 0.1: the last ~10 batches "
        "dominate) | round (the average over the round's batches, every device weighed by its data)."),
    server_lr: Optional[float] = typer.Option(
        None, help="Learning rate of the server-side SGD (default: --lr). The shared copy takes every device's "
        "steps, so it moves ~N times as far per round as an averaged copy (docs/method.md, \"The server's learning rate\")."),
    server_bn_context: int = typer.Option(
        0, help="Shared server copy: normalise each device's batch in the server's BatchNorm layers together with "
        "the latest activations of up to N other devices at the same split (no loss on their rows). Under label "
        "skew a single device's batch is nearly one class (docs/method.md, \"Server-side BatchNorm statistics\")."),
    schedule: str = typer.Option("round-robin", help="How devices interleave: round-robin (one local step each in turn) | random (seeded) | sequential (one device after another)."),
    round_timeout: float = typer.Option(0.0, help="Seconds a round may last; devices still training then are left out of it (0 = no deadline)."),
    wire_format: str = typer.Option(
        "fp32", help="Tensor encoding of the per-batch activations and gradients on the wire: fp32 | fp16 (half the "
        "bytes) | int8 (a quarter, per-tensor scale). Weights always travel fp32 (docs/protocol.md, \"Messages\")."),
    threads: int = typer.Option(0, help="torch intra-op threads (0 = torch's default). Use 1 when other jobs share the cores."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
) -> None:
    """Simulate split federated learning in one process and write metrics for every round."""
    set_threads(threads)
    cfg = run_config(**{k: v for k, v in locals().items() if k in RUN_FLAGS})
    from fedsga_edge.data import DatasetError
    from fedsga_edge.simulation import run_simulation, validate_config

    try:
        validate_config(cfg)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None
    from tqdm import tqdm

    bar = tqdm(total=rounds, desc=f"{strategy} {model}", unit="round", disable=quiet)

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
    acc = summary["final_acc"]
    typer.echo(
        f"final_acc={acc:.4f} best_acc={summary['best_acc']:.4f} "
        f"client_flops/sample={summary['client_flops_per_sample'] / 1e6:.1f}M "
        f"bytes={summary['bytes_total'] / 1e6:.1f}MB wall={summary['wall_s']:.1f}s -> {out}"
    )


def set_threads(threads: int) -> None:
    if threads < 0:
        raise typer.BadParameter("--threads must be >= 0")
    if threads:
        import torch

        torch.set_num_threads(threads)


def run_config(**flags: Any) -> RunConfig:
    """The RunConfig that simulate's flags describe (the field commands take the same flags)."""
    from fedsga_edge.config import FedSGAConfig, RunConfig, TrainConfig

    f = SimpleNamespace(**flags)
    return RunConfig(
        dataset=f.dataset, data_root=str(f.data_root) if f.data_root else None, partition=f.partition,
        alpha=f.alpha, clients=f.clients, rounds=f.rounds, model=f.model, width=f.width, img_size=f.img_size,
        pretrained=str(f.pretrained) if f.pretrained else None, strategy=f.strategy, split=f.split, seed=f.seed,
        device=f.device, train_subset=f.train_subset, eval_every=f.eval_every, speed_sigma=f.speed_sigma,
        profile=str(f.profile) if f.profile else None, server_copies=f.server_copies.replace("-", "_"),
        server_bn=f.server_bn, server_lr=f.server_lr, server_bn_context=f.server_bn_context,
        schedule=f.schedule.replace("-", "_"), round_timeout=f.round_timeout, prox_mu=f.mu,
        wire_format=f.wire_format,
        model_args=_model_args(f.model_arg),
        train=TrainConfig(local_epochs=f.local_epochs, batch_size=f.batch_size, lr=f.lr, momentum=f.momentum,
                          weight_decay=f.weight_decay, augment=f.augment, max_batches=f.max_batches),
        fedsga=FedSGAConfig(rho=f.rho, beta=f.beta, lambda_align=f.lambda_align, tau_a=f.tau_a, tau_m=f.tau_m,
                            prompts=f.prompts, mu_proto=f.mu_proto, cal_every=f.cal_every, adapt=not f.no_adapt,
                            estimator=not f.no_estimator, harmonizer=not f.no_harmonizer),
    )


def _model_args(items: list[str]) -> dict[str, object]:
    """``KEY=VALUE`` pairs; values parse as JSON when they can (numbers, booleans), else stay strings."""
    import json

    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise typer.BadParameter(f"--model-arg {item!r} is not KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


# simulate's flags that describe the run (all but where it goes and how it shows progress)
RUN_FLAGS: tuple[str, ...] = tuple(n for n in inspect.signature(simulate).parameters if n not in ("out", "quiet", "threads"))
