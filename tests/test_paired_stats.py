"""benchmarks/accuracy.py's paired comparison with static at p_ref and its headline window."""

from __future__ import annotations

import math

import pytest
from _bench import load_bench


@pytest.fixture(scope="module")
def bench():
    return load_bench("accuracy")


def _runs(method: str, accs: dict[int, float], flops: float = 100.0) -> list[dict]:
    return [{"method": method, "partition": "dir0.1", "seed": seed,
             "summary": {"final_acc": a, "headline_acc": a, "client_flops_per_sample": flops, "client_params": 1000,
                         "split_histogram": {"2": 1}, "wall_s": 1.0, "bytes_total": 1}}
            for seed, a in accs.items()]


def test_paired_difference_pairs_by_seed_with_standard_error_and_wins(bench):
    g = bench._group(_runs("static", {0: 0.50, 1: 0.40, 2: 0.60}) + _runs("fedsga", {2: 0.62, 0: 0.55, 1: 0.38, 7: 0.9}))
    pr = bench.paired(g[("fedsga", "dir0.1")], g[("static", "dir0.1")])
    diffs = [0.05, -0.02, 0.02]  # seed 7 has no static run: it is not paired
    mean = sum(diffs) / 3
    se = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 2) / math.sqrt(3)
    assert pr["n"] == 3 and pr["wins"] == 2
    assert pr["mean"] == pytest.approx(mean) and pr["se"] == pytest.approx(se)
    # unpaired means would differ: the table's Δ is not mean(fedsga) - mean(static)
    assert abs(pr["mean"] - (sum([0.62, 0.55, 0.38, 0.9]) / 4 - 0.5)) > 0.05


def test_tables_show_the_paired_column_and_flops_ratio(bench):
    runs = _runs("static", {0: 0.50, 1: 0.40}) + _runs("fedsga", {0: 0.55, 1: 0.44}, flops=80.0)
    md = bench.tables(runs, ["dir0.1"], ["static", "fedsga"])
    row = next(line for line in md.split("**Table 2")[1].splitlines() if line.startswith("| **FedSGA**"))
    assert "+4.50 ± 0.50 (2/2)" in row
    vs = md.split("**FedSGA vs static")[1]
    assert "0.80 ± 0.00" in vs


def test_headline_window_averages_the_last_full_evaluations(bench):
    p = bench.Preset(data="digits", eval_every=2, last_evals=3)
    assert bench.headline_rounds(10, p) == [6, 8, 10]
    assert bench.headline_rounds(3, bench.Preset(data="digits", eval_every=5, last_evals=3)) == [3]
    records = [{"round": t, "test_acc_full": 0.1 * t} for t in range(1, 10)] + [{"round": 10, "test_acc": 0.5}]
    h = bench.headline(records, [6, 8, 10])
    assert h["headline_acc"] == pytest.approx((0.6 + 0.8 + 0.5) / 3)
    assert "headline_acc_depth_mean" not in h  # one head: no depth-mean figure
    for r in records:  # several depth heads: the same window of their averaged-softmax figure, beside the headline
        r["test_acc_depth_mean" if "test_acc" in r else "test_acc_depth_mean_full"] = 0.05 * r["round"]
    h = bench.headline(records, [6, 8, 10])
    assert h["headline_acc_depth_mean"] == pytest.approx(0.05 * 8) and h["headline_acc"] == pytest.approx(0.6333, abs=1e-4)
    records[-1].pop("test_acc_depth_mean")  # a window with a round missing the figure has none
    assert "headline_acc_depth_mean" not in bench.headline(records, [6, 8, 10])
