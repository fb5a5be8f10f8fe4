"""Sufficiency observation o = [a, delta, q] of the shallow interface p_1 (paper §3.3, Eqs. 3-5).

- a (Eq. 3): mean cosine between phi_s(hbar(x)) and last round's prototype of x's class —
  is the shallow interface already consistent with the cross-client class geometry?
- delta (Eq. 4): ||H^t - H^{t-1}||_2 with H = batch mean of hbar — is the interface still moving?
- q (Eq. 5): ||sum_k alpha_k (e_k^t - e_k^{t-1})||_2, the prompts' weighted movement under one set of
  weights alpha — is client-local adaptation still active?

The device computes all three, so this module is numpy only: the torch device and the torch-free
(onnxruntime) device share it. phi_s itself is trained on the coordinator (``ShallowHead`` in
``harmonizer.py``); the device evaluates it, and the estimator Gamma, with the weights the round
start carries (:mod:`.heads`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .adaptation import _array

__all__ = ["Observation", "alignment", "drift", "prompt_variation"]


def alignment(phi_s_out: Any, prototypes: Any, labels: Any) -> float:
    """Eq. 3: a = mean_x cos(phi_s(hbar(x)), C_{y(x)}).

    Samples whose class prototype is all-zero (never updated) are left out of the mean; when no
    sample has an initialised prototype (e.g. round 1) the result is 0.0, the neutral value.
    """
    out, protos = _array(phi_s_out).astype(np.float64), _array(prototypes).astype(np.float64)
    if out.ndim != 2 or protos.ndim != 2 or out.shape[1] != protos.shape[1]:
        raise ValueError(f"expected phi_s_out (B, P) and prototypes (C, P), got {out.shape}, {protos.shape}")
    y = _array(labels).astype(np.int64).reshape(-1)
    if len(y) != len(out):
        raise ValueError(f"{len(y)} labels for {len(out)} outputs")
    if len(y) and (y.min() < 0 or y.max() >= len(protos)):
        raise ValueError(f"labels must lie in 0..{len(protos) - 1}")
    c = protos[y]
    cn, on = np.linalg.norm(c, axis=1), np.linalg.norm(out, axis=1)
    valid = cn > 0
    if not valid.any():
        return 0.0
    cos = (out[valid] * c[valid]).sum(axis=1) / np.maximum(on[valid] * cn[valid], 1e-8)
    return float(cos.mean())


def _l2_change(now: Any, prev: Any | None) -> float:
    if prev is None:
        return 0.0
    a, b = _array(now).astype(np.float64), _array(prev).astype(np.float64)
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {a.shape} vs {b.shape}")
    return float(np.linalg.norm(a - b))


def drift(H_now: Any, H_prev: Any | None) -> float:
    """Eq. 4: delta = ||H^t - H^{t-1}||_2 of the batch-mean pooled p_1 features.

    With no previous summary (a client's first round) delta = 0.0: no evidence of drift yet.
    """
    return _l2_change(H_now, H_prev)


def prompt_variation(prompts_now: Any, prompts_before: Any | None, alpha: Any) -> float:
    """Eq. 5 as we compute it: q = ||sum_k alpha_k (e_k^t - e_k^{t-1})||_2, one set of weights on both sides.

    ``prompts_now`` / ``prompts_before``: the (m, d) prompt tokens after and before the device's last
    local training; ``alpha``: that training's descriptor weights (:func:`.adaptation.descriptor_weights`).
    The paper's ||m^t - m^{t-1}|| puts each round's own weights on its descriptor, so with near one-hot
    weights q jumped whenever the favoured token changed while the prompts barely moved (docs/method.md,
    "Observation"). With one alpha, prompts that did not move give q = 0 whatever alpha is, and q scales
    with the movement. 0.0 with no previous prompts.
    """
    if prompts_before is None:
        return 0.0
    now, before = _array(prompts_now).astype(np.float64), _array(prompts_before).astype(np.float64)
    w = _array(alpha).astype(np.float64).reshape(-1)
    if now.ndim != 2 or now.shape != before.shape or w.shape != now.shape[:1]:
        raise ValueError(f"expected prompts (m, d) twice and alpha (m,), got {now.shape}, {before.shape}, {w.shape}")
    return float(np.linalg.norm(w @ (now - before)))


@dataclass(frozen=True)
class Observation:
    """The estimator's input o^t (Eqs. 3-5)."""

    a: float
    delta: float
    q: float

    def values(self, adapt: bool = True) -> list[float]:
        """[a, delta, q]; with ``adapt=False`` (the no-adaptation-channel ablation) [a, delta]."""
        return [self.a, self.delta, self.q] if adapt else [self.a, self.delta]

    def as_array(self, adapt: bool = True) -> np.ndarray:
        return np.asarray(self.values(adapt), dtype=np.float32)
