import math
from fractions import Fraction

import pytest

from fedsga_edge.method import reference_index, split_index, sufficiency_label


def _exact(i: int, K: int, rho: str) -> int:
    return min(K, max(1, math.ceil(K * (1 - Fraction(i, 100) + Fraction(rho)))))


def test_split_index_matches_exact_formula_on_grid():
    # the grid contains K=5, r=0.7, rho=0.3, where float gives 3.0000000000000004
    for K in range(1, 7):
        for rho in ("0", "0.1", "0.3"):
            for i in range(101):
                assert split_index(i / 100, K, float(rho)) == _exact(i, K, rho), (K, rho, i)


def test_split_index_examples_and_validation():
    assert split_index(1.0, 3, 0.1) == 1  # confident: shallowest
    assert split_index(0.0, 3, 0.1) == 3  # clipped to K
    assert split_index(0.7, 3, 0.1) == 2  # ceil(1.2)
    for bad in (-0.1, 1.1, float("nan")):
        with pytest.raises(ValueError):
            split_index(bad, 3)
    with pytest.raises(ValueError):
        split_index(0.5, 0)


def test_reference_index():
    assert [reference_index(K) for K in range(1, 7)] == [1, 1, 2, 2, 3, 3]


def test_sufficiency_label():
    assert sufficiency_label(1.04, 1.0, beta=0.05) == 1
    assert sufficiency_label(1.06, 1.0, beta=0.05) == 0
    assert sufficiency_label(0.5, 1.0, beta=0.0) == 1
    assert sufficiency_label(float("nan"), 1.0) == 0
