"""Model registry and factory (timm-style): models register by name, the factory drops unset options."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .base import SplitModel

__all__ = ["register_model", "create_model", "list_models", "load_weights"]

_REGISTRY: dict[str, Callable[..., SplitModel]] = {}


def register_model(fn: Callable[..., SplitModel]) -> Callable[..., SplitModel]:
    if fn.__name__ in _REGISTRY:
        raise ValueError(f"model {fn.__name__!r} registered twice")
    _REGISTRY[fn.__name__] = fn
    return fn


def list_models() -> list[str]:
    return sorted(_REGISTRY)


def create_model(name: str, *, pretrained: str | Path | None = None, **kwargs: Any) -> SplitModel:
    """Build ``name``; options left as None fall back to the model's own defaults.

    ``pretrained`` is a local file only (nothing is downloaded): either a fedsga-edge checkpoint
    of the same model, or the upstream weights the model knows how to map (torchvision ResNet-18,
    timm ViT); a classifier head of another size is skipped and left freshly initialised.
    """
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(list_models())}")
    fn = _REGISTRY[name]
    options = {k: v for k, v in kwargs.items() if v is not None}
    params = inspect.signature(fn).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        unknown = sorted(set(options) - set(params))
        if unknown:
            raise ValueError(f"model {name!r} does not take {', '.join(unknown)}; its options: {', '.join(params)}")
    model = fn(**options)
    model.arch = name
    if pretrained is not None:
        load_weights(model, pretrained)
    return model


def load_weights(model: SplitModel, path: str | Path) -> list[str]:
    """Load a local state dict into ``model``; returns the keys that were left as initialised."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"weights file not found: {path} (pretrained weights are only read from a local file)")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]
    remap = getattr(model, "remap_upstream", None)
    own = model.state_dict()
    if remap is not None:  # upstream layout (torchvision / timm) when that explains more keys
        mapped = remap(state)
        if len(set(mapped) & set(own)) > len(set(state) & set(own)):
            state = mapped
    usable = {k: v for k, v in state.items() if k in own and own[k].shape == v.shape}
    if not usable:
        raise ValueError(f"{path} holds no tensor that fits {model.arch}: is it the right architecture and width?")
    model.load_state_dict(usable, strict=False)
    return sorted(set(own) - set(usable))
