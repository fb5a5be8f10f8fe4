"""``export_prefixes``: every candidate prefix of a model to validated ONNX files and a manifest.

One function that computes and returns data (the manifest); it reports progress through the
``log`` callable it is given, and the CLI only formats. Order per split k: export the eval-mode
prefix, validate it in a fresh onnxruntime session at another batch size, count FLOPs (torch) and
MACs (ONNX graph), stamp metadata, then the optional fp16, int8 and train graphs
(``variants.py``), then hash the files and rewrite the manifest. Each of these is one named step
below, so a new variant or check lands in one short function.
"""

from __future__ import annotations

import copy
import platform
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .calib import CalibData, load_calib_data
from .config import ExportConfig, ExportError
from .manifest import write_manifest
from .report import format_checks
from .variants import Log, Prefix, export_fp16, export_int8, export_train

if TYPE_CHECKING:
    from torch import Tensor

    from fedsga_edge.models import SplitModel

    from .onnx_prefix import Validation

__all__ = ["ExportConfig", "ExportError", "export_prefixes", "fedsga_version"]


def fedsga_version() -> str:
    try:
        from fedsga_edge import __version__

        return str(__version__)
    except ImportError:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version("fedsga-edge")
        except PackageNotFoundError:
            return "unknown"


def _checkpoint_info(path: Path, model: SplitModel) -> tuple[int | None, Any]:
    """(head size, prompts tensor or None) found in a checkpoint; ``model`` names its head's key.

    The key is the model's (``head_name``), in our layout or, via ``remap_upstream``, the upstream
    one (torchvision's ``fc``), so no head spelling is assumed here.
    """
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True)
    prompts = state.get("prompts") if isinstance(state, dict) else None
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict):
        return None, prompts
    key = f"{model.head_name}.weight"
    remap = getattr(model, "remap_upstream", None)
    for layout in (state, remap(state) if remap is not None else {}):
        if key in layout:
            return int(layout[key].shape[0]), prompts
    return None, prompts


@dataclass
class _Export:
    """What every prefix of one export shares, settled before the first file is written."""

    cfg: ExportConfig
    model: SplitModel
    pristine: SplitModel  # cost counting runs train-mode forwards (BN stats move): never on `model`
    splits: list[int]
    out: Path
    ref_prompts: Tensor  # the prompts fed when counting MACs and calibrating / comparing int8
    data: CalibData | None
    versions: dict[str, str]
    log: Log

    @property
    def x_shape(self) -> list[int | None]:
        return [None, 3, self.model.input_size, self.model.input_size]

    @property
    def normalization(self) -> dict[str, Any] | None:
        data = self.data
        return {"mean": list(data.mean), "std": list(data.std), "source": data.source} if data else None


def export_prefixes(cfg: ExportConfig, log: Log = print) -> dict[str, Any]:
    """Exports, validates and describes every requested prefix; writes and returns the manifest."""
    _check_config(cfg)
    run = _prepare(cfg, log)
    manifest = _manifest(run)
    for k in run.splits:
        manifest["prefixes"].append(_export_split(run, k))
        write_manifest(run.out, manifest)  # after every prefix: a crash leaves a usable partial manifest
    manifest["out_dir"] = str(run.out)
    return manifest


def _check_config(cfg: ExportConfig) -> None:
    """Refuse what the export cannot honour before anything is built or written."""
    if cfg.int8 and not cfg.calib_data:
        raise ExportError("--int8 needs --calib-data SPEC (static quantization calibrates on real images)")
    if cfg.opset not in (17, 18):
        raise ExportError(f"opset {cfg.opset} is not supported; use 17 or 18")
    if cfg.prompts < 1:
        raise ExportError("--prompts must be >= 1: the prompts are a graph input")


def _build_model(cfg: ExportConfig, log: Log) -> tuple[SplitModel, Any]:
    """The eval-mode model with the checkpoint's weights (and head size), and the checkpoint's prompts if any."""
    import torch

    from fedsga_edge.models import create_model, load_weights

    torch.manual_seed(cfg.seed)
    options = {"width": cfg.width, "img_size": cfg.img_size, **cfg.model_args}
    model = create_model(cfg.model, num_classes=cfg.num_classes, **options)
    ckpt_prompts = None
    if cfg.checkpoint is not None:
        head, ckpt_prompts = _checkpoint_info(cfg.checkpoint, model)
        if cfg.num_classes is None and head is not None and head != model.head.out_features:
            torch.manual_seed(cfg.seed)  # the same initial weights as one build with the checkpoint's head size
            model = create_model(cfg.model, num_classes=head, **options)
        missing = load_weights(model, cfg.checkpoint)
        if missing:
            log(f"[warning] {cfg.checkpoint}: {len(missing)} tensors left as initialised, e.g. {missing[:3]}")
    model.eval()
    return model, ckpt_prompts


