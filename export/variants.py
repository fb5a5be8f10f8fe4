"""The optional variants of one exported prefix: fp16, int8 and the train graphs.

Each step derives its file(s) from the validated fp32 prefix, checks them against that prefix or
torch, prints its check lines and returns its manifest entry with its verdict; the pipeline only
decides which steps run. The ``sha256`` / ``bytes`` fields are left empty: the pipeline stamps every
file of a prefix once its variants exist.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .calib import CalibData, batches
from .report import Check, format_checks

if TYPE_CHECKING:
    from torch import Tensor

    from fedsga_edge.models import SplitModel

    from .config import ExportConfig

__all__ = ["Log", "Prefix", "export_fp16", "export_int8", "export_train"]

Log = Callable[[str], None]


@dataclass
class Prefix:
    """One exported fp32 prefix and what its variants need to derive and check their own files."""

    cfg: ExportConfig
    model: SplitModel
    depth: int
    out: Path
    stem: str  # prefix_k{split}: every file of this prefix starts with it
    meta: dict[str, Any]  # the metadata every file of this prefix carries (plus its variant)
    ref_prompts: Tensor
    data: CalibData | None
    log: Log

    @property
    def path(self) -> Path:
        return self.out / f"{self.stem}.onnx"


def export_fp16(p: Prefix) -> tuple[dict[str, Any], bool]:
    """fp16 weights and compute with fp32 inputs and outputs, checked against torch at 1% of max |z|."""
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from .onnx_prefix import set_metadata, validate_prefix

    cfg = p.cfg
    fp16_path = p.out / f"{p.stem}.fp16.onnx"
    half = convert_float_to_float16(onnx.load(str(p.path)), keep_io_types=True)
    onnx.save(half, str(fp16_path))
    set_metadata(fp16_path, p.meta | {"variant": "fp16 (fp32 inputs and outputs)"})
    v16 = validate_prefix(
        fp16_path, p.model, p.depth, prompts_m=cfg.prompts, atol=cfg.atol, batch=cfg.validate_batch, rtol_of_max=1e-2
    )
    p.log(format_checks(f"Validating ONNX model {fp16_path.name} (fp16 weights and compute)...", v16.checks))
    entry = {"file": fp16_path.name, "sha256": "", "bytes": 0, "max_abs_dev": v16.max_abs_diff, "validation": v16.to_dict()}
    return entry, v16.ok


def export_int8(p: Prefix) -> tuple[dict[str, Any], bool]:
    """Static QDQ quantization calibrated on real images, compared with fp32 on the test images."""
    from .onnx_prefix import ort_session, set_metadata
    from .quantize import needs_reduce_range, output_deviation, quantize_prefix, time_session

    data = p.data
    assert data is not None
    int8_path = p.out / f"{p.stem}.int8.onnx"
    prompts_np = p.ref_prompts.numpy()
    feeds = [{"x": xb, "prompts": prompts_np} for xb in batches(data.calib, 32)]
    op_types = list(p.model.int8_op_types) if p.model.int8_op_types is not None else None
    q_seconds = quantize_prefix(p.path, int8_path, feeds, op_types)
    set_metadata(int8_path, p.meta | {"variant": "int8 QDQ (u8 activations, s8 per-channel weights)"})
    s32, s8 = ort_session(p.path), ort_session(int8_path)
    z32, z8 = _outputs(s32, data.test_x, prompts_np), _outputs(s8, data.test_x, prompts_np)
    dev = output_deviation(z32, z8)
    bench = {"x": data.test_x[:32], "prompts": prompts_np}
    t32, t8 = time_session(s32, bench), time_session(s8, bench)
    entry = {
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
    entry |= _int8_accuracy(p.model, p.depth, z32, z8, data, p.cfg.checkpoint is not None)
    checks = _int8_checks(z32, z8, dev, entry, data.source)
    p.log(format_checks(f"Validating ONNX model {int8_path.name} (int8, speed x{t32 / t8:.2f})...", checks))
    return entry, all(c.ok for c in checks)


def _outputs(session: Any, x: np.ndarray, prompts: np.ndarray) -> np.ndarray:
    """The prefix's z for every image, 64 at a time."""
    return np.concatenate([session.run(None, {"x": xb, "prompts": prompts})[0] for xb in batches(x, 64)])


def _int8_checks(
    z32: np.ndarray, z8: np.ndarray, dev: dict[str, Any], entry: dict[str, Any], source: str
) -> list[Check]:
    """Runs, stays within 10% of mean |z|, and what it does to accuracy (or agreement without labels)."""
    checks = [
        Check(z8.shape == z32.shape, f"runs on {len(z8)} test images of {source}"),
        Check(
            dev["rel_mean_dev"] <= 0.1,
            f"mean |int8 - fp32| is {100 * dev['rel_mean_dev']:.2f}% of mean |z| (max abs {dev['max_abs_dev']:.3g})",
        ),
    ]
    if "accuracy_fp32" in entry:
        checks.append(
            Check(
                True,
                f"test accuracy fp32 {100 * entry['accuracy_fp32']:.2f}% -> int8 {100 * entry['accuracy_int8']:.2f}%",
            )
        )
    else:
        checks.append(Check(True, f"fp32 / int8 predictions agree on {100 * entry['agreement']:.1f}%"))
    return checks


def _int8_accuracy(
    model: SplitModel, depth: int, z32: np.ndarray, z8: np.ndarray, data: CalibData, trained: bool
) -> dict[str, Any]:
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


def export_train(p: Prefix) -> tuple[dict[str, Any], bool]:
    """The device's train graphs (forward, backward, eval forward), checked against torch autograd."""
    from .backward import check_train_graphs, export_train_graphs
    from .onnx_prefix import set_metadata

    cfg = p.cfg
    graphs = export_train_graphs(
        p.model, p.depth, p.out, p.stem, prompts_m=cfg.prompts, opset=cfg.opset, example_batch=cfg.example_batch
    )
    for name in (graphs.forward_file, graphs.backward_file, graphs.eval_file):
        set_metadata(p.out / name, p.meta | {"variant": name.split(".")[-2]})
    checks, worst = check_train_graphs(p.model, p.depth, p.out, graphs, prompts_m=cfg.prompts, batch=cfg.validate_batch)
    p.log(format_checks(f"Validating train graphs {graphs.forward_file}, {graphs.backward_file}...", checks))
    entry = graphs.to_dict(p.out) | {"max_rel_grad_err": worst, "checks": [c.to_dict() for c in checks]}
    return entry, all(c.ok for c in checks)
