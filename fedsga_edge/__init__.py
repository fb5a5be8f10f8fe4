"""fedsga-edge: adaptive split federated learning (FedSGA) for real edge devices.

Layers, each importing only those above it in this list:
core (``models``, ``data``, ``method``, ``wire``, ``transport``, ``config``, ``tensors``) ->
roles (``coordinator``, ``device``, ``export``) -> wiring (``simulation``, ``cli``).
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("fedsga-edge")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0+local"

__all__ = ["__version__"]
