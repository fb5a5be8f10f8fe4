"""The static frontier (fedsga_edge/report/frontier.py): the upper envelope of fixed cuts and mixes of cuts."""

from __future__ import annotations

import json
import math

import pytest

from fedsga_edge.report.frontier import Point, distance, envelope, frontier_at, paired_distance

P1, PREF, PK = Point(10.0, 0.30, "p1"), Point(20.0, 0.28, "pref"), Point(40.0, 0.34, "pK")


def test_a_dominated_cut_never_shapes_the_frontier():
    # p_ref costs more than p_1 and is less accurate: the frontier runs from p_1 straight to p_K
    assert [p.name for p in envelope([PK, PREF, P1])] == ["p1", "pK"]
    assert frontier_at([P1, PREF, PK], 20.0) == pytest.approx(0.30 + (0.34 - 0.30) * (20 - 10) / (40 - 10))
    # a cut under the line between two others is not a vertex either (a mix of those two beats it)
    under = Point(25.0, 0.31, "under")
    assert [p.name for p in envelope([P1, under, PK])] == ["p1", "pK"]


def test_a_mix_of_two_cuts_reaches_the_line_between_them():
    assert frontier_at([P1, PK], 25.0) == pytest.approx(0.32)
    assert frontier_at([P1, PK], 10.0) == pytest.approx(0.30)
    assert distance([P1, PK], 25.0, 0.335) == pytest.approx(0.015)
    assert distance([P1, PK], 25.0, 0.30) == pytest.approx(-0.02)


def test_a_line_between_two_dominated_cuts_is_not_the_frontier():
    # b and c are both dominated by a (cheaper and more accurate): their line, 0.21 at 25, is not the frontier
    a, b, c = Point(10.0, 0.40), Point(20.0, 0.20), Point(30.0, 0.22)
    assert frontier_at([a, b, c], 25.0) == pytest.approx(0.40)
    assert distance([a, b, c], 25.0, 0.25) == pytest.approx(-0.15)


def test_beyond_the_deepest_cut_the_frontier_stays_at_its_best():
    assert frontier_at([P1, PREF, PK], 100.0) == pytest.approx(0.34)
    # the best cut is not the deepest: past it the frontier is flat at its accuracy
    assert frontier_at([Point(10.0, 0.30), Point(20.0, 0.36), Point(40.0, 0.33)], 35.0) == pytest.approx(0.36)


def test_below_the_cheapest_cut_there_is_nothing_to_compare_with():
    assert frontier_at([P1, PK], 9.99) is None
    assert distance([P1, PK], 5.0, 0.9) is None


def test_equal_cost_keeps_the_better_cut_and_bad_points_are_refused():
    assert [p.acc for p in envelope([Point(10.0, 0.2), Point(10.0, 0.3)])] == [0.3]
    with pytest.raises(ValueError, match="at least one"):
        envelope([])
    with pytest.raises(ValueError, match="finite"):
        envelope([Point(float("nan"), 0.3)])


def test_paired_distance_uses_each_seeds_own_frontier():
    cuts = {0: [Point(10.0, 0.30), Point(30.0, 0.40)], 1: [Point(10.0, 0.20), Point(30.0, 0.50)],
            2: [Point(10.0, 0.25)]}
    method = {0: Point(20.0, 0.37), 1: Point(20.0, 0.33), 2: Point(5.0, 0.9), 9: Point(20.0, 0.99)}
    pr = paired_distance(cuts, method)
    diffs = [0.37 - 0.35, 0.33 - 0.35]  # seed 2: cheaper than its only cut; seed 9: no cuts
    mean = sum(diffs) / 2
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs)) / math.sqrt(2)
    assert pr["n"] == 2 and pr["wins"] == 1 and pr["below_cheapest"] == [2]
    assert pr["mean"] == pytest.approx(mean) and pr["se"] == pytest.approx(se)
    assert paired_distance(cuts, {9: Point(20.0, 0.5)}) is None


