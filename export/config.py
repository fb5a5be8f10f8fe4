"""What one export is asked to do (``ExportConfig``) and how it refuses (``ExportError``).

Its own module so that the pipeline's steps (calibration data, the fp16/int8/train variants) can name
the configuration without importing the pipeline that calls them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ExportConfig", "ExportError"]


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
