"""Calibration and evaluation images for the int8 variant, normalised as the model expects.

Kept apart from the pipeline so that the export's steps and the int8 step share one type, and the
dataset is read once per export (not once per prefix).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .config import ExportConfig

__all__ = ["CalibData", "batches", "load_calib_data"]


@dataclass
class CalibData:
    """Calibration / evaluation data, already normalised for the model."""

    source: str
    mean: tuple[float, ...]
    std: tuple[float, ...]
    num_classes: int
    calib: np.ndarray  # float32 NCHW
    test_x: np.ndarray
    test_y: np.ndarray
    extra: dict[str, Any] = field(default_factory=dict)


def load_calib_data(cfg: ExportConfig, image_size: int) -> CalibData:
    """A seeded calibration subset of the train split and the first ``eval_samples`` test images."""
    from fedsga_edge.data import load_dataset

    from .quantize import normalize

    assert cfg.calib_data is not None
    bundle = load_dataset(cfg.calib_data, cfg.data_root, image_size=image_size)
    rng = np.random.default_rng(cfg.seed)
    n_cal = min(cfg.calib_samples, len(bundle.train))
    cal_idx = np.sort(rng.choice(len(bundle.train), size=n_cal, replace=False))
    n_test = min(cfg.eval_samples, len(bundle.test)) if cfg.eval_samples > 0 else len(bundle.test)
    test_idx = np.arange(n_test)
    return CalibData(
        source=cfg.calib_data,
        mean=tuple(bundle.mean),
        std=tuple(bundle.std),
        num_classes=bundle.num_classes,
        calib=normalize(bundle.train.get_batch(cal_idx), bundle.mean, bundle.std),
        test_x=normalize(bundle.test.get_batch(test_idx), bundle.mean, bundle.std),
        test_y=np.asarray(bundle.test.labels)[test_idx],
    )


def batches(x: np.ndarray, size: int) -> Iterator[np.ndarray]:
    """Consecutive slices of ``size`` rows (the last may be shorter)."""
    for i in range(0, len(x), size):
        yield x[i : i + size]
