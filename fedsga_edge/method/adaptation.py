"""Client-specific adaptation channel (paper §3.2, Eq. 2).

After local backprop each private prompt token e_k has a gradient g_k. Its contribution is
c_k = |<g_k, e_k>| (first-order change of the loss if the token were scaled away), and the
prompt descriptor is m = sum_k softmax(c / tau_m)_k e_k. The descriptor is a *measurement*
of the adaptation state, so everything here is detached and computed without autograd.

Ours, not the paper's: c is divided by its mean before the softmax (see
:func:`descriptor_weights`), because the raw c_k are ~1e-6 and the paper's weights are uniform.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["descriptor", "descriptor_weights", "prompt_contributions", "weight_entropy"]


def _check_tokens(name: str, t: Tensor) -> None:
    if t.dim() != 2:
        raise ValueError(f"{name} must be (m, d), got shape {tuple(t.shape)}")


@torch.no_grad()
def prompt_contributions(grad: Tensor, prompts: Tensor) -> Tensor:
    """Eq. 2: per-token contribution c_k = |<g_k, e_k>| for grad, prompts of shape (m, d)."""
    _check_tokens("grad", grad)
    _check_tokens("prompts", prompts)
    if grad.shape != prompts.shape:
        raise ValueError(f"grad {tuple(grad.shape)} and prompts {tuple(prompts.shape)} differ")
    return (grad.detach() * prompts.detach()).sum(dim=1).abs()


@torch.no_grad()
def descriptor_weights(contributions: Tensor, tau_m: float = 0.5) -> Tensor:
    """Token weights alpha = softmax((c / mean(c)) / tau_m), shape (m,).

    Our variant of Eq. 2 (the paper writes softmax(c / tau_m)): the raw contributions are tiny
    (~1e-6, they are gradient-prompt inner products), so the paper's softmax is uniform to three
    decimals and the descriptor degenerates to the plain prompt mean. Dividing by mean(c) keeps
    the ordering, makes the weights independent of the gradient's overall scale, and leaves tau_m
    the temperature of *relative* contributions. All-zero c stays zero (uniform weights).
    """
    if contributions.dim() != 1 or contributions.numel() == 0:
        raise ValueError(f"contributions must be a non-empty vector (m,), got shape {tuple(contributions.shape)}")
    if tau_m <= 0:
        raise ValueError("tau_m must be positive")
    c = contributions.detach().to(torch.float64)  # float64: c ~ 1e-6 and its mean
    if (c < 0).any():
        raise ValueError("contributions are magnitudes |<g_k, e_k>| and must be non-negative")
    scale = c.mean()
    if scale > 0:
        c = c / scale
    dtype = contributions.dtype if contributions.is_floating_point() else torch.get_default_dtype()
    return torch.softmax(c / tau_m, dim=0).to(dtype)


@torch.no_grad()
def weight_entropy(alpha: Tensor) -> float:
    """Natural-log entropy of the token weights: log(m) when uniform, 0 when one token has it all.

    Reported per round so a run shows whether the descriptor actually weighs tokens differently.
    """
    a = alpha.detach().to(torch.float64).reshape(-1)
    a = a[a > 0]
    return float(-(a * a.log()).sum())


@torch.no_grad()
def descriptor(prompts: Tensor, contributions: Tensor, tau_m: float = 0.5) -> Tensor:
    """Eq. 2: prompt descriptor m = sum_k alpha_k e_k with alpha = :func:`descriptor_weights`, shape (d,)."""
    _check_tokens("prompts", prompts)
    if contributions.shape != prompts.shape[:1]:
        raise ValueError(f"contributions must be ({prompts.shape[0]},), got {tuple(contributions.shape)}")
    alpha = descriptor_weights(contributions, tau_m).to(prompts.dtype)
    return alpha @ prompts.detach()
