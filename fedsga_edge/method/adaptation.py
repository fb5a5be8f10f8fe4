"""Client-specific adaptation channel (paper §3.2, Eq. 2), in numpy: both device backends use it.

After local backprop each private prompt token e_k has a gradient g_k. Its contribution is
c_k = |<g_k, e_k>| (first-order change of the loss if the token were scaled away), and the
prompt descriptor is m = sum_k softmax(c / tau_m)_k e_k. The descriptor is a *measurement*
of the adaptation state, not something trained, so it is plain array arithmetic: a torch-free
device (onnxruntime + numpy) computes exactly what the torch device computes.

Ours, not the paper's: c is divided by its mean before the softmax (see
:func:`descriptor_weights`), because the raw c_k are ~1e-6 and the paper's weights are uniform.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["descriptor", "descriptor_weights", "prompt_contributions", "weight_entropy"]


def _array(x: Any) -> np.ndarray:
    """numpy arrays as they are; torch tensors (CPU or not, with grad or not) without importing torch."""
    if hasattr(x, "detach"):
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def _check_tokens(name: str, t: np.ndarray) -> None:
    if t.ndim != 2:
        raise ValueError(f"{name} must be (m, d), got shape {tuple(t.shape)}")


def prompt_contributions(grad: Any, prompts: Any) -> np.ndarray:
    """Eq. 2: per-token contribution c_k = |<g_k, e_k>| for grad, prompts of shape (m, d)."""
    g, p = _array(grad), _array(prompts)
    _check_tokens("grad", g)
    _check_tokens("prompts", p)
    if g.shape != p.shape:
        raise ValueError(f"grad {tuple(g.shape)} and prompts {tuple(p.shape)} differ")
    return np.abs((g.astype(np.float64) * p.astype(np.float64)).sum(axis=1))


def descriptor_weights(contributions: Any, tau_m: float = 0.5) -> np.ndarray:
    """Token weights alpha = softmax((c / mean(c)) / tau_m), shape (m,), float64.

    Our variant of Eq. 2 (the paper writes softmax(c / tau_m)): the raw contributions are tiny
    (~1e-6, they are gradient-prompt inner products), so the paper's softmax is uniform to three
    decimals and the descriptor degenerates to the plain prompt mean. Dividing by mean(c) keeps
    the ordering, makes the weights independent of the gradient's overall scale, and leaves tau_m
    the temperature of *relative* contributions. All-zero c stays zero (uniform weights).
    """
    c = _array(contributions).astype(np.float64)
    if c.ndim != 1 or c.size == 0:
        raise ValueError(f"contributions must be a non-empty vector (m,), got shape {tuple(c.shape)}")
    if tau_m <= 0:
        raise ValueError("tau_m must be positive")
    if not np.isfinite(c).all():
        raise ValueError("contributions must be finite")
    if (c < 0).any():
        raise ValueError("contributions are magnitudes |<g_k, e_k>| and must be non-negative")
    scale = c.mean()
    if scale > 0:
        c = c / scale
    e = np.exp((c - c.max()) / tau_m)
    return e / e.sum()


def weight_entropy(alpha: Any) -> float:
    """Natural-log entropy of the token weights: log(m) when uniform, 0 when one token has it all.

    Reported per round so a run shows whether the descriptor actually weighs tokens differently.
    """
    a = _array(alpha).astype(np.float64).reshape(-1)
    a = a[a > 0]
    return float(-(a * np.log(a)).sum())


def descriptor(prompts: Any, contributions: Any, tau_m: float = 0.5) -> np.ndarray:
    """Eq. 2: prompt descriptor m = sum_k alpha_k e_k with alpha = :func:`descriptor_weights`, shape (d,)."""
    p, c = _array(prompts), _array(contributions)
    _check_tokens("prompts", p)
    if c.shape != p.shape[:1]:
        raise ValueError(f"contributions must be ({p.shape[0]},), got {tuple(c.shape)}")
    return (descriptor_weights(c, tau_m) @ p.astype(np.float64)).astype(np.float32)