def _runs(method: str, flops: float, accs: dict[int, float]) -> list[dict]:
    return [{"method": method, "partition": "dir0.1", "seed": seed,
             "summary": {"final_acc": a, "headline_acc": a, "client_flops_per_sample": flops, "client_params": 1000,
                         "split_histogram": {"2": 1}, "wall_s": 1.0, "bytes_total": 1}}
            for seed, a in accs.items()]


def test_the_benchmark_tables_the_frontier_when_the_records_hold_the_cuts_and_an_adaptive_method():
    from _bench import load_bench

    bench = load_bench("accuracy")
    methods = ["static-p1", "static", "static-pK", "fedsga", "random"]
    cuts = (_runs("static-p1", 10e6, {0: 0.30, 1: 0.32}) + _runs("static", 20e6, {0: 0.28, 1: 0.29})
            + _runs("static-pK", 40e6, {0: 0.34, 1: 0.38}))
    md = bench.tables(cuts + _runs("fedsga", 25e6, {0: 0.335, 1: 0.36}), ["dir0.1"], methods)
    table = md.split("**The static frontier under Dirichlet(0.1)**")[1]
    row = next(line for line in table.splitlines() if line.startswith("| **FedSGA**"))
    # seed 0: frontier 0.32 at 25 MFLOPs (p_1 to p_K; p_ref dominated), +1.5; seed 1: 0.35, +1.0
    assert "| 25.00 |" in row and "+1.25 ± 0.25 (2/2)" in row
    ref = next(line for line in table.splitlines() if line.startswith("| Static at p_ref"))
    assert "-4.17 ± 0.83 (0/2)" in ref  # the dominated cut sits under the frontier: -3.33 and -5.00
    # no adaptive method, or a single cut: no frontier table
    assert "static frontier" not in bench.tables(cuts, ["dir0.1"], methods)
    assert "static frontier" not in bench.tables(_runs("static", 20e6, {0: 0.3}) + _runs("random", 2e6, {0: 0.3}),
                                                 ["dir0.1"], methods)


def test_the_report_draws_the_frontier_with_each_adaptive_methods_paired_distance(tmp_path):
    from test_report import write_run

    from fedsga_edge.report import discover
    from fedsga_edge.report import plots as P
    from fedsga_edge.report.frontier import frontier_groups
    from fedsga_edge.report.sections import Inputs, frontier

    root = tmp_path / "bench"
    for seed, (a1, aref, aK, afed) in enumerate([(0.30, 0.28, 0.34, 0.335), (0.32, 0.29, 0.38, 0.36)]):
        write_run(root / f"static-p1/dir0.1/seed{seed}", "static", seed, [a1], split=1, flops=10e6, partition="dirichlet")
        write_run(root / f"static/dir0.1/seed{seed}", "static", seed, [aref], split=2, flops=20e6, partition="dirichlet")
        write_run(root / f"static-pK/dir0.1/seed{seed}", "static", seed, [aK], split=3, flops=40e6,
                  partition="dirichlet")
        write_run(root / f"fedsga/dir0.1/seed{seed}", "fedsga", seed, [afed], flops=25e6, partition="dirichlet")
    write_run(root / "fedavg/dir0.1/seed0", "fedavg", 0, [0.9], flops=90e6, partition="dirichlet")  # not adaptive
    runs = discover([root])[0]
    [g] = frontier_groups(runs)
    assert g["partition"] == "dir0.1" and g["seeds"] == [0, 1]
    assert [c["method"] for c in g["cuts"]] == ["static-p1", "static", "static-pK"]
    assert [p[0] for p in g["envelope"]] == [10e6, 40e6]  # p_ref is dominated: not a vertex
    [m] = g["methods"]
    assert m["method"] == "fedsga" and m["delta"]["mean"] == pytest.approx(0.0125) and m["delta"]["wins"] == 2
    section = frontier(Inputs(runs=runs, profs=[], band="minmax"))
    assert "<td>+1.25 ± 0.25</td>" in section.section.extra_html and "<td>2/2</td>" in section.section.extra_html
    fig = P.plot_frontier(section.compute())
    assert len(fig.axes) == 1 and "fedsga +1.25 ± 0.25 (n=2)" in [t.get_text() for t in fig.axes[0].get_legend().texts]
    # many panels wrap into rows of three, the spare places left blank
    fig = P.plot_frontier(section.compute() * 4)
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert len(fig.axes) == 6 and len(shown) == 4
    rows = {round(ax.get_position().y0, 3) for ax in shown}
    cols = {round(ax.get_position().x0, 3) for ax in shown}
    assert len(rows) == 2 and len(cols) == 3
    # one cut only: nothing to draw, and the section says why
    assert frontier_groups([r for r in runs if r.method != "static-p1" and r.method != "static-pK"]) == []


