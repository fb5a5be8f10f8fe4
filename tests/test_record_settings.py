"""A run record's config.json holds the run's settings; a strategy's description beside them never overwrites one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedsga_edge.config import RunConfig
from fedsga_edge.coordinator.strategy import all_methods, get_strategy


def test_a_record_whose_aggregation_holds_a_description_ran_with_the_mean() -> None:
    old = RunConfig(strategy="fedas").to_dict() | {"aggregation": "Fisher-information weights (trace, all parameters)"}
    assert RunConfig.from_record(old).aggregation == "mean"
    assert RunConfig.from_record(RunConfig(aggregation="median").to_dict()).aggregation == "median"


def test_the_benchmarks_record_check_reads_such_a_record_as_the_mean(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import accuracy
    finally:
        sys.path.pop(0)
    cfg = RunConfig(strategy="fedas")
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict() | {"aggregation": "Fisher-information weights"}))
    assert accuracy.record_differs(tmp_path, cfg) == []
    assert accuracy.record_differs(tmp_path, RunConfig(strategy="fedas", aggregation="median")) == [
        "aggregation 'mean', plan 'median'"]


@pytest.mark.parametrize("name", sorted({strategy for strategy, _ in all_methods().values()}))
def test_no_strategy_describes_itself_with_a_settings_name(name: str) -> None:
    cfg = RunConfig(strategy=name)
    try:
        strategy = get_strategy(name)(cfg, 3, ["a", "b"], {k: 1 for k in range(4)})
    except Exception as e:  # a strategy that needs more than a bare config to start (a fleet, a profile)
        pytest.skip(f"{name} needs more to construct: {e}")
    assert not set(strategy.info()) & set(cfg.to_dict())
