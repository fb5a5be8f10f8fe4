"""The fixed mix of cuts (coordinator/strategies/mix.py): which device keeps which cut, named as the benchmark names it."""

from __future__ import annotations

import json

import pytest
from _runs import tiny_config

from fedsga_edge.coordinator.strategies.mix import Mix, parse_cuts
from fedsga_edge.coordinator.strategy import all_methods, create_strategy
from fedsga_edge.options import override
from fedsga_edge.simulation import run_simulation

CLIENTS = [f"client-{i:03d}" for i in range(10)]


@pytest.mark.parametrize("spec, cuts", [("1,K", [1, 4]), ("K,1", [4, 1]), ("1,ref,K", [1, 2, 4]), ("2, 3", [2, 3])])
def test_cuts_are_read_by_index_or_name(spec: str, cuts: list[int]) -> None:
    assert parse_cuts(spec, 4) == cuts


@pytest.mark.parametrize("spec, message", [("1,5", "cut 5 is outside 1..4"), ("1,deep", "'deep' is not a cut"),
                                           ("K", "two or more cuts"), ("0,1", "cut 0 is outside")])
def test_a_bad_cut_list_is_refused_by_name(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_cuts(spec, 4)


def _mix(seed: int = 0, **args: str) -> Mix:
    cfg = tiny_config("mix", seed=seed, strategy_args=args)
    return create_strategy(cfg, 4, CLIENTS, {k: 1 for k in range(1, 5)})  # type: ignore[return-value]


def test_fleet_order_puts_the_mixed_partitions_iid_devices_at_the_first_cut() -> None:
    """Under --partition mixed the even devices hold the IID shares: ``1,K`` keeps each of them at p_1 all run."""
    mix = _mix(cuts="1,K")
    for t in (1, 2, 7):
        splits = mix.assign(t, CLIENTS)
        assert [splits[c] for c in CLIENTS] == [1, 4] * 5
    assert [_mix(cuts="K,1").assign(1, CLIENTS)[c] for c in CLIENTS] == [4, 1] * 5


def test_a_shuffled_mix_is_half_and_half_fixed_for_the_run_and_drawn_by_seed() -> None:
    draws = []
    for seed in (0, 1, 2):
        mix = _mix(seed, cuts="1,K", order="shuffled")
        first = mix.assign(1, CLIENTS)
        assert sorted(first.values()) == [1] * 5 + [4] * 5
        assert mix.assign(9, CLIENTS[::-1]) == first  # the same cut every round, whatever the order asked in
        assert _mix(seed, cuts="1,K", order="shuffled").assign(1, CLIENTS) == first  # the seed decides it
        draws.append(tuple(first[c] for c in CLIENTS))
    assert len(set(draws)) > 1


def test_a_device_that_joins_later_takes_the_next_cut_in_turn() -> None:
    mix = _mix(cuts="1,ref,K")
    mix.assign(1, CLIENTS)  # ten devices: the next in turn is the 11th, cut index 10 mod 3 = 1 (p_ref = 2)
    assert mix.assign(2, ["late-a", "late-b"]) == {"late-a": 2, "late-b": 4}


@pytest.mark.parametrize("method", [m for m, (s, _) in all_methods().items() if s == "mix"])
def test_each_benchmark_variant_is_named_back_from_its_config(method: str) -> None:
    """The benchmark sets a variant by its overrides; the run's config.json must name it the same, or its
    records would land in another row."""
    cfg = override(tiny_config("mix"), all_methods()[method][1].overrides)
    assert Mix.method_name(cfg, 4) == method


def test_a_simulated_mix_trains_each_device_at_its_cut(digits, tmp_path) -> None:
    cfg = tiny_config("mix", clients=4, rounds=2, max_batches=2, partition="mixed", alpha=0.5,
                      strategy_args={"cuts": "K,1"})
    summary = run_simulation(cfg, tmp_path, bundle=digits)
    config = json.loads((tmp_path / "config.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    K = len(config["candidate_depths"])
    assert config["method"]["name"] == "mix-pK-p1" and config["cut_of"] == {c: [K, 1][i % 2] for i, c in
                                                                              enumerate(sorted(config["cut_of"]))}
    assert all(r["splits"] == config["cut_of"] for r in records) and summary["failures"] == 0