def test_the_report_keeps_each_regimes_frontier_apart(tmp_path):
    """Cuts with one shared server copy never make the frontier of runs with a copy per device."""
    from test_report import write_run

    from fedsga_edge.report import discover
    from fedsga_edge.report.frontier import frontier_groups

    root = tmp_path / "bench"
    for regime, (a1, aK, afed) in (("shared", (0.2, 0.4, 0.35)), ("per_client", (0.5, 0.5, 0.4))):
        write_run(root / regime / "static-p1/seed0", "static", 0, [a1], split=1, flops=10e6)
        write_run(root / regime / "static-pK/seed0", "static", 0, [aK], split=3, flops=40e6)
        write_run(root / regime / "fedsga/seed0", "fedsga", 0, [afed], flops=25e6)
        for run in (root / regime).glob("*/seed0"):  # the regime as config.json records it
            config = json.loads((run / "config.json").read_text()) | {"server_copies": regime}
            (run / "config.json").write_text(json.dumps(config))
    groups = {g["partition"]: g for g in frontier_groups(discover([root])[0])}
    assert set(groups) == {"iid · server_copies=shared", "iid · server_copies=per_client"}
    assert groups["iid · server_copies=shared"]["methods"][0]["delta"]["mean"] == pytest.approx(0.35 - 0.3)
    assert groups["iid · server_copies=per_client"]["methods"][0]["delta"]["mean"] == pytest.approx(0.4 - 0.5)


def test_the_benchmark_tables_a_second_frontier_on_the_devices_own_data():
    """Private fronts: the test figure and the devices' own data can rank the cuts the other way round."""
    from _bench import load_bench

    bench = load_bench("accuracy")
    methods = ["static-p1", "static-pK", "fedsga"]

    def runs(method: str, flops: float, test: dict[int, float], own: dict[int, float | None]) -> list[dict]:
        out = _runs(method, flops, test)
        for r in out:
            if own.get(r["seed"]) is not None:
                r["summary"]["final_own_acc"] = own[r["seed"]]
        return out

    recs = (runs("static-p1", 10e6, {0: 0.30, 1: 0.32}, {0: 0.40, 1: 0.42})
            + runs("static-pK", 40e6, {0: 0.20, 1: 0.22}, {0: 0.60, 1: 0.62})
            + runs("fedsga", 25e6, {0: 0.31, 1: 0.33}, {0: 0.45, 1: 0.49}))
    md = bench.tables(recs, ["dir0.1"], methods)
    own = md.split("**The static frontier under Dirichlet(0.1), on the devices' own held-out data")[1]
    row = next(line for line in own.splitlines() if line.startswith("| **FedSGA**"))
    # own data: p_K is the better cut, the frontier at 25 MFLOPs is halfway: 0.50 and 0.52 -> -5.0 and -3.0
    assert "-4.00 ± 1.00 (0/2)" in row
    test = md.split("**The static frontier under Dirichlet(0.1)**")[1].split("**The static frontier")[0]
    row = next(line for line in test.splitlines() if line.startswith("| **FedSGA**"))
    assert "+1.00 ± 0.00 (2/2)" in row  # on the test set p_1 dominates: flat at 0.30 / 0.32 from 10 MFLOPs
    # a cut without the own-data figure on a seed drops that seed; none on any seed: no own-data table
    md = bench.tables(runs("static-p1", 10e6, {0: 0.3, 1: 0.3}, {0: 0.4})
                      + runs("static-pK", 40e6, {0: 0.2, 1: 0.2}, {0: 0.6, 1: 0.6})
                      + runs("fedsga", 25e6, {0: 0.3, 1: 0.3}, {0: 0.45, 1: 0.45}), ["dir0.1"], methods)
    own = md.split("own held-out data")[1]
    assert "(1 seeds with every cut)" in own
    assert "own held-out data" not in bench.tables(recs[:2] + _runs("fedsga", 25e6, {0: 0.3}), ["dir0.1"],
                                                   ["static-p1", "static-pK", "fedsga"])