def _prepare(cfg: ExportConfig, log: Log) -> _Export:
    """Model, splits (checked), output folder, reference prompts, calibration data and versions."""
    import onnx
    import onnxruntime as ort
    import torch

    model, ckpt_prompts = _build_model(cfg, log)
    pristine = copy.deepcopy(model)
    splits = list(cfg.splits or range(1, model.num_splits + 1))
    for k in splits:
        model.depth_of(k)  # raises on an index out of range
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    ref_prompts = _reference_prompts(cfg, model, ckpt_prompts)
    data = load_calib_data(cfg, model.input_size) if cfg.calib_data else None
    versions = {
        "torch_version": torch.__version__,
        "onnx_version": onnx.__version__,
        "onnxruntime_version": ort.__version__,
        "fedsga_edge_version": fedsga_version(),
    }
    return _Export(cfg, model, pristine, splits, out, ref_prompts, data, versions, log)


def _reference_prompts(cfg: ExportConfig, model: SplitModel, ckpt_prompts: Any) -> Tensor:
    """The checkpoint's prompts when they fit the graph's input, else seeded fresh ones."""
    import torch

    gen = torch.Generator().manual_seed(cfg.seed)
    if isinstance(ckpt_prompts, torch.Tensor) and tuple(ckpt_prompts.shape) == (cfg.prompts, model.prompt_dim):
        return ckpt_prompts.float()
    return model.init_prompts(cfg.prompts, generator=gen)


