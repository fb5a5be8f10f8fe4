"""Client-specific adaptation channel (paper §3.2, Eq. 2).

After local backprop each private prompt token e_k has a gradient g_k. Its contribution is
c_k = |<g_k, e_k>| (first-order change of the loss if the token were scaled away), and the
prompt descriptor is m = sum_k softmax(c / tau_m)_k e_k. The descriptor is a *measurement*
of the adaptation state, so everything here is detached and computed without autograd.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["prompt_contributions", "descriptor"]


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
def descriptor(
    prompts: Tensor, contributions: Tensor, tau_m: float = 0.5, normalize: bool = False
) -> Tensor:
    """Eq. 2: prompt descriptor m = sum_k softmax(c / tau_m)_k e_k, shape (d,).

    With the paper's formula the raw contributions are often tiny (~1e-6), so softmax(c / tau_m)
    is close to uniform and m is close to the plain mean of the prompts. ``normalize=True`` is
    our optional variant (off by default, not in the paper): c is divided by max(c) first, so
    the weights depend only on the *relative* contributions. All-zero c stays all-zero.
    """
    _check_tokens("prompts", prompts)
    c = contributions.detach().to(prompts.dtype)
    if c.shape != prompts.shape[:1]:
        raise ValueError(f"contributions must be ({prompts.shape[0]},), got {tuple(c.shape)}")
    if tau_m <= 0:
        raise ValueError("tau_m must be positive")
    if normalize:
        peak = c.max()
        if peak > 0:
            c = c / peak
    alpha = torch.softmax(c / tau_m, dim=0)
    return alpha @ prompts.detach()
