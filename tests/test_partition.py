"""Client partitions: disjoint, covering, as skewed as alpha says, reproducible, and strict about arguments."""

from __future__ import annotations

import numpy as np
import pytest

from fedsga_edge.data import partition

LABELS = np.random.default_rng(7).permutation(np.repeat(np.arange(10), 100))  # 1000 samples, 10 classes
DOMAINS = np.arange(1000) % 3


def _mean_label_entropy(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    entropies = []
    for part in parts:
        p = np.bincount(labels[part], minlength=10) / len(part)
        p = p[p > 0]
        entropies.append(float(-(p * np.log(p)).sum()))
    return float(np.mean(entropies))


@pytest.mark.parametrize(
    ("scheme", "num_clients"),
    [(scheme, n) for scheme in ("iid", "dirichlet", "domain", "mixed") for n in (1, 7, 20) if (scheme, n) != ("domain", 1)],
)
def test_parts_are_disjoint_cover_everything_and_respect_min_samples(scheme: str, num_clients: int) -> None:
    parts = partition(LABELS, num_clients, scheme, domains=DOMAINS, min_samples=5)
    assert len(parts) == num_clients
    assert all(part.dtype == np.int64 and np.all(np.diff(part) > 0) for part in parts)  # sorted, no repeats
    joined = np.concatenate(parts)
    assert len(joined) == len(LABELS) and np.array_equal(np.sort(joined), np.arange(len(LABELS)))
    assert min(len(part) for part in parts) >= 5


def test_iid_sizes_differ_by_at_most_one_and_mix_labels() -> None:
    parts = partition(LABELS, 7, "iid")
    sizes = [len(part) for part in parts]
    assert max(sizes) - min(sizes) <= 1
    assert _mean_label_entropy(LABELS, parts) > 0.95 * np.log(10)


def test_small_alpha_skews_labels_more_than_large_alpha() -> None:
    skewed = _mean_label_entropy(LABELS, partition(LABELS, 10, "dirichlet", alpha=0.1))
    mixed = _mean_label_entropy(LABELS, partition(LABELS, 10, "dirichlet", alpha=100))
    assert skewed < 0.6 * np.log(10) and mixed > 0.95 * np.log(10)


def test_min_samples_is_honoured_under_heavy_skew() -> None:
    unconstrained = partition(LABELS, 20, "dirichlet", alpha=0.1, min_samples=0)
    assert min(len(part) for part in unconstrained) < 10  # a single draw starves some client...
    parts = partition(LABELS, 20, "dirichlet", alpha=0.1, min_samples=10)
    assert min(len(part) for part in parts) >= 10  # ...so the floor comes from redrawing


def test_unreachable_min_samples_stops_with_a_clear_error() -> None:
    one_class = np.zeros(1000, dtype=np.int64)  # one class, tiny alpha: one client takes nearly all
    with pytest.raises(ValueError, match=r">= 19 samples in 1000 draws; lower min_samples"):
        partition(one_class, 50, "dirichlet", alpha=0.01, min_samples=19)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "domain", "mixed"])
def test_same_seed_same_partition_other_seed_other_partition(scheme: str) -> None:
    def run(seed: int) -> list[np.ndarray]:
        return partition(LABELS, 6, scheme, seed=seed, domains=DOMAINS)

    assert all(np.array_equal(a, b) for a, b in zip(run(3), run(3)))
    assert not all(np.array_equal(a, b) for a, b in zip(run(3), run(4)))


def test_mixed_fleet_has_iid_devices_at_even_positions_and_skewed_ones_at_odd() -> None:
    parts = partition(LABELS, 10, "mixed", alpha=0.05, seed=1)
    iid, skewed = parts[0::2], parts[1::2]
    assert _mean_label_entropy(LABELS, iid) > 0.95 * np.log(10)
    assert _mean_label_entropy(LABELS, skewed) < 0.5 * np.log(10)
    assert max(map(len, iid)) - min(map(len, iid)) <= 1 and sum(map(len, iid)) == 500  # half the fleet, half the data
    # the skewed half is as skewed as a Dirichlet fleet of its own at that alpha, not an IID one
    assert _mean_label_entropy(LABELS, skewed) < 0.8 * _mean_label_entropy(LABELS, partition(LABELS, 5, "iid"))


def test_domain_scheme_keeps_each_client_inside_one_domain() -> None:
    domains = np.where(np.arange(1000) < 500, 4, np.where(np.arange(1000) < 800, 1, 9))  # unequal sizes, sparse ids
    parts = partition(LABELS, 8, "domain", domains=domains, alpha=0.5)
    served = [set(domains[part].tolist()) for part in parts]
    assert all(len(s) == 1 for s in served)
    clients_per_domain = np.bincount([s.pop() for s in served], minlength=10)[[1, 4, 9]]
    assert sorted(clients_per_domain.tolist()) == [2, 3, 3]  # floor / ceil of 8 / 3


@pytest.mark.parametrize(
    ("kwargs", "problem"),
    [
        ({"num_clients": 0}, "num_clients must be an int >= 1"),
        ({"num_clients": 2.5}, "num_clients must be an int >= 1"),
        ({"num_clients": 1001}, "more than the 1000 samples"),
        ({"num_clients": 5, "alpha": 0.0}, "alpha must be > 0"),
        ({"num_clients": 5, "alpha": -1.0}, "alpha must be > 0"),
        (
            {"num_clients": 5, "scheme": "pathological"},
            "unknown partition scheme 'pathological'; use one of iid, dirichlet, domain",
        ),
        ({"num_clients": 5, "min_samples": 201}, "needs more than the 1000 samples"),
        ({"num_clients": 5, "min_samples": -1}, "min_samples must be >= 0"),
        ({"num_clients": 5, "scheme": "domain"}, "needs domains"),
        ({"num_clients": 2, "scheme": "domain", "domains": DOMAINS}, "num_clients >= the 3 domains"),
        ({"num_clients": 5, "scheme": "domain", "domains": DOMAINS[:10]}, "domains must match"),
    ],
)
def test_bad_arguments_raise_value_error(kwargs: dict[str, object], problem: str) -> None:
    with pytest.raises(ValueError, match=problem.replace("(", r"\(")):
        partition(LABELS, **kwargs)  # type: ignore[arg-type]


def test_labels_must_be_integer_vector() -> None:
    with pytest.raises(ValueError, match="1-D integer"):
        partition(LABELS.astype(float), 2)