def _manifest(run: _Export) -> dict[str, Any]:
    """The manifest's header: model, input, versions and config; ``prefixes`` fills in as they pass."""
    from .macs import MACS_METHOD

    versions = run.versions
    return {
        "fedsga_edge_version": versions["fedsga_edge_version"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "model": _model_info(run),
        "input": {
            "name": "x",
            "shape": run.x_shape,
            "layout": "NCHW",
            "dtype": "float32",
            "normalization": run.normalization,
        },
        "opset": run.cfg.opset,
        "exporter": "torch.onnx.export(dynamo=True)",
        **{k: v for k, v in versions.items() if k != "fedsga_edge_version"},
        "macs_method": MACS_METHOD,
        "config": run.cfg.to_dict(),
        "prefixes": [],
    }


def _model_info(run: _Export) -> dict[str, Any]:
    """The model and its contract, for a torch-free device (which cannot ask the model)."""
    from .onnx_prefix import weights_sha256

    model, cfg = run.model, run.cfg
    return {
        "arch": cfg.model,
        "family": model.family,
        "width": getattr(model, "width", None),
        "img_size": model.input_size,
        "num_classes": model.head.out_features,
        "num_blocks": model.num_blocks,
        "splits": list(model.splits),
        "prompts_m": cfg.prompts,
        "prompt_dim": model.prompt_dim,
        "prompt_std": model.prompt_std,  # a torch-free device draws its own prompts with this scale
        "units": {name: model.unit_of(name) for name in model.state_dict()},  # weight -> aggregation unit
        "interface_pool_axes": list(model.interface_pool_axes),  # how p_1 pools into h1
        "prompts_as_tokens": model.prompt_positions(1) > 0,  # prompts lengthen the activation
        "checkpoint": str(cfg.checkpoint) if cfg.checkpoint else None,
        "weights_sha256": weights_sha256(model),
    }


def _export_split(run: _Export, k: int) -> dict[str, Any]:
    """Split k's fp32 prefix (exported, validated, costed, stamped), its requested variants, its files' hashes."""
    cfg = run.cfg
    depth = run.model.depth_of(k)
    stem = f"prefix_k{k}"
    path = run.out / f"{stem}.onnx"
    seconds, val = _export_fp32(run, k, depth, path)
    entry, meta = _describe_fp32(run, k, depth, path)
    entry |= {"validation": val.to_dict(), "export_seconds": round(seconds, 2)}
    ok = val.ok
    prefix = Prefix(cfg, run.model, depth, run.out, stem, meta, run.ref_prompts, run.data, run.log)
    for wanted, key, step in ((cfg.fp16, "fp16", export_fp16), (cfg.int8, "int8", export_int8),
                              (cfg.train, "train", export_train)):
        if wanted:
            entry[key], passed = step(prefix)
            ok &= passed
    _stamp_files(run.out, entry)
    entry["valid"] = bool(ok)
    return entry


def _export_fp32(run: _Export, k: int, depth: int, path: Path) -> tuple[float, Validation]:
    """The eval-mode prefix to ONNX, validated in a fresh session at another batch size; prints the checks."""
    from .onnx_prefix import export_prefix, validate_prefix

    cfg = run.cfg
    seconds = export_prefix(
        run.model, depth, path, prompts_m=cfg.prompts, opset=cfg.opset, example_batch=cfg.example_batch
    )
    val = validate_prefix(
        path, run.model, depth, prompts_m=cfg.prompts, atol=cfg.atol, batch=cfg.validate_batch, opset=cfg.opset
    )
    title = f"Validating ONNX model {path.name} (split {k}, depth {depth}, exported in {seconds:.1f} s)..."
    run.log(format_checks(title, val.checks))
    return seconds, val


def _describe_fp32(run: _Export, k: int, depth: int, path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Costs (torch FLOPs, ONNX MACs) and activation size of the prefix; stamps its metadata into the file.

    Returns its manifest entry (without the validation) and the metadata its variants carry too."""
    import torch

    from fedsga_edge.models import prefix_cost

    from .macs import count_macs
    from .onnx_prefix import export_friendly, set_metadata, weights_sha256

    model, cfg = run.model, run.cfg
    with export_friendly(run.pristine):
        # Fused attention off: FlopCounterMode does not count the CPU flash-attention kernel
        # that timm's fused path dispatches to (ViT attention matmuls came out as 0 FLOPs).
        cost = prefix_cost(run.pristine, depth, cfg.prompts)
    act = list(model.interface_shape(depth, cfg.prompts))
    elems = int(np.prod(act))
    size = model.input_size
    macs = count_macs(path, {"x": np.zeros((1, 3, size, size), np.float32), "prompts": run.ref_prompts.numpy()})
    prefix_weights = weights_sha256(torch.nn.ModuleList(model.blocks[:depth]))
    meta = _prefix_meta(run, k, depth, act, prefix_weights)
    set_metadata(path, meta | {"variant": "fp32"})
    entry: dict[str, Any] = {
        "split": k,
        "depth": depth,
        "file": path.name,
        "sha256": "",
        "bytes": 0,
        "weights_sha256": prefix_weights,
        "params": cost.params,
        "flops_per_sample": cost.flops_forward,
        "flops_train_per_sample": cost.flops_train,
        "macs_onnx": macs,
        "macs_vs_flops": (2 * macs / cost.flops_forward) if cost.flops_forward else None,
        "inputs": {"x": run.x_shape, "prompts": [cfg.prompts, model.prompt_dim]},
        "output": {"name": "z", "shape": [None, *act]},
        "activation": {
            "shape": act,
            "elems": elems,
            "bytes_per_sample": {"fp32": 4 * elems, "fp16": 2 * elems, "int8": elems},
        },
    }
    return entry, meta


def _prefix_meta(run: _Export, k: int, depth: int, act: list[int], prefix_weights: str) -> dict[str, Any]:
    """The metadata_props every file of this prefix carries: what it is, its shapes, weights and versions."""
    model, cfg = run.model, run.cfg
    width = getattr(model, "width", None)
    block = model.blocks[depth - 1]
    return {
        "arch": cfg.model,
        "width": "" if width is None else str(width),
        "img_size": str(model.input_size),
        "split": str(k),
        "depth": str(depth),
        "block": f"blocks[:{depth}] (last: blocks.{depth - 1} {type(block).__name__})",
        "input_shapes": {"x": run.x_shape, "prompts": [cfg.prompts, model.prompt_dim]},
        "output_shape": {"z": [None, *act]},
        "opset": str(cfg.opset),
        "weights_sha256": prefix_weights,
        "prompts_m": str(cfg.prompts),
        "normalization": run.normalization,
        **run.versions,
    }


def _stamp_files(out: Path, entry: dict[str, Any]) -> None:
    """sha256 and size of the prefix's fp32, fp16 and int8 files, once they are all written."""
    from .manifest import sha256_file

    for sub in (entry, entry.get("fp16"), entry.get("int8")):
        if sub:
            sub["sha256"] = sha256_file(out / sub["file"])
            sub["bytes"] = (out / sub["file"]).stat().st_size
