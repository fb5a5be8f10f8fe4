"""``export_prefixes``: every candidate prefix of a model to validated ONNX files and a manifest.

One function that computes and returns data (the manifest); it reports progress through the
``log`` callable it is given, and the CLI only formats. Order per split k: export the eval-mode
prefix, validate it in a fresh onnxruntime session at another batch size, count FLOPs (torch) and
MACs (ONNX graph), stamp metadata, then the optional fp16, int8 and train graphs.
"""

from __future__ import annotations

import copy
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .manifest import write_manifest
from .report import Check, format_checks

if TYPE_CHECKING:
    from fedsga_edge.models import SplitModel

__all__ = ["ExportConfig", "ExportError", "export_prefixes", "fedsga_version"]

Log = Callable[[str], None]


class ExportError(RuntimeError):
    """Raised for a configuration the export cannot honour (bad split, missing calibration data)."""


@dataclass
class ExportConfig:
    model: str
    out: Path
    width: float | None = None
    img_size: int | None = None
    num_classes: int | None = None  # default: the checkpoint's head, else the model's default
    model_args: dict[str, Any] = field(default_factory=dict)  # further options of the model's factory
    checkpoint: Path | None = None
    opset: int = 18
    prompts: int = 4  # m, fixed in the graph's `prompts` input
    fp16: bool = False
    int8: bool = False
    calib_data: str | None = None  # dataset spec for fedsga_edge.data.load_dataset
    data_root: Path | None = None
    calib_samples: int = 256
    eval_samples: int = 1000
    train: bool = False
    atol: float = 1e-4
    splits: tuple[int, ...] | None = None  # 1-based split indices; None = all candidates
    example_batch: int = 2
    validate_batch: int = 3
    seed: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(self).items()}


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


@dataclass
class _Data:
    """Calibration / evaluation data, already normalised for the model."""

    source: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int
    calib: np.ndarray  # float32 NCHW
    test_x: np.ndarray
    test_y: np.ndarray
    extra: dict[str, Any] = field(default_factory=dict)


def _load_data(cfg: ExportConfig, image_size: int) -> _Data:
    from fedsga_edge.data import load_dataset

    from .quantize import normalize

    assert cfg.calib_data is not None
    bundle = load_dataset(cfg.calib_data, cfg.data_root, image_size=image_size)
    rng = np.random.default_rng(cfg.seed)
    n_cal = min(cfg.calib_samples, len(bundle.train))
    cal_idx = np.sort(rng.choice(len(bundle.train), size=n_cal, replace=False))
    n_test = min(cfg.eval_samples, len(bundle.test)) if cfg.eval_samples > 0 else len(bundle.test)
    test_idx = np.arange(n_test)
    return _Data(
        source=cfg.calib_data,
        mean=tuple(bundle.mean),
        std=tuple(bundle.std),
        num_classes=bundle.num_classes,
        calib=normalize(bundle.train.get_batch(cal_idx), bundle.mean, bundle.std),
        test_x=normalize(bundle.test.get_batch(test_idx), bundle.mean, bundle.std),
        test_y=np.asarray(bundle.test.labels)[test_idx],
    )


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


def _batches(x: np.ndarray, size: int):
    for i in range(0, len(x), size):
        yield x[i : i + size]


