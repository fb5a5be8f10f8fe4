"""Splitting a train set's indices among federated clients (IID, label-skewed, domain-skewed, or a mixed fleet)."""

from __future__ import annotations

import numpy as np

SCHEMES: tuple[str, ...] = ("iid", "dirichlet", "domain", "mixed")
# Redraws allowed before a min_samples request is declared unattainable; feasible requests
# (e.g. alpha=0.1, 20 clients, a few thousand samples) succeed within a handful.
MAX_DRAWS = 1000


def partition(
    labels: np.ndarray,
    num_clients: int,
    scheme: str = "iid",
    *,
    alpha: float = 0.1,
    seed: int = 0,
    min_samples: int = 10,
    domains: np.ndarray | None = None,
) -> list[np.ndarray]:
    """Returns one sorted int64 index array per client; together they are disjoint and cover all samples.

    - ``iid``: a seeded shuffle cut into near-equal parts (sizes differ by at most one).
    - ``dirichlet``: per class, client shares ~ Dir(alpha) (Hsu et al., 2019); small alpha gives
      clients few classes. The whole draw is repeated until every client holds ``min_samples``.
    - ``domain``: client c serves the c-th domain round-robin (sorted domain ids), so each domain
      has floor or ceil of num_clients / D clients; a domain's samples are split among its clients
      by the Dirichlet scheme above.
    - ``mixed``: one fleet of near-IID and heavily label-skewed devices, where a per-device split depth
      has the most to say: the devices at even positions (client-000, -002, ...) share a seeded random
      half of the samples equally (IID shares), those at odd positions split the rest by the Dirichlet
      scheme above (a small ``alpha``, e.g. 0.05, leaves each a few classes).

    ``min_samples`` is a floor for every scheme (0 disables it). The same arguments and seed
    always give the same partition. Bad arguments raise ValueError.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or (labels.size and not np.issubdtype(labels.dtype, np.integer)):
        raise ValueError(f"labels must be a 1-D integer array, got {labels.dtype} {labels.shape}")
    total = len(labels)
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ValueError(f"num_clients must be an int >= 1, got {num_clients!r}")
    if num_clients > total:
        raise ValueError(f"num_clients={num_clients} is more than the {total} samples to share")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha!r}")
    if min_samples < 0:
        raise ValueError(f"min_samples must be >= 0, got {min_samples!r}")
    if num_clients * min_samples > total:
        raise ValueError(f"{num_clients} clients x min_samples={min_samples} needs more than the {total} samples")
    if scheme not in SCHEMES:
        raise ValueError(f"unknown partition scheme {scheme!r}; use one of {', '.join(SCHEMES)}")

    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = np.array_split(rng.permutation(total), num_clients)
    elif scheme == "dirichlet":
        parts = _dirichlet(labels, np.arange(total), num_clients, alpha, min_samples, rng)
    elif scheme == "mixed":
        parts = _mixed(labels, num_clients, alpha, min_samples, rng)
    else:
        parts = _by_domain(labels, domains, num_clients, alpha, min_samples, rng)
    return [np.sort(part).astype(np.int64) for part in parts]


def _dirichlet(
    labels: np.ndarray, members: np.ndarray, num_clients: int, alpha: float, min_samples: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Splits ``members`` (indices whose labels are ``labels``) by per-class Dir(alpha) shares."""
    by_class = [members[labels == label] for label in np.unique(labels)]
    for _ in range(MAX_DRAWS):
        shards: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for indices in by_class:
            shuffled = rng.permutation(indices)
            shares = rng.dirichlet(np.full(num_clients, alpha))
            cuts = (np.cumsum(shares)[:-1] * len(shuffled)).astype(np.int64)
            for shard, piece in zip(shards, np.split(shuffled, cuts)):
                shard.append(piece)
        parts = [np.concatenate(shard) for shard in shards]
        if min(len(part) for part in parts) >= min_samples:
            return parts
    raise ValueError(
        f"no Dirichlet(alpha={alpha}) split of {len(members)} samples gave all {num_clients} clients "
        f">= {min_samples} samples in {MAX_DRAWS} draws; lower min_samples or num_clients, or raise alpha"
    )


def _mixed(labels: np.ndarray, num_clients: int, alpha: float, min_samples: int,
           rng: np.random.Generator) -> list[np.ndarray]:
    """Even positions: equal IID shares of a random ~half of the samples; odd positions: Dir(alpha) of the rest."""
    total, iid_clients = len(labels), range(0, num_clients, 2)
    order = rng.permutation(total)
    cut = round(total * len(iid_clients) / num_clients)  # the IID devices' samples: their share of the fleet
    iid_parts = np.array_split(order[:cut], len(iid_clients))
    if min(len(part) for part in iid_parts) < min_samples:
        raise ValueError(f"the mixed partition's IID shares of {total} samples fall under min_samples={min_samples}")
    rest = order[cut:]
    skewed = _dirichlet(labels[rest], rest, num_clients // 2, alpha, min_samples, rng) if num_clients > 1 else []
    parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_clients
    for client, part in zip(iid_clients, iid_parts):
        parts[client] = part
    for client, part in zip(range(1, num_clients, 2), skewed):
        parts[client] = part
    return parts


def _by_domain(
    labels: np.ndarray,
    domains: np.ndarray | None,
    num_clients: int,
    alpha: float,
    min_samples: int,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    if domains is None:
        raise ValueError("scheme='domain' needs domains: one domain id per sample")
    domains = np.asarray(domains)
    if domains.shape != labels.shape:
        raise ValueError(f"domains must match labels' shape {labels.shape}, got {domains.shape}")
    domain_ids = np.unique(domains)
    if num_clients < len(domain_ids):
        raise ValueError(f"scheme='domain' needs num_clients >= the {len(domain_ids)} domains, got {num_clients}")
    parts: list[np.ndarray] = [np.empty(0, dtype=np.int64)] * num_clients
    for position, domain in enumerate(domain_ids):
        clients = range(position, num_clients, len(domain_ids))
        members = np.flatnonzero(domains == domain)
        if len(members) < len(clients) * max(min_samples, 1):
            raise ValueError(
                f"domain {domain} has {len(members)} samples, too few for {len(clients)} clients "
                f"with min_samples={min_samples}"
            )
        for client, part in zip(clients, _dirichlet(labels[members], members, len(clients), alpha, min_samples, rng)):
            parts[client] = part
    return parts
