"""Cuts in fixed phases over rounds (coordinator/strategies/phased.py): which cut each round gets, named as the
benchmark names it."""

from __future__ import annotations

import json

import pytest
from _runs import tiny_config

from fedsga_edge.coordinator.strategies.phased import Phased, parse_phases
from fedsga_edge.coordinator.strategy import all_methods, create_strategy
from fedsga_edge.options import override
from fedsga_edge.simulation import run_simulation

CLIENTS = [f"client-{i:03d}" for i in range(4)]


@pytest.mark.parametrize("spec, phases", [("ref:5,K", [(2, 5), (4, None)]), ("K:9, ref", [(4, 9), (2, None)]),
                                          ("1:2,3:1,ref", [(1, 2), (3, 1), (2, None)])])
def test_phases_are_read_by_index_or_name(spec: str, phases: list) -> None:
    assert parse_phases(spec, 4) == phases


@pytest.mark.parametrize("spec, message", [
    ("K", "two or more entries"), ("ref:5,K:3", "the last entry holds to the run's end"),
    ("ref,K", "'ref' needs a round count"), ("ref:0,K", "for 0 rounds"), ("deep:2,K", "'deep' is not a cut"),
    ("5:2,1", "cut 5 is outside 1..4"), ("ref:two,K", "'ref:two' needs a round count")])
def test_a_bad_phase_list_is_refused_by_name(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_phases(spec, 4)


def _phased(cuts: str) -> Phased:
    cfg = tiny_config("phased", strategy_args={"cuts": cuts})
    return create_strategy(cfg, 4, CLIENTS, {k: 1 for k in range(1, 5)})  # type: ignore[return-value]


def test_every_device_takes_the_cut_of_the_rounds_phase() -> None:
    st = _phased("1:2,3:1,ref")
    assert [st.cut_at(t) for t in range(1, 7)] == [1, 1, 3, 2, 2, 2]
    for t, cut in ((1, 1), (3, 3), (40, 2)):
        assert st.assign(t, CLIENTS + ["late"]) == dict.fromkeys(CLIENTS + ["late"], cut)


@pytest.mark.parametrize("method", [m for m, (s, _) in all_methods().items() if s == "phased"])
def test_each_benchmark_variant_is_named_back_from_its_config(method: str) -> None:
    """The benchmark sets a variant by its overrides; the run's config.json must name it the same, or its
    records would land in another row."""
    cfg = override(tiny_config("phased"), all_methods()[method][1].overrides)
    assert Phased.method_name(cfg, 3) == method


def test_a_phase_list_outside_the_variants_is_named_by_its_phases() -> None:
    cfg = tiny_config("phased", strategy_args={"cuts": "1:3,K"})
    assert Phased.method_name(cfg, 3) == "phased-1x3-3"


def test_a_simulated_run_follows_its_phases(digits, tmp_path) -> None:
    cfg = tiny_config("phased", clients=2, rounds=3, max_batches=2, strategy_args={"cuts": "K:2,1"})
    summary = run_simulation(cfg, tmp_path, bundle=digits)
    config = json.loads((tmp_path / "config.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    K = len(config["candidate_depths"])
    assert config["method"]["name"] == f"phased-{K}x2-1"
    assert [sorted(set(r["splits"].values())) for r in records] == [[K], [K], [1]] and summary["failures"] == 0
