"""Package names imported on first use, so a torch-free caller can import the numpy-only parts."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, where: dict[str, str]) -> tuple[list[str], Callable[[str], Any], Callable[[], list[str]]]:
    """``__all__``, ``__getattr__`` and ``__dir__`` for ``package``, where ``where`` maps each public name
    to the submodule that defines it. A name is imported (and cached in the package) on first use."""
    names = sorted(where)
    module = importlib.import_module(package)

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{where[name]}", package), name)
        setattr(module, name, value)
        return value

    def __dir__() -> list[str]:
        return names

    return names, __getattr__, __dir__