def test_the_report_draws_an_own_data_frontier_apart_from_the_test_one(tmp_path):
    from test_report import write_run

    from fedsga_edge.report import discover
    from fedsga_edge.report import plots as P
    from fedsga_edge.report.frontier import frontier_groups, run_point

    root = tmp_path / "bench"
    for method, split, flops, test, own in (("static-p1", 1, 10e6, 0.30, 0.40), ("static-pK", 3, 40e6, 0.20, 0.60),
                                            ("fedsga", None, 25e6, 0.31, 0.45)):
        run = write_run(root / method / "seed0", "static" if split else "fedsga", 0, [test], split=split or 2,
                        flops=flops)
        summary = json.loads((run / "summary.json").read_text()) | {"final_own_acc": own}
        (run / "summary.json").write_text(json.dumps(summary))
        config = json.loads((run / "config.json").read_text()) | {"fronts": "private", "eval_holdout": 0.2}
        (run / "config.json").write_text(json.dumps(config))
    runs = discover([root])[0]
    groups = {g["score"]: g for g in frontier_groups(runs)}
    assert set(groups) == {"test", "own data"} and groups["own data"]["partition"] == "iid · own data"
    assert groups["test"]["methods"][0]["delta"]["mean"] == pytest.approx(0.01)
    assert groups["own data"]["methods"][0]["delta"]["mean"] == pytest.approx(0.45 - 0.50)
    assert [p[0] for p in groups["own data"]["envelope"]] == [10e6, 40e6]
    fig = P.plot_frontier(list(groups.values()))
    assert [ax.get_ylabel() for ax in fig.axes] == ["accuracy (%)", "own-data accuracy (%)"]
    with pytest.raises(ValueError, match="score"):
        run_point(runs[0], "train")
    # rows that say the test figure scored every device's whole front (untrained blocks past its split included)
    # make no test point; the own-data figure, each device's model at its split, still does
    from fedsga_edge.report.frontier import STALE_TEST_MODELS

    for run in root.glob("*/seed0"):
        rows = [json.loads(line) | {"test_model": STALE_TEST_MODELS[0]}
                for line in (run / "metrics.jsonl").read_text().splitlines()]
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    runs = discover([root])[0]
    assert [g["score"] for g in frontier_groups(runs)] == ["own data"]
    assert run_point(runs[0], "test") is None and run_point(runs[0], "own data") is not None


def test_the_frontier_plot_never_draws_two_methods_alike() -> None:
    """Methods outside the report's order take colours by position; none of them may take FedSGA's red or another's."""
    from fedsga_edge.report.plots import _distinct_colors

    methods = ["fedsga", "mix-p1-pK", "mix-pK-p1", "mix-shuffled", "random"]
    colors = _distinct_colors(methods)
    assert len(set(colors)) == len(methods) and colors[0] == "C3" and "C3" not in colors[1:]


