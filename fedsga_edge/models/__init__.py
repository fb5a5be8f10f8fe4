"""Split-ready backbones: one interface (:class:`SplitModel`), a registry and a factory."""

from . import resnet as _resnet  # noqa: F401  (registers)
from . import vit as _vit  # noqa: F401  (registers)
from .base import SplitModel
from .cost import CostTable, PrefixCost, count_flops, prefix_cost
from .registry import create_model, list_models, load_weights, register_model

__all__ = [
    "SplitModel",
    "PrefixCost",
    "CostTable",
    "count_flops",
    "prefix_cost",
    "create_model",
    "list_models",
    "load_weights",
    "register_model",
]
