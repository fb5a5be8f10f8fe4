"""The coordinator role: server-side training, the FedSGA estimator, rounds and aggregation."""

from .server import Coordinator, RoundFailure
from .strategy import SplitAssigner, make_assigner, resource_splits

__all__ = ["Coordinator", "RoundFailure", "SplitAssigner", "make_assigner", "resource_splits"]
