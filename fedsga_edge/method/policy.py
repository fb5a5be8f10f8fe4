"""Split policy and calibration target (paper §3.3, Eqs. 7-8).

Split indices are 1-based: k in 1..K selects candidate depth p_k (p_1 = shallowest).
"""

from __future__ import annotations

import math

__all__ = ["split_index", "reference_index", "sufficiency_label", "deadline_split", "CEIL_EPS"]

CEIL_EPS = 1e-9
"""Float guard for the ceiling in Eq. 8: x = K(1 - r + rho) is rounded up as ceil(x - CEIL_EPS),
so a value that is an integer n in exact arithmetic but computes as n + 1e-15 gives n, not n + 1.
Exact values within CEIL_EPS above an integer are also mapped to that integer; with r, rho given
to a few decimals and K small this never happens (such values are at least 1/100 away)."""


def split_index(r: float, K: int, rho: float = 0.1) -> int:
    """Eq. 8: k = min(K, max(1, ceil(K (1 - r + rho)))) — higher sufficiency r, shallower split."""
    if K < 1:
        raise ValueError("K must be >= 1")
    if not 0.0 <= r <= 1.0:  # also rejects NaN
        raise ValueError(f"r must lie in [0, 1], got {r}")
    if not math.isfinite(rho):
        raise ValueError(f"rho must be finite, got {rho}")
    k = math.ceil(K * (1.0 - r + rho) - CEIL_EPS)
    return min(K, max(1, k))


def reference_index(K: int) -> int:
    """p_ref's index: the middle candidate ceil(K / 2), fixed for every client and round (§4.1.3)."""
    if K < 1:
        raise ValueError("K must be >= 1")
    return (K + 1) // 2


def sufficiency_label(L1: float, Lref: float, beta: float = 0.05) -> int:
    """Eq. 7: s = 1[L1 <= (1 + beta) Lref] — the shallow split's probe loss is within beta of p_ref's.

    A NaN loss gives 0 (not sufficient).
    """
    return int(L1 <= (1.0 + beta) * Lref)


def deadline_split(k: int, split_s: list[float], deadline_s: float, floor: int = 1) -> int:
    """The deadline-aware variant of the policy (``--deadline-aware``, beyond the paper; docs/fleet.md): the
    split nearest the policy's ``k`` among those whose predicted round seconds on this device
    (``split_s[j - 1]`` for split j) fit ``deadline_s``, preferring splits >= ``floor`` (p_ref on a
    calibration round) and, between two equally near, the shallower (fewer client FLOPs). Never a split
    predicted to miss the deadline while one fits; when none fits, the fastest.

    Raises ValueError for a malformed prediction (it comes from the coordinator)."""
    K = len(split_s)
    if K < 1 or not 1 <= k <= K or not 1 <= floor <= K:
        raise ValueError(f"split {k} / floor {floor} not in 1..{K} predicted splits")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
               for v in split_s):
        raise ValueError("predicted split seconds must be finite numbers >= 0")
    if not isinstance(deadline_s, (int, float)) or isinstance(deadline_s, bool) or not math.isfinite(deadline_s) \
            or deadline_s <= 0:
        raise ValueError(f"deadline must be a finite number of seconds > 0 (got {deadline_s!r})")
    fits = [j for j in range(1, K + 1) if split_s[j - 1] <= deadline_s]
    if not fits:
        return min(range(1, K + 1), key=lambda j: (split_s[j - 1], j))
    pool = [j for j in fits if j >= floor] or fits
    return min(pool, key=lambda j: (abs(j - k), j))
