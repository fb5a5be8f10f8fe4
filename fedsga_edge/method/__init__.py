"""FedSGA's pure method components (docs/method.md): no models, roles, transports or CLI here.

Names are imported lazily: the device-side pieces (``adaptation``, ``observation``, ``heads``,
``policy``) are numpy only, and a torch-free device imports them without pulling in torch
through the coordinator-side ones (``estimator``, ``harmonizer``, ``prototypes``, ``aggregation``).
"""

from __future__ import annotations

from ..lazy import lazy_exports

_WHERE = {
    "descriptor": "adaptation", "descriptor_weights": "adaptation", "prompt_contributions": "adaptation",
    "weight_entropy": "adaptation",
    "CalibrationBuffer": "estimator", "MonotoneEstimator": "estimator", "fit": "estimator",
    "informative": "estimator", "score": "estimator",
    "Harmonizer": "harmonizer", "ShallowHead": "harmonizer", "alignment_loss": "harmonizer",
    "phi_s_loss": "harmonizer", "server_loss": "harmonizer",
    "estimate": "heads", "shallow_head": "heads",
    "Observation": "observation", "alignment": "observation", "drift": "observation",
    "prompt_variation": "observation",
    "CEIL_EPS": "policy", "reference_index": "policy", "split_index": "policy", "sufficiency_label": "policy",
    "Prototypes": "prototypes",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _WHERE)
