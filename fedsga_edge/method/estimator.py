"""Shallow-sufficiency estimator r^t = Gamma(o^t, r^{t-1}) and its calibration (Eqs. 6-7, Alg. 1).

Gamma is a low-capacity *monotone* model: r is non-decreasing in the alignment a and in r^{t-1},
non-increasing in the drift delta and the prompt variation q. Monotonicity holds by construction
for every parameter value: the inputs are [a, -delta/s_delta, -q/s_q, r_prev] with positive
scales s, both layers use non-negative weights (softplus of raw parameters), and the activations
(tanh, then sigmoid) are increasing. Biases are free.

With ``--label-memory`` (beyond the paper, docs/method.md "Label memory") a fourth input follows: the
device's margin log(Lref / L1) at its previous calibration, which the server kept and sent back; r is
non-decreasing in it (a larger margin: the shallow path did relatively better), scaled like delta.

Input scaling: delta and q are norms whose scale depends on the backbone and the prompts. Each
is divided by a positive scale that is not learned: it is the median of that feature's magnitude
over the stored calibration pairs, refreshed at every ``fit`` (1 before the first fit, and kept at
1 when the feature is all zero). A median, not a mean: one device's outlier must not rescale every
other device's input (a single pair at 1e6 moved a mean scale from 0.70 to 250001). a (a cosine)
and r_prev (a probability) are used as they are.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MonotoneEstimator", "CalibrationBuffer", "fit", "informative", "score"]

_INIT_OUT_WEIGHT = 0.01
_INIT_OUT_RAW = math.log(math.expm1(_INIT_OUT_WEIGHT))  # softplus^{-1}(0.01)
# The fit's prior (docs/method.md, "Calibration"): an L2 pull of the output layer back to its untrained
# values (r ~ 0.5) weighing like two pairs: 4 pairs of one label give r ~ 0.83, 20 give ~0.94, 100 ~0.98.
PRIOR_PAIRS = 2.0


def informative(obs: Sequence[float], r_prev: float) -> bool:
    """Whether a calibration pair says anything about its device (docs/method.md, "Calibration").

    A device's first observation has no previous interface mean (delta = 0 exactly), no previous estimate
    (r_prev = 0, the start value) and, in round 1, no prototypes (a = 0) and no trained prompts (q = 0):
    every device reports the same point, so its label can only teach Gamma the fleet's base rate.
    """
    return not (float(obs[1]) == 0.0 and float(r_prev) == 0.0)


class MonotoneEstimator(nn.Module):
    """Eq. 6's Gamma: forward(obs (B, num_obs), r_prev (B,)) -> r (B,) in [0, 1].

    ``num_obs`` is 3 for o = [a, delta, q] and 2 for the no-adaptation ablation o = [a, delta];
    ``margin=True`` appends the label memory m (one more input, r non-decreasing in it).
    Untrained output is close to 0.5 (no evidence either way): the output-layer weights start at
    0.01 and the output bias at 0, so |logit| <= 0.01 * hidden and r lies in
    [sigmoid(-0.01 * hidden), sigmoid(0.01 * hidden)] (0.48..0.52 for hidden = 8).
    """

    def __init__(self, num_obs: int = 3, hidden: int = 8, margin: bool = False) -> None:
        super().__init__()
        if num_obs not in (2, 3):
            raise ValueError("num_obs must be 3 ([a, delta, q]) or 2 ([a, delta])")
        signs = [1.0, -1.0, -1.0][:num_obs] + ([1.0] if margin else [])
        self.num_obs = len(signs)
        self.w1_raw = nn.Parameter(torch.randn(hidden, self.num_obs + 1) * 0.5)
        self.b1 = nn.Parameter(torch.zeros(hidden))
        self.w2_raw = nn.Parameter(torch.full((hidden,), _INIT_OUT_RAW))
        self.b2 = nn.Parameter(torch.zeros(()))
        self.register_buffer("obs_sign", torch.tensor(signs))
        self.register_buffer("obs_scale", torch.ones(self.num_obs))

    @torch.no_grad()
    def set_scale(self, obs: Tensor) -> None:
        """Set the delta / q (/ margin) scales to their median absolute value over ``obs`` (N, num_obs)."""
        typical = obs.detach().to(self.obs_scale).abs().median(dim=0).values
        scale = torch.where(typical > 1e-12, typical, torch.ones_like(typical))
        scale[0] = 1.0  # a is a cosine in [-1, 1]: already on a fixed scale
        self.obs_scale.copy_(scale)

    def logit(self, obs: Tensor, r_prev: Tensor) -> Tensor:
        """Pre-sigmoid output (B,); monotone in the same directions as ``forward``."""
        if obs.dim() != 2 or obs.shape[1] != self.num_obs or r_prev.shape != obs.shape[:1]:
            raise ValueError(
                f"expected obs (B, {self.num_obs}) and r_prev (B,), "
                f"got {tuple(obs.shape)}, {tuple(r_prev.shape)}"
            )
        x = torch.cat([obs * self.obs_sign / self.obs_scale, r_prev.unsqueeze(1).to(obs)], dim=1)
        h = torch.tanh(F.linear(x, F.softplus(self.w1_raw), self.b1))
        return h @ F.softplus(self.w2_raw) + self.b2

    def prior_penalty(self) -> Tensor:
        """Squared distance of the output layer from its untrained values: |logit| <= sum softplus(w2) + |b2|,
        so this bounds how confident Gamma can get (docs/method.md, "Calibration")."""
        return ((F.softplus(self.w2_raw) - _INIT_OUT_WEIGHT) ** 2).sum() + self.b2**2

    def forward(self, obs: Tensor, r_prev: Tensor) -> Tensor:
        """Eq. 6: r = Gamma(o, r_prev) in [0, 1], shape (B,)."""
        return torch.sigmoid(self.logit(obs, r_prev))


class CalibrationBuffer:
    """The calibration pairs ((o, r_prev), s) collected so far (Alg. 1, line 7), the newest
    ``capacity`` of them: the paper keeps all; a bound keeps a long run's refit cheap and lets a
    hostile pair age out."""

    def __init__(self, num_obs: int = 3, capacity: int = 512) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.num_obs = num_obs
        self.capacity = capacity
        self._obs: list[list[float]] = []
        self._r_prev: list[float] = []
        self._s: list[float] = []

    def append(self, obs: Tensor | Sequence[float], r_prev: float, s: int) -> None:
        """Store one pair: observation (num_obs,), previous estimate r_prev, label s in {0, 1}."""
        values = [float(v) for v in (obs.tolist() if isinstance(obs, Tensor) else obs)]
        if len(values) != self.num_obs:
            raise ValueError(f"observation must have {self.num_obs} values, got {len(values)}")
        if s not in (0, 1):
            raise ValueError("label s must be 0 or 1")
        self._obs.append(values)
        self._r_prev.append(float(r_prev))
        self._s.append(float(s))
        if len(self._s) > self.capacity:  # the oldest pair goes
            del self._obs[0], self._r_prev[0], self._s[0]

    def typical(self, column: int) -> float | None:
        """The median magnitude of one observation value over the stored pairs (None when empty)."""
        if not self._obs:
            return None
        return float(torch.tensor([abs(o[column]) for o in self._obs]).median())

    def __len__(self) -> int:
        return len(self._s)

    def tensors(self) -> tuple[Tensor, Tensor, Tensor]:
        """(obs (N, num_obs), r_prev (N,), s (N,)) as float32 tensors, in insertion order."""
        obs = torch.tensor(self._obs, dtype=torch.float32).reshape(len(self), self.num_obs)
        r_prev = torch.tensor(self._r_prev, dtype=torch.float32)
        return obs, r_prev, torch.tensor(self._s, dtype=torch.float32)

    def state_dict(self) -> dict[str, Tensor]:
        """Checkpointable contents (plain tensors; loads with ``torch.load(weights_only=True)``)."""
        obs, r_prev, s = self.tensors()
        return {"obs": obs, "r_prev": r_prev, "s": s}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Replace the contents with a ``state_dict()``."""
        obs, r_prev, s = state["obs"], state["r_prev"], state["s"]
        if obs.dim() != 2 or obs.shape[1] != self.num_obs or not (len(obs) == len(r_prev) == len(s)):
            raise ValueError(f"state does not hold pairs with {self.num_obs} observation values")
        self._obs = obs.tolist()
        self._r_prev = r_prev.tolist()
        self._s = s.tolist()


