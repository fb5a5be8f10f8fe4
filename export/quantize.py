"""int8 static quantization of a prefix with real calibration images (onnxruntime.quantization).

Format: QDQ, uint8 activations (asymmetric) and int8 per-channel weights. On x86 that is the
combination that pays: u8 activations with s8 weights ran 2.2-3.7x faster than fp32 on the ResNet
prefixes, s8 activations (S8S8) were no faster, and dynamic quantization (ConvInteger) was 7x
slower. Calibration is MinMax over batches of the calibration set's training images, normalised
as the model expects, with one fixed prompt set (``init_prompts`` with seed 0): the ranges do not
depend much on the prompts, which only add a per-sample bias (CNN) or m tokens (ViT).

This module is torch-free; the pipeline turns images into float batches before calling it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

__all__ = ["CalibrationReader", "normalize", "output_deviation", "quantize_prefix", "time_session"]


def normalize(images_nhwc_u8: np.ndarray, mean: Iterable[float], std: Iterable[float]) -> np.ndarray:
    """uint8 NHWC -> float32 NCHW, (x/255 - mean) / std per channel."""
    x = images_nhwc_u8.astype(np.float32) / 255.0
    x = (x - np.asarray(mean, np.float32)) / np.asarray(std, np.float32)
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2))


class CalibrationReader:
    """onnxruntime.quantization.CalibrationDataReader over a list of feed dicts."""

    def __init__(self, feeds: Iterable[dict[str, np.ndarray]]) -> None:
        self._feeds = list(feeds)
        self._it: Iterator[dict[str, np.ndarray]] = iter(self._feeds)

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._it, None)

    def rewind(self) -> None:
        self._it = iter(self._feeds)


def quantize_prefix(
    fp32_path: Path, out_path: Path, feeds: Iterable[dict[str, np.ndarray]], op_types: list[str] | None = None
) -> float:
    """Writes the int8 QDQ model to ``out_path``; returns the seconds it took.

    ``op_types`` limits what is quantized (None: everything onnxruntime can); the model says which
    (``SplitModel.int8_op_types``: a ViT keeps LayerNorm / Softmax in float, as is usual).
    """
    import logging

    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    start = time.perf_counter()
    pre = out_path.with_suffix(".pre.onnx")
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # the quantizer warns through the root logger about every skipped axis
    try:
        # Shape inference + graph fusion first, as onnxruntime recommends for static quantization.
        quant_pre_process(str(fp32_path), str(pre), skip_symbolic_shape=False)
        quantize_static(
            str(pre),
            str(out_path),
            CalibrationReader(feeds),
            quant_format=QuantFormat.QDQ,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            per_channel=True,
            reduce_range=needs_reduce_range(),
            calibrate_method=CalibrationMethod.MinMax,
            op_types_to_quantize=op_types,
        )
    finally:
        root.setLevel(level)
        pre.unlink(missing_ok=True)
        for extra in out_path.parent.glob("*.pre-inferred.onnx"):
            extra.unlink(missing_ok=True)
    return time.perf_counter() - start


def needs_reduce_range() -> bool:
    """7-bit weights on x86 CPUs without VNNI, as onnxruntime advises for its u8s8 kernels there.

    Without VNNI the u8 x s8 products are summed in int16 and can saturate: on this project's AVX2
    machines the int8 prefix at split 3 deviated 5-15 % from fp32 across seeds with 8-bit weights
    and 3.7 % with 7-bit ones. ARM and VNNI CPUs keep full 8-bit weights.
    """
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return True  # not Linux: we cannot tell, so take the safe choice
    return not any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def output_deviation(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    """Deviation of ``b`` from the reference ``a``: max / mean absolute, and mean relative to mean|a|."""
    d = np.abs(a.astype(np.float64) - b.astype(np.float64))
    scale = float(np.mean(np.abs(a))) + 1e-12
    return {"max_abs_dev": float(d.max()), "mean_abs_dev": float(d.mean()), "rel_mean_dev": float(d.mean()) / scale}


def time_session(sess, feeds: dict[str, np.ndarray], *, warmup: int = 2, iters: int = 10) -> float:
    """Median seconds of one run."""
    for _ in range(warmup):
        sess.run(None, feeds)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        sess.run(None, feeds)
        times.append(time.perf_counter() - t)
    return float(np.median(times))
