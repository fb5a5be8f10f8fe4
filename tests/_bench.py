"""The benchmark scripts as modules: tests drive the same code a user runs from ``benchmarks/``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_bench(name: str, *, needs_mosquitto: bool = False) -> ModuleType:
    """``benchmarks/<name>.py`` imported once per session (as ``<name>_bench``); skips the test when the
    script's field runs need a Mosquitto binary and the machine has none."""
    key = f"{name}_bench"
    mod = sys.modules.get(key)
    if mod is None:
        spec = importlib.util.spec_from_file_location(key, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[key] = mod  # dataclasses in the script look their module up here
        spec.loader.exec_module(mod)
    if needs_mosquitto and getattr(mod, "MOSQUITTO", None) is None:
        pytest.skip("no mosquitto binary (apt-get install mosquitto): the field run needs a real broker")
    return mod
