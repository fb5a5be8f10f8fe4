"""The coordinator role: server-side training, the FedSGA estimator, rounds and aggregation."""

from .round import RoundError, RoundState
from .server import Coordinator
from .strategy import Strategy, create_strategy, list_strategies, register_strategy, resource_splits

__all__ = ["Coordinator", "RoundError", "RoundState", "Strategy", "create_strategy", "list_strategies",
           "register_strategy", "resource_splits"]
