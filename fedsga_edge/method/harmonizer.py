"""Split-compatible interface harmonization (paper §3.4, Eqs. 9-10).

Clients offload at different depths, so the server sees interfaces of different abstraction
levels. The server always runs the remaining blocks to the end and pools, then the depth-aware
harmonizer Z = phi([pool(u), e(k)]) maps the pooled features into one shared space, conditioned
on a learnable embedding of the split index k. Z is regularised towards last round's class
prototypes C^{t-1} with a temperature-scaled cosine softmax (Eq. 9), added to CE (Eq. 10).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Harmonizer", "ShallowHead", "alignment_loss", "phi_s_loss", "server_loss"]


class Harmonizer(nn.Module):
    """Eq. 9's phi: a 2-layer MLP (hidden width = ``dim``) on concat(pooled, e(k)).

    ``depth_index`` is the 1-based split index k returned by the policy (Eq. 8), in 1..num_depths.
    ``in_dims`` is the pooled feature width: an int when every depth yields the same width (our
    backbones: the server always runs to the final pooled features). A dict {k: width} is also
    accepted for backbones where it differs; narrower features are then zero-padded to the widest
    one (our choice: one shared MLP, the depth embedding tells depths apart).

    ``residual`` (our variant, ``--harmonizer-form residual``): Z = pooled + MLP([pooled, e(k)]) in the pooled
    space (``dim`` is then the MLP's hidden width), the last layer at zero so that Z starts as the pooled
    features and every depth starts with one head. Why: averaged per-client copies of the paper's MLP cost
    FedSGA 3-10 points under label skew, and its K depth heads drift apart (docs/method.md, "Server side").
    """

    def __init__(
        self, in_dims: dict[int, int] | int, num_depths: int, dim: int = 128, depth_dim: int = 16,
        residual: bool = False,
    ) -> None:
        super().__init__()
        if num_depths < 1:
            raise ValueError("num_depths must be >= 1")
        if isinstance(in_dims, dict):
            if set(in_dims) != set(range(1, num_depths + 1)):
                raise ValueError(f"in_dims keys must be the split indices 1..{num_depths}")
            self.in_dims = {int(k): int(v) for k, v in in_dims.items()}
        else:
            self.in_dims = {k: int(in_dims) for k in range(1, num_depths + 1)}
        self.num_depths = num_depths
        self.in_width = max(self.in_dims.values())
        self.residual = residual
        self.dim = self.in_width if residual else dim  # Z's width
        self.depth_embedding = nn.Embedding(num_depths, depth_dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.in_width + depth_dim, dim), nn.ReLU(inplace=True), nn.Linear(dim, self.dim)
        )
        # Variance-preserving init: with torch's default Linear init every layer shrinks the
        # signal (~1/3 of the variance), so the two extra layers before the head starved the
        # backbone of gradient and training was several times slower than with a plain head.
        for layer in (self.mlp[0], self.mlp[2]):
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)
        if residual:  # the correction starts at zero: the identity, one head for every depth
            nn.init.zeros_(self.mlp[2].weight)

    def forward(self, pooled: Tensor, depth_index: int | Tensor) -> Tensor:
        """Map pooled server features (B, F) entered at split k (int or (B,) tensor) to Z (B, dim)."""
        batch = pooled.shape[0]
        if isinstance(depth_index, int):
            depths = {depth_index}
            k = torch.full((batch,), depth_index, dtype=torch.long, device=pooled.device)
        else:
            k = depth_index.to(device=pooled.device, dtype=torch.long)
            if k.dim() == 0:
                k = k.expand(batch)
            if k.shape != (batch,):
                raise ValueError(f"depth_index must be an int or shape ({batch},), got {tuple(k.shape)}")
            depths = set(k.unique().tolist())
        if not depths <= set(self.in_dims):
            raise ValueError(f"depth_index is 1-based, must lie in 1..{self.num_depths}; got {depths}")
        widths = {self.in_dims[d] for d in depths}
        if widths != {pooled.shape[1]}:
            raise ValueError(f"pooled width {pooled.shape[1]} does not match in_dims {widths}")
        if pooled.shape[1] < self.in_width:
            pooled = F.pad(pooled, (0, self.in_width - pooled.shape[1]))
        out = self.mlp(torch.cat([pooled, self.depth_embedding(k - 1)], dim=1))
        return pooled + out if self.residual else out


def alignment_loss(Z: Tensor, labels: Tensor, prototypes: Tensor, tau_a: float = 0.5) -> Tensor:
    """Eq. 9: mean over the batch of -log softmax_y(cos(Z, C_y) / tau_a).

    Prototypes are last round's constants (detached). Uninitialised (all-zero) prototypes have
    cosine 0 with everything, so before the first prototype update the loss is the constant
    log(num_classes) with zero gradient.
    """
    if tau_a <= 0:
        raise ValueError("tau_a must be positive")
    protos = F.normalize(prototypes.detach().to(Z.dtype), dim=1)
    logits = F.normalize(Z, dim=1) @ protos.t() / tau_a
    return F.cross_entropy(logits, labels)


def server_loss(
    logits: Tensor,
    Z: Tensor,
    labels: Tensor,
    prototypes: Tensor,
    lambda_align: float = 0.1,
    tau_a: float = 0.5,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Eq. 10: CE(G(Z), y) + lambda * L_align; parts are detached 0-d tensors ("ce", "align")."""
    ce = F.cross_entropy(logits, labels)
    align = alignment_loss(Z, labels, prototypes, tau_a)
    loss = ce + lambda_align * align
    return loss, {"ce": ce.detach(), "align": align.detach()}


class ShallowHead(nn.Module):
    """phi_s (Eq. 3): Linear-ReLU-Linear from pooled p_1 features (in_dim) to the prototype space.

    Trained here on the coordinator; devices evaluate it with ``method.heads.shallow_head``.
    """

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
