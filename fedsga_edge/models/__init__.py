"""Split-ready backbones: one interface (:class:`SplitModel`), a registry and a factory.

A backbone is one module here with ``@register_model`` factories; the registry finds and imports
it on first use (``catalog``). Names load lazily, so ``catalog.models_help()`` works without torch.
"""

from ..lazy import lazy_exports

_WHERE = {
    "SplitModel": "base",
    "PrefixCost": "cost",
    "CostTable": "cost",
    "count_flops": "cost",
    "prefix_cost": "cost",
    "ModelEntry": "registry",
    "create_model": "registry",
    "list_models": "registry",
    "load_weights": "registry",
    "model_entry": "registry",
    "register_model": "registry",
    "builtin_models": "catalog",
    "models_help": "catalog",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _WHERE)
