"""The tuning budget (benchmarks/tuning.py): the same chance for every method, the choice made from the records."""

from __future__ import annotations

import json

import pytest
from _bench import load_bench


@pytest.fixture(scope="module")
def T():
    return load_bench("tuning")


def test_every_table2_method_has_the_same_budget(T):
    A = T.A
    assert set(T.BUDGET) == set(A.TABLE2_METHODS)
    parser = A.build_parser()
    for preset in ("cifar-v1", "office-v1"):
        values = A.PRESETS[preset].settings()
        for m in A.TABLE2_METHODS:
            knobs = T.BUDGET[m]
            assert 1 <= len(knobs) <= 2 and all(2 <= len(k.settings(values)) <= 3 for k in knobs)
            budget = T.settings(m, values)
            assert budget[0] == ("preset", {}) and len(budget) <= T.MAX_SETTINGS
            assert len({name for name, _ in budget}) == len(budget)
            for name, vals in budget:  # every setting is a command line accuracy.py accepts, with that value
                args = parser.parse_args(T.accuracy_argv(preset, m, vals, [0, 1], T.tuning_dir(preset), []))
                for option, v in vals.items():
                    if v is not None:
                        assert getattr(args, option) == v
    # a rate relative to the devices': at cifar-v1 (lr 0.2) SplitFed's server rate is tried at 0.015, 0.1, 0.2
    cifar = A.PRESETS["cifar-v1"].settings()
    assert [v for _, v in T.settings("static", cifar)] == [{}, {"server_lr": 0.015}, {"server_lr": 0.1}]
    with pytest.raises(SystemExit, match="no tuning budget"):
        T.settings("random", cifar)


def test_the_choice_is_the_best_mean_of_finished_settings_only(T):
    parts, seeds = ["iid", "dir0.1"], [0, 1]
    table = {"preset": {"iid": {0: 0.50, 1: 0.52}, "dir0.1": {0: 0.30, 1: 0.32}},
             "mu0.1": {"iid": {0: 0.55, 1: 0.57}, "dir0.1": {0: 0.31, 1: 0.33}},
             "mu0.001": {"iid": {0: 0.90, 1: 0.90}, "dir0.1": {0: 0.90}}}  # best, but one run short: never chosen
    assert T.choose(table, parts, seeds) == "mu0.1"
    table["mu0.1"] = table["preset"]
    assert T.choose(table, parts, seeds) == "preset"  # a tie keeps the preset's value
    assert T.choose({"preset": {"iid": {0: 0.5}}}, parts, seeds) is None


def test_tuning_refuses_a_reported_seed(T):
    for seeds in ("10", "0,12", "3,11"):
        with pytest.raises(SystemExit, match="reported seeds"):
            T.main(["--preset", "office-v1", "--seeds", seeds, "--dry-run"])


def test_a_small_sweep_runs_records_and_chooses(T, tmp_path):
    """FedProx's three settings on digits, one tuning seed: three real runs, the choice from their records, and
    the same choice again from the records alone."""
    out = T.main(["--preset", "smoke", "--methods", "fedprox", "--seeds", "2", "--out", str(tmp_path)])
    runs = sorted(p.parent.parent.parent.parent.name for p in (tmp_path / "tuning").rglob("summary.json"))
    assert runs == ["mu0.001", "mu0.1", "preset"]
    saved = json.loads((tmp_path / "tuning" / "tuning.json").read_text())["methods"]["fedprox"]
    accs = {n: by_part["iid"]["2"] for n, by_part in saved["settings"].items()}
    assert saved["chosen"] == max(accs, key=lambda n: (accs[n], n == "preset"))
    assert "**chosen**" in out["markdown"] and out["markdown"].count("| 1/1 |") == 3
    again = T.main(["--preset", "smoke", "--methods", "fedprox", "--seeds", "2", "--out", str(tmp_path),
                    "--tables-only"])
    assert again["choice"]["fedprox"]["chosen"] == saved["chosen"]
