"""The static frontier (fedsga_edge/report/frontier.py): the upper envelope of fixed cuts and mixes of cuts."""

from __future__ import annotations

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
