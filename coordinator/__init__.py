"""The coordinator role: server-side training, the FedSGA estimator, rounds and aggregation.

Names are imported on first use: the strategies' registry needs no torch (a device validates its
config with it), the server side does. The MQTT broker tooling is ``fedsga_edge.broker``.
"""

from __future__ import annotations

from fedsga_edge.lazy import lazy_exports

_WHERE = {
    "Coordinator": "server",
    "Instruction": "instructions",
    "Method": "strategy",
    "ServerSide": "server_side",
    "all_methods": "strategy",
    "get_strategy": "strategy",
    "method_of": "strategy",
    "RoundError": "round",
    "RoundState": "round",
    "Strategy": "strategy",
    "create_strategy": "strategy",
    "list_strategies": "strategy",
    "register_strategy": "strategy",
    "resource_splits": "strategies.resource",
}

__all__, __getattr__, __dir__ = lazy_exports(__name__, _WHERE)
