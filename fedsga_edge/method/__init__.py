"""FedSGA's pure method components (docs/method.md): no models, roles, transports or CLI here.

Names are imported lazily: the device-side pieces (``adaptation``, ``observation``, ``heads``,
``policy``) are numpy only, and a torch-free device imports them without pulling in torch
through the coordinator-side ones (``estimator``, ``harmonizer``, ``prototypes``, ``aggregation``).
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "descriptor": "adaptation", "descriptor_weights": "adaptation", "prompt_contributions": "adaptation",
    "weight_entropy": "adaptation",
    "CalibrationBuffer": "estimator", "MonotoneEstimator": "estimator", "fit": "estimator",
    "Harmonizer": "harmonizer", "ShallowHead": "harmonizer", "alignment_loss": "harmonizer",
    "phi_s_loss": "harmonizer", "server_loss": "harmonizer",
    "estimate": "heads", "shallow_head": "heads",
    "Observation": "observation", "alignment": "observation", "drift": "observation",
    "prompt_variation": "observation",
    "CEIL_EPS": "policy", "reference_index": "policy", "split_index": "policy", "sufficiency_label": "policy",
    "Prototypes": "prototypes",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
