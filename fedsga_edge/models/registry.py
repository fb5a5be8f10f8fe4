"""Model registry and factory (timm-style): models register by name, the factory drops unset options.

A backbone registers with ``@register_model`` (or ``@register_model(small=..., heavy=...)``): the
options of a small instance let every test and smoke run follow the registry instead of a
hand-kept table. The package's own backbone modules are imported on first use (``catalog``).
"""

from __future__ import annotations

import importlib
import inspect
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, overload

import torch

from .base import SplitModel
from .catalog import backbone_modules

__all__ = ["ModelEntry", "register_model", "create_model", "list_models", "load_weights", "model_entry"]

Factory = Callable[..., SplitModel]


@dataclass(frozen=True)
class ModelEntry:
    """One registered backbone: its factory and what a quick instance of it needs."""

    name: str
    build: Factory
    small: Mapping[str, Any] = field(default_factory=dict)  # options of a small instance with every block type
    heavy: bool = False  # seconds and GBs even when small: the slow checks (export) skip it unless asked

    @property
    def summary(self) -> str:
        return (inspect.getdoc(self.build) or "").split("\n")[0]


_REGISTRY: dict[str, ModelEntry] = {}
_LOADED = False


def _load_builtin() -> None:
    """Import the package's backbone modules once, which registers them."""
    global _LOADED
    if not _LOADED:
        _LOADED = True
        for module in backbone_modules():
            importlib.import_module(f"{__package__}.{module}")


@overload
def register_model(fn: Factory) -> Factory: ...
@overload
def register_model(*, small: Mapping[str, Any] | None = None, heavy: bool = False) -> Callable[[Factory], Factory]: ...
def register_model(fn: Factory | None = None, *, small: Mapping[str, Any] | None = None,
                   heavy: bool = False) -> Factory | Callable[[Factory], Factory]:
    """Register ``fn`` under its name; ``small``: options for a small, quick instance (tests, smoke runs)."""

    def add(f: Factory) -> Factory:
        if f.__name__ in _REGISTRY:
            raise ValueError(f"model {f.__name__!r} registered twice")
        _REGISTRY[f.__name__] = ModelEntry(f.__name__, f, MappingProxyType(dict(small or {})), heavy)
        return f

    return add(fn) if fn is not None else add


def list_models() -> list[str]:
    _load_builtin()
    return sorted(_REGISTRY)


def model_entry(name: str) -> ModelEntry:
    _load_builtin()
    if name not in _REGISTRY:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(list_models())}")
    return _REGISTRY[name]


def create_model(name: str, *, pretrained: str | Path | None = None, **kwargs: Any) -> SplitModel:
    """Build ``name``; options left as None fall back to the model's own defaults.

    ``pretrained`` is a local file only (nothing is downloaded): either a fedsga-edge checkpoint
    of the same model, or the upstream weights the model knows how to map (torchvision ResNet-18,
    timm ViT); a classifier head of another size is skipped and left freshly initialised.
    """
    fn = model_entry(name).build
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
    _avoid_onednn_narrow_1x1(model)
    return model


def _avoid_onednn_narrow_1x1(model: torch.nn.Module) -> None:
    """torch 2.14.1's oneDNN kernel for a 1x1 convolution's weight gradient (jit_avx2_1x1_convolution_bwd_weights)
    segfaults when the convolution has fewer than 8 input channels (resnet18_cifar at width 0.0625: its 4-channel
    shortcuts), so the first backward step killed the process. Such a model turns oneDNN off for the process
    (torch's own convolutions then run: slower, correct) and says so once; wider models are untouched."""
    narrow = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (1, 1)
              and m.in_channels < 8]
    if narrow and torch.backends.mkldnn.enabled:
        torch.backends.mkldnn.enabled = False
        warnings.warn(f"{len(narrow)} 1x1 convolutions with fewer than 8 input channels: oneDNN is off for this "
                      "process (its weight-gradient kernel crashes on them); convolutions run slower", stacklevel=3)


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
