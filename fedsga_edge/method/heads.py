"""The two small heads a device evaluates each round, in numpy: phi_s (Eq. 3) and Gamma (Eq. 6).

The coordinator trains both (torch modules ``ShallowHead`` and ``MonotoneEstimator``) and sends
their weights in every FedSGA round start; the device only runs them forward, once per round, on
a handful of vectors. A numpy forward lets the torch-free device (onnxruntime + numpy) run FedSGA
itself, and the torch device uses the same code, so both choose the same split. Tests pin these
to the torch modules (tests/test_method_heads.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .adaptation import _array

__all__ = ["HeadError", "estimate", "shallow_head"]


class HeadError(ValueError):
    """The weights sent for a head do not have the keys or shapes that head needs."""


def _get(state: Mapping[str, Any], key: str, ndim: int, head: str) -> np.ndarray:
    if key not in state:
        raise HeadError(f"{head} weights lack {key!r} (have {sorted(state)[:6]})")
    a = _array(state[key]).astype(np.float64)
    if a.ndim != ndim or not np.isfinite(a).all():
        raise HeadError(f"{head} weight {key!r}: expected a finite {ndim}-d array, got shape {a.shape}")
    return a


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def shallow_head(state: Mapping[str, Any], pooled: Any) -> np.ndarray:
    """phi_s: Linear-ReLU-Linear, (B, in_dim) -> (B, proto_dim), from ShallowHead's state dict."""
    w1, b1 = _get(state, "net.0.weight", 2, "phi_s"), _get(state, "net.0.bias", 1, "phi_s")
    w2, b2 = _get(state, "net.2.weight", 2, "phi_s"), _get(state, "net.2.bias", 1, "phi_s")
    x = _array(pooled).astype(np.float64)
    if x.ndim != 2 or x.shape[1] != w1.shape[1] or w1.shape[0] != b1.shape[0] or w2.shape[1] != w1.shape[0] \
            or w2.shape[0] != b2.shape[0]:
        raise HeadError(f"phi_s weights {w1.shape}/{w2.shape} do not fit features of shape {x.shape}")
    return np.maximum(x @ w1.T + b1, 0.0) @ w2.T + b2


def estimate(state: Mapping[str, Any], obs: Any, r_prev: float) -> float:
    """Gamma(o, r_prev) in [0, 1] for one observation, from MonotoneEstimator's state dict.

    The same arithmetic as the torch module: inputs [o * sign / scale, r_prev], softplus weights
    (monotone by construction), tanh, then a sigmoid.
    """
    o = _array(obs).astype(np.float64).reshape(-1)
    sign, scale = _get(state, "obs_sign", 1, "estimator"), _get(state, "obs_scale", 1, "estimator")
    w1, b1 = _get(state, "w1_raw", 2, "estimator"), _get(state, "b1", 1, "estimator")
    w2, b2 = _get(state, "w2_raw", 1, "estimator"), _get(state, "b2", 0, "estimator")
    if not (len(o) == len(sign) == len(scale) and w1.shape == (len(b1), len(o) + 1) and w2.shape == b1.shape):
        raise HeadError(f"estimator weights (w1 {w1.shape}, sign {sign.shape}) do not fit an observation of {len(o)}")
    if not np.isfinite(o).all() or not np.isfinite(r_prev):
        raise HeadError("observation and r_prev must be finite")
    x = np.concatenate([o * sign / scale, [float(r_prev)]])
    h = np.tanh(_softplus(w1) @ x + b1)
    logit = float(h @ _softplus(w2) + b2)
    return float(1.0 / (1.0 + np.exp(-logit)))