def test_a_record_made_before_an_option_shares_the_frontier_of_runs_at_its_default(tmp_path):
    """Cuts recorded before ``--fronts`` existed trained with shared fronts: an adaptive run that records
    ``fronts=shared`` is drawn against them, one that records private fronts is not."""
    from test_report import write_run

    from fedsga_edge.report import discover
    from fedsga_edge.report.frontier import frontier_groups

    root = tmp_path / "bench"
    write_run(root / "static-p1/iid/seed0", "static", 0, [0.2], split=1, flops=10e6)  # no "fronts" in config.json
    write_run(root / "static-pK/iid/seed0", "static", 0, [0.4], split=3, flops=40e6)
    for method, fronts, acc in (("fedsga", "shared", 0.35), ("random", "private", 0.5)):
        run = write_run(root / f"{method}/iid/seed0", method, 0, [acc], flops=25e6)
        (run / "config.json").write_text(json.dumps(json.loads((run / "config.json").read_text()) | {"fronts": fronts}))
    [g] = frontier_groups(discover([root])[0])
    assert g["partition"] == "iid · fronts=shared" and [m["method"] for m in g["methods"]] == ["fedsga"]
    assert g["methods"][0]["delta"]["mean"] == pytest.approx(0.35 - 0.3)


def test_one_methods_runs_from_two_benchmark_folders_are_never_one_point(tmp_path):
    """FedSGA at its defaults beside an earlier setting's FedSGA kept under ``options/``: the same method and seed
    twice in one regime, so each benchmark folder is a frontier of its own (one without cuts draws none)."""
    from test_report import write_run

    from fedsga_edge.report import discover
    from fedsga_edge.report.frontier import frontier_groups

    root = tmp_path / "bench"
    write_run(root / "static-p1/iid/seed0", "static", 0, [0.2], split=1, flops=10e6)
    write_run(root / "static-pK/iid/seed0", "static", 0, [0.4], split=3, flops=40e6)
    write_run(root / "fedsga/iid/seed0", "fedsga", 0, [0.35], flops=25e6)
    write_run(root / "options/earlier/fedsga/iid/seed0", "fedsga", 0, [0.10], flops=25e6)
    [g] = frontier_groups(discover([root])[0])
    assert g["partition"] == "iid · bench" and g["methods"][0]["delta"]["mean"] == pytest.approx(0.35 - 0.3)
    (root / "options").rename(tmp_path / "elsewhere")  # the earlier runs alone: one folder, one frontier
    [g] = frontier_groups(discover([root])[0])
    assert g["partition"] == "iid" and g["methods"][0]["n"] == 1


def test_a_retired_test_model_is_stale_only_where_a_device_sat_below_the_deepest_cut(tmp_path):
    """Private-front rows from before each device was scored at its own split name the retired model: stale where any
    device sat below the deepest candidate split (its untrained copies past the split were scored), not where every
    device sat at it (its whole front is the model it runs). The benchmark's tables drop the stale test figures and
    keep the own-data ones, as the report does."""
    from fedsga_edge.report.frontier import STALE_TEST_MODELS, stale_test_model

    old = STALE_TEST_MODELS[0]
    config = {"candidate_depths": [2, 3, 4]}
    deep = {"round": 1, "test_acc": 0.2, "test_model": old, "depths": {"a": 4, "b": 4}}
    mixed = deep | {"round": 2, "depths": {"a": 4, "b": 2}}
    assert stale_test_model([deep], config) is None
    assert stale_test_model([deep, mixed], config) == old
    assert stale_test_model([deep], {}) == old  # no candidate depths recorded: the deepest cut is unknown
    assert stale_test_model([mixed | {"test_model": "each device at its last split"}], config) is None

    from _bench import load_bench

    bench = load_bench("accuracy")
    for name, rows in (("deep", [deep]), ("mixed", [deep, mixed])):
        run = tmp_path / name
        run.mkdir()
        (run / "config.json").write_text(json.dumps(config))
        (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    summary = {"final_acc": 0.2, "headline_acc": 0.2, "final_own_acc": 0.5}
    kept = bench.with_final_by_split(dict(summary), tmp_path / "deep")
    dropped = bench.with_final_by_split(dict(summary), tmp_path / "mixed")
    assert bench.acc_of(kept) == 0.2 and "stale_test_model" not in kept
    assert bench.acc_of(dropped) is None and dropped["stale_test_model"] == old
    assert bench.own_data_acc(dropped) == 0.5
