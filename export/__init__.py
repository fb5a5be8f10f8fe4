"""ONNX export of client prefixes: forward graphs, backward (train) graphs, int8, manifest.

Importing this package is cheap: the names below load their module (and torch, where that
module needs it) on first use, so ``fedsga_edge.export.manifest`` stays torch-free.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = [
    "Check",
    "ExportConfig",
    "ExportError",
    "ManifestError",
    "PrefixModule",
    "check_train_graphs",
    "convolution_backward",
    "count_macs",
    "export_prefix",
    "export_prefixes",
    "export_train_graphs",
    "quantize_prefix",
    "read_manifest",
    "summary_table",
    "validate_prefix",
    "write_manifest",
]

_WHERE = {
    "ExportConfig": "config",
    "ExportError": "config",
    "export_prefixes": "pipeline",
    "export_prefix": "onnx_prefix",
    "validate_prefix": "onnx_prefix",
    "PrefixModule": "onnx_prefix",
    "export_train_graphs": "backward",
    "check_train_graphs": "backward",
    "convolution_backward": "backward",
    "quantize_prefix": "quantize",
    "count_macs": "macs",
    "read_manifest": "manifest",
    "write_manifest": "manifest",
    "ManifestError": "manifest",
    "Check": "report",
    "summary_table": "report",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
