"""The coordinator role: server-side training, the FedSGA estimator, rounds and aggregation."""

from .server import Coordinator
from .strategy import SplitAssigner, make_assigner, resource_splits

__all__ = ["Coordinator", "SplitAssigner", "make_assigner", "resource_splits"]
