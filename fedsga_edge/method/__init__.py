"""FedSGA's pure method components (docs/method.md): no models, roles, transports or CLI here."""

from .adaptation import descriptor, descriptor_weights, prompt_contributions, weight_entropy
from .estimator import CalibrationBuffer, MonotoneEstimator, fit
from .harmonizer import Harmonizer, alignment_loss, server_loss
from .observation import Observation, ShallowHead, alignment, drift, phi_s_loss, prompt_variation
from .policy import CEIL_EPS, reference_index, split_index, sufficiency_label
from .prototypes import Prototypes

__all__ = [
    "CEIL_EPS",
    "CalibrationBuffer",
    "Harmonizer",
    "MonotoneEstimator",
    "Observation",
    "Prototypes",
    "ShallowHead",
    "alignment",
    "alignment_loss",
    "descriptor",
    "descriptor_weights",
    "drift",
    "fit",
    "phi_s_loss",
    "prompt_contributions",
    "prompt_variation",
    "reference_index",
    "server_loss",
    "split_index",
    "sufficiency_label",
    "weight_entropy",
]
