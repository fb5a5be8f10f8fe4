"""The coordinator role: server-side training, the FedSGA estimator, rounds and aggregation.

Names are imported on first use: ``fedsga_edge.coordinator.broker_config`` and ``.broker`` need no
torch (a broker host runs ``fedsga-edge broker-config`` without it), the server side does.
"""

from __future__ import annotations

import importlib
from typing import Any

_WHERE = {
    "Coordinator": "server",
    "RoundError": "round",
    "RoundState": "round",
    "Strategy": "strategy",
    "create_strategy": "strategy",
    "list_strategies": "strategy",
    "register_strategy": "strategy",
    "resource_splits": "strategy",
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
