"""Server-maintained class prototypes (docs/method.md "Server side", the EMA after Eq. 10).

C_y <- mu * C_y + (1 - mu) * mean(Z of class y), then C_y <- C_y / ||C_y||_2. The paper's mean
runs over every harmonized embedding of class y seen by the server in round t, across all
participating clients. ``accumulate`` + ``commit`` implement exactly that without storing the
embeddings (per-class running sums); ``update`` is the one-batch shorthand.

Our interpretation (the paper is silent on scales): the EMA runs over *directions*. The class
mean is L2-normalised before it is mixed in, i.e. C_y <- normalise(mu * C_y + (1 - mu) *
normalise(mean)). Mixing the unit-norm C_y with the raw mean (norm ~14 for harmonized embeddings)
would let the mean dominate, so mu = 0.9 behaved like mu ~ 0.4; normalising first makes mu the
weight of the old direction, whatever the embedding's scale.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["Prototypes"]


class Prototypes(nn.Module):
    """EMA class prototypes of shape (num_classes, dim); a Module so ``.to()`` and checkpoints work.

    A class that has never been seen has an all-zero prototype and ``initialized[y] == False``;
    its first update sets C_y to the normalised class mean of that update (EMA from the zero
    vector would give the same direction, this just states it).
    """

    def __init__(self, num_classes: int, dim: int, mu: float = 0.9) -> None:
        super().__init__()
        if not 0.0 <= mu <= 1.0:
            raise ValueError("mu must lie in [0, 1]")
        self.num_classes = num_classes
        self.dim = dim
        self.mu = mu
        self.register_buffer("protos", torch.zeros(num_classes, dim))
        self.register_buffer("initialized", torch.zeros(num_classes, dtype=torch.bool))
        self.register_buffer("_sum", torch.zeros(num_classes, dim), persistent=False)
        self.register_buffer("_count", torch.zeros(num_classes), persistent=False)

    def tensor(self) -> Tensor:
        """A copy of the current prototypes (C, dim), safe to hold while updates happen."""
        return self.protos.clone()

    @torch.no_grad()
    def accumulate(self, Z: Tensor, labels: Tensor) -> None:
        """Add a batch of embeddings Z (B, dim) with labels (B,) to this round's class sums."""
        if Z.dim() != 2 or Z.shape[1] != self.dim or labels.shape != Z.shape[:1]:
            raise ValueError(
                f"expected Z (B, {self.dim}) and labels (B,), "
                f"got {tuple(Z.shape)}, {tuple(labels.shape)}"
            )
        labels = labels.to(self._count.device, torch.long)
        self._sum.index_add_(0, labels, Z.detach().to(self._sum))
        self._count += torch.bincount(labels, minlength=self.num_classes).to(self._count)

    @torch.no_grad()
    def commit(self) -> None:
        """EMA step with the accumulated means of the classes seen since the last commit; reset."""
        seen = self._count > 0
        # Directions only (module docstring): a unit-norm mean, so mu weighs old vs new as stated.
        mean = F.normalize(self._sum[seen] / self._count[seen].unsqueeze(1), dim=1)
        old = self.protos[seen]
        ema = self.mu * old + (1 - self.mu) * mean
        blended = torch.where(self.initialized[seen].unsqueeze(1), ema, mean)
        self.protos[seen] = F.normalize(blended, dim=1)
        self.initialized |= seen
        self._sum.zero_()
        self._count.zero_()

    def update(self, Z: Tensor, labels: Tensor) -> None:
        """One EMA step from a single batch: ``accumulate(Z, labels)`` then ``commit()``.

        Sums accumulated earlier and not yet committed are folded into this step.
        """
        self.accumulate(Z, labels)
        self.commit()