def score(estimator: MonotoneEstimator, obs: Tensor, r_prev: Tensor, s: Tensor) -> dict[str, float]:
    """BCE, accuracy at 0.5 and Brier score of Gamma on pairs (obs (N, num_obs), r_prev (N,), s (N,))."""
    with torch.no_grad():
        like = estimator.b2
        obs, r_prev, s = obs.to(like), r_prev.to(like), s.to(like)
        logit = estimator.logit(obs, r_prev)
        r = torch.sigmoid(logit)
        return {
            "loss": float(F.binary_cross_entropy_with_logits(logit, s)),
            "accuracy": float(((r >= 0.5).float() == s).float().mean()),
            "brier": float(((r - s) ** 2).mean()),
        }


def fit(
    estimator: MonotoneEstimator, buffer: CalibrationBuffer, steps: int = 200, lr: float = 0.05,
    prior_pairs: float = PRIOR_PAIRS,
) -> dict[str, float]:
    """Alg. 1 line 8 / Eq. 7: refit Gamma by BCE on *all* stored pairs, with a prior.

    The objective is mean BCE + (prior_pairs / N) * ``prior_penalty()``: an L2 pull of the output layer
    towards r ~ 0.5 that weighs like ``prior_pairs`` pairs, so a handful of pairs cannot saturate r at
    0 or 1 (200 unregularised steps on 4 pairs of one label gave r = 0.9996 for every device) while
    many consistent pairs still can move it far (docs/method.md, "Calibration"). Full batch, fresh Adam
    each call, warm-started from the current weights, so the result is deterministic given the weights
    and the buffer. Refreshes the input scales first. Returns the final (post-fit) BCE, accuracy at
    threshold 0.5 and Brier score on the stored pairs (in-sample: see :func:`score` for held-out pairs).
    Raises ValueError on an empty buffer.
    """
    if len(buffer) == 0:
        raise ValueError("cannot fit on an empty calibration buffer")
    if buffer.num_obs != estimator.num_obs:
        raise ValueError(f"buffer holds {buffer.num_obs} observation values, estimator {estimator.num_obs}")
    if prior_pairs < 0:
        raise ValueError("prior_pairs must be >= 0")
    like = estimator.b2
    obs, r_prev, s = (t.to(like) for t in buffer.tensors())
    estimator.set_scale(obs)
    optimizer = torch.optim.Adam(estimator.parameters(), lr=lr)
    weight = prior_pairs / len(buffer)
    with torch.enable_grad():
        for _ in range(steps):
            optimizer.zero_grad()
            loss = F.binary_cross_entropy_with_logits(estimator.logit(obs, r_prev), s)
            if weight:
                loss = loss + weight * estimator.prior_penalty()
            loss.backward()
            optimizer.step()
    return score(estimator, obs, r_prev, s)