def export_prefixes(cfg: ExportConfig, log: Log = print) -> dict[str, Any]:
    """Exports, validates and describes every requested prefix; writes and returns the manifest."""
    import onnx
    import onnxruntime as ort
    import torch

    from fedsga_edge.models import create_model, load_weights, prefix_cost

    from .macs import MACS_METHOD, count_macs
    from .onnx_prefix import export_friendly, export_prefix, ort_session, set_metadata, validate_prefix, weights_sha256

    if cfg.int8 and not cfg.calib_data:
        raise ExportError("--int8 needs --calib-data SPEC (static quantization calibrates on real images)")
    if cfg.opset not in (17, 18):
        raise ExportError(f"opset {cfg.opset} is not supported; use 17 or 18")
    if cfg.prompts < 1:
        raise ExportError("--prompts must be >= 1: the prompts are a graph input")
    torch.manual_seed(cfg.seed)
    options = {"width": cfg.width, "img_size": cfg.img_size, **cfg.model_args}
    model = create_model(cfg.model, num_classes=cfg.num_classes, **options)
    ckpt_prompts = None
    if cfg.checkpoint is not None:
        head, ckpt_prompts = _checkpoint_info(cfg.checkpoint, model)
        if cfg.num_classes is None and head is not None and head != model.head.out_features:
            torch.manual_seed(cfg.seed)  # the same initial weights as one build with the checkpoint's head size
            model = create_model(cfg.model, num_classes=head, **options)
    if cfg.checkpoint is not None:
        missing = load_weights(model, cfg.checkpoint)
        if missing:
            log(f"[warning] {cfg.checkpoint}: {len(missing)} tensors left as initialised, e.g. {missing[:3]}")
    model.eval()
    pristine = copy.deepcopy(model)  # cost counting runs train-mode forwards (BN stats move): never on `model`
    splits = list(cfg.splits or range(1, model.num_splits + 1))
    for k in splits:
        model.depth_of(k)  # raises on an index out of range
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)

    gen = torch.Generator().manual_seed(cfg.seed)
    if isinstance(ckpt_prompts, torch.Tensor) and tuple(ckpt_prompts.shape) == (cfg.prompts, model.prompt_dim):
        ref_prompts = ckpt_prompts.float()
    else:
        ref_prompts = model.init_prompts(cfg.prompts, generator=gen)
    data = _load_data(cfg, model.input_size) if cfg.calib_data else None
    versions = {
        "torch_version": torch.__version__,
        "onnx_version": onnx.__version__,
        "onnxruntime_version": ort.__version__,
        "fedsga_edge_version": fedsga_version(),
    }
    width = getattr(model, "width", None)
    model_info = {
        "arch": cfg.model,
        "family": model.family,
        "width": width,
        "img_size": model.input_size,
        "num_classes": model.head.out_features,
        "num_blocks": model.num_blocks,
        "splits": list(model.splits),
        "prompts_m": cfg.prompts,
        "prompt_dim": model.prompt_dim,
        "prompt_std": model.prompt_std,  # a torch-free device draws its own prompts with this scale
        # The model's contract, for the torch-free device (which cannot ask the model):
        "units": {name: model.unit_of(name) for name in model.state_dict()},  # weight -> aggregation unit
        "interface_pool_axes": list(model.interface_pool_axes),  # how p_1 pools into h1
        "prompts_as_tokens": model.prompt_positions(1) > 0,  # prompts lengthen the activation
        "checkpoint": str(cfg.checkpoint) if cfg.checkpoint else None,
        "weights_sha256": weights_sha256(model),
    }
    normalization = {"mean": list(data.mean), "std": list(data.std), "source": data.source} if data else None
    x_shape = [None, 3, model.input_size, model.input_size]
    manifest: dict[str, Any] = {
        "fedsga_edge_version": versions["fedsga_edge_version"],
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "model": model_info,
        "input": {"name": "x", "shape": x_shape, "layout": "NCHW", "dtype": "float32", "normalization": normalization},
        "opset": cfg.opset,
        "exporter": "torch.onnx.export(dynamo=True)",
        **{k: v for k, v in versions.items() if k != "fedsga_edge_version"},
        "macs_method": MACS_METHOD,
        "config": cfg.to_dict(),
        "prefixes": [],
    }

    for k in splits:
        depth = model.depth_of(k)
        stem = f"prefix_k{k}"
        path = out / f"{stem}.onnx"
        seconds = export_prefix(
            model, depth, path, prompts_m=cfg.prompts, opset=cfg.opset, example_batch=cfg.example_batch
        )
        val = validate_prefix(
            path, model, depth, prompts_m=cfg.prompts, atol=cfg.atol, batch=cfg.validate_batch, opset=cfg.opset
        )
        log(
            format_checks(
                f"Validating ONNX model {path.name} (split {k}, depth {depth}, exported in {seconds:.1f} s)...",
                val.checks,
            )
        )

        with export_friendly(pristine):
            # Fused attention off: FlopCounterMode does not count the CPU flash-attention kernel
            # that timm's fused path dispatches to (ViT attention matmuls came out as 0 FLOPs).
            cost = prefix_cost(pristine, depth, cfg.prompts)
        act = list(model.interface_shape(depth, cfg.prompts))
        elems = int(np.prod(act))
        macs = count_macs(
            path,
            {
                "x": np.zeros((1, 3, model.input_size, model.input_size), np.float32),
                "prompts": ref_prompts.numpy(),
            },
        )
        prefix_weights = weights_sha256(torch.nn.ModuleList(model.blocks[:depth]))
        block = model.blocks[depth - 1]
        meta = {
            "arch": cfg.model,
            "width": "" if width is None else str(width),
            "img_size": str(model.input_size),
            "split": str(k),
            "depth": str(depth),
            "block": f"blocks[:{depth}] (last: blocks.{depth - 1} {type(block).__name__})",
            "input_shapes": {"x": x_shape, "prompts": [cfg.prompts, model.prompt_dim]},
            "output_shape": {"z": [None, *act]},
            "opset": str(cfg.opset),
            "weights_sha256": prefix_weights,
            "prompts_m": str(cfg.prompts),
            "normalization": normalization,
            **versions,
        }
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
            "inputs": {"x": x_shape, "prompts": [cfg.prompts, model.prompt_dim]},
            "output": {"name": "z", "shape": [None, *act]},
            "activation": {
                "shape": act,
                "elems": elems,
                "bytes_per_sample": {"fp32": 4 * elems, "fp16": 2 * elems, "int8": elems},
            },
            "validation": val.to_dict(),
            "export_seconds": round(seconds, 2),
        }
        ok = val.ok

        if cfg.fp16:
            from onnxruntime.transformers.float16 import convert_float_to_float16

            fp16_path = out / f"{stem}.fp16.onnx"
            half = convert_float_to_float16(onnx.load(str(path)), keep_io_types=True)
            onnx.save(half, str(fp16_path))
            set_metadata(fp16_path, meta | {"variant": "fp16 (fp32 inputs and outputs)"})
            v16 = validate_prefix(
                fp16_path,
                model,
                depth,
                prompts_m=cfg.prompts,
                atol=cfg.atol,
                batch=cfg.validate_batch,
                rtol_of_max=1e-2,
            )
            log(format_checks(f"Validating ONNX model {fp16_path.name} (fp16 weights and compute)...", v16.checks))
            entry["fp16"] = {
                "file": fp16_path.name,
                "sha256": "",
                "bytes": 0,
                "max_abs_dev": v16.max_abs_diff,
                "validation": v16.to_dict(),
            }
            ok &= v16.ok

        if cfg.int8:
            assert data is not None
            from .quantize import needs_reduce_range, output_deviation, quantize_prefix, time_session

            int8_path = out / f"{stem}.int8.onnx"
            prompts_np = ref_prompts.numpy()
            feeds = [{"x": xb, "prompts": prompts_np} for xb in _batches(data.calib, 32)]
            op_types = list(model.int8_op_types) if model.int8_op_types is not None else None
            q_seconds = quantize_prefix(path, int8_path, feeds, op_types)
            set_metadata(int8_path, meta | {"variant": "int8 QDQ (u8 activations, s8 per-channel weights)"})
            s32, s8 = ort_session(path), ort_session(int8_path)
            z32 = np.concatenate(
                [s32.run(None, {"x": xb, "prompts": prompts_np})[0] for xb in _batches(data.test_x, 64)]
            )
            z8 = np.concatenate([s8.run(None, {"x": xb, "prompts": prompts_np})[0] for xb in _batches(data.test_x, 64)])
            dev = output_deviation(z32, z8)
            bench = {"x": data.test_x[:32], "prompts": prompts_np}
            t32, t8 = time_session(s32, bench), time_session(s8, bench)
            checks = [
                Check(z8.shape == z32.shape, f"runs on {len(z8)} test images of {data.source}"),
                Check(
                    dev["rel_mean_dev"] <= 0.1,
                    f"mean |int8 - fp32| is {100 * dev['rel_mean_dev']:.2f}% of mean |z| (max abs {dev['max_abs_dev']:.3g})",
                ),
            ]
            entry["int8"] = {
                "file": int8_path.name,
                "sha256": "",
                "bytes": 0,
                **dev,
                "format": "QDQ, activations uint8 (asymmetric), weights int8 per-channel, MinMax calibration",
                "reduce_range": needs_reduce_range(),
                "quantized_ops": op_types or "all",
                "calibration": {"data": data.source, "samples": len(data.calib)},
                "quantize_seconds": round(q_seconds, 2),
                "latency_ms_fp32": 1e3 * t32,
                "latency_ms_int8": 1e3 * t8,
                "latency_batch": len(bench["x"]),
                "speedup": t32 / t8 if t8 > 0 else None,
            }
            entry["int8"] |= _int8_accuracy(model, depth, z32, z8, data, cfg.checkpoint is not None, log)
            if "accuracy_fp32" in entry["int8"]:
                checks.append(
                    Check(
                        True,
                        f"test accuracy fp32 {100 * entry['int8']['accuracy_fp32']:.2f}% -> int8 "
                        f"{100 * entry['int8']['accuracy_int8']:.2f}%",
                    )
                )
            else:
                checks.append(Check(True, f"fp32 / int8 predictions agree on {100 * entry['int8']['agreement']:.1f}%"))
            log(format_checks(f"Validating ONNX model {int8_path.name} (int8, speed x{t32 / t8:.2f})...", checks))
            ok &= all(c.ok for c in checks)

        if cfg.train:
            from .backward import check_train_graphs, export_train_graphs

            graphs = export_train_graphs(
                model, depth, out, stem, prompts_m=cfg.prompts, opset=cfg.opset, example_batch=cfg.example_batch
            )
            for name in (graphs.forward_file, graphs.backward_file, graphs.eval_file):
                set_metadata(out / name, meta | {"variant": name.split(".")[-2]})
            checks, worst = check_train_graphs(
                model, depth, out, graphs, prompts_m=cfg.prompts, batch=cfg.validate_batch
            )
            log(format_checks(f"Validating train graphs {graphs.forward_file}, {graphs.backward_file}...", checks))
            entry["train"] = graphs.to_dict(out) | {
                "max_rel_grad_err": worst,
                "checks": [c.to_dict() for c in checks],
            }
            ok &= all(c.ok for c in checks)

        from .manifest import sha256_file

        for sub in (entry, entry.get("fp16"), entry.get("int8")):
            if sub:
                sub["sha256"] = sha256_file(out / sub["file"])
                sub["bytes"] = (out / sub["file"]).stat().st_size
        entry["valid"] = bool(ok)
        manifest["prefixes"].append(entry)
        write_manifest(out, manifest)  # after every prefix: a crash leaves a usable partial manifest
    manifest["out_dir"] = str(out)
    return manifest


def _int8_accuracy(model, depth, z32, z8, data: _Data, trained: bool, log: Log) -> dict[str, Any]:
    """Full-model predictions with the fp32 vs int8 prefix feeding the torch suffix and head."""
    import torch

    with torch.no_grad():
        model.eval()
        p32 = model.head(model.suffix(torch.from_numpy(z32), depth)).argmax(1).numpy()
        p8 = model.head(model.suffix(torch.from_numpy(z8), depth)).argmax(1).numpy()
    out: dict[str, Any] = {"eval_samples": len(z32), "agreement": float(np.mean(p32 == p8))}
    if trained and model.head.out_features == data.num_classes:
        out["accuracy_fp32"] = float(np.mean(p32 == data.test_y))
        out["accuracy_int8"] = float(np.mean(p8 == data.test_y))
        out["accuracy_delta"] = out["accuracy_int8"] - out["accuracy_fp32"]
    else:
        why = "no --checkpoint (random weights)" if not trained else "head size differs from the dataset's classes"
        out["accuracy_note"] = f"{why}: top-1 agreement of fp32 vs int8 predictions reported instead of accuracy"
    return out
