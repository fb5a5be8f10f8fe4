"""Sufficiency observation o = [a, delta, q] of the shallow interface p_1 (paper §3.3, Eqs. 3-5).

- a (Eq. 3): mean cosine between phi_s(hbar(x)) and last round's prototype of x's class —
  is the shallow interface already consistent with the cross-client class geometry?
- delta (Eq. 4): ||H^t - H^{t-1}||_2 with H = batch mean of hbar — is the interface still moving?
- q (Eq. 5): ||m^t - m^{t-1}||_2 of the prompt descriptor — is client-local adaptation still active?

phi_s (``ShallowHead``) is the small head that maps pooled p_1 features into the prototype space;
it is trained with the same prototype-alignment loss as the harmonizer (Eq. 9).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .harmonizer import alignment_loss

__all__ = ["Observation", "ShallowHead", "alignment", "drift", "prompt_variation", "phi_s_loss"]


@torch.no_grad()
def alignment(phi_s_out: Tensor, prototypes: Tensor, labels: Tensor) -> float:
    """Eq. 3: a = mean_x cos(phi_s(hbar(x)), C_{y(x)}).

    Samples whose class prototype is all-zero (never updated) are left out of the mean; when no
    sample has an initialised prototype (e.g. round 1) the result is 0.0, the neutral value.
    """
    if phi_s_out.dim() != 2 or prototypes.dim() != 2 or phi_s_out.shape[1] != prototypes.shape[1]:
        shapes = f"{tuple(phi_s_out.shape)}, {tuple(prototypes.shape)}"
        raise ValueError(f"expected phi_s_out (B, P) and prototypes (C, P), got {shapes}")
    protos = prototypes.detach().to(phi_s_out)[labels.to(phi_s_out.device, torch.long)]
    valid = protos.norm(dim=1) > 0
    if not bool(valid.any()):
        return 0.0
    cos = F.cosine_similarity(phi_s_out.detach()[valid], protos[valid], dim=1)
    return float(cos.mean())


def _l2_change(now: Tensor, prev: Tensor | None) -> float:
    if prev is None:
        return 0.0
    if now.shape != prev.shape:
        raise ValueError(f"shapes differ: {tuple(now.shape)} vs {tuple(prev.shape)}")
    return float((now.detach().float() - prev.detach().to(now.device).float()).norm())


def drift(H_now: Tensor, H_prev: Tensor | None) -> float:
    """Eq. 4: delta = ||H^t - H^{t-1}||_2 of the batch-mean pooled p_1 features.

    With no previous summary (a client's first round) delta = 0.0: no evidence of drift yet.
    """
    return _l2_change(H_now, H_prev)


def prompt_variation(m_now: Tensor, m_prev: Tensor | None) -> float:
    """Eq. 5: q = ||m^t - m^{t-1}||_2 of the prompt descriptor; 0.0 with no previous descriptor."""
    return _l2_change(m_now, m_prev)


@dataclass(frozen=True)
class Observation:
    """The estimator's input o^t (Eqs. 3-5)."""

    a: float
    delta: float
    q: float

    def as_tensor(self, adapt: bool = True) -> Tensor:
        """[a, delta, q]; with ``adapt=False`` (the no-adaptation-channel ablation) [a, delta]."""
        values = [self.a, self.delta, self.q] if adapt else [self.a, self.delta]
        return torch.tensor(values, dtype=torch.float32)


class ShallowHead(nn.Module):
    """phi_s (Eq. 3): Linear-ReLU-Linear from pooled p_1 features (in_dim) to the prototype space."""

    def __init__(self, in_dim: int, proto_dim: int, hidden: int | None = None) -> None:
        super().__init__()
        hidden = proto_dim if hidden is None else hidden
        self.net = nn.Sequential(
            nn.Linear(in_dim, hidden), nn.ReLU(inplace=True), nn.Linear(hidden, proto_dim)
        )

    def forward(self, pooled: Tensor) -> Tensor:
        """(B, in_dim) -> (B, proto_dim)."""
        return self.net(pooled)


def phi_s_loss(phi_s_out: Tensor, labels: Tensor, prototypes: Tensor, tau_a: float = 0.5) -> Tensor:
    """Training loss of phi_s: the harmonizer's prototype-alignment loss (Eq. 9) on phi_s outputs."""
    return alignment_loss(phi_s_out, labels, prototypes, tau_a)
