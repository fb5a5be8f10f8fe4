"""q (Eq. 5) follows how far the prompts moved, not which token the descriptor weights favour
(docs/method.md, "Observation").

The device-level tests drive FedSGA's device side (``after_train`` after local training, then the next
round's ``choose_split``), so they check the q a device reports, whatever helper computes it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from fedsga_edge.config import FedSGAConfig, TrainConfig
from fedsga_edge.device.fedsga import FedSGADevice
from fedsga_edge.device.role import ClientData, SplitClient, _Plan, _Trained
from fedsga_edge.method import MonotoneEstimator, ShallowHead, descriptor_weights, prompt_variation
from fedsga_edge.tensors import to_numpy_state

M, D, FEAT, PROTO, CLASSES = 4, 6, 8, 5, 3


class _Images:
    """The two things the role asks of an ImageSet."""

    def __init__(self, n: int) -> None:
        self.labels = np.arange(n) % CLASSES
        self._x = np.random.default_rng(0).random((n, FEAT))

    def get_batch(self, idx: np.ndarray) -> np.ndarray:
        return self._x[idx]


class _Backend:
    """Only what the round-start observation calls: features that do not depend on the prompts."""

    name, num_splits, num_blocks = "fake", 3, 5

    def inputs(self, images: np.ndarray, augment: bool) -> np.ndarray:
        return images

    def observe(self, x: np.ndarray, prompts: np.ndarray | None) -> np.ndarray:
        return np.asarray(x, dtype=np.float64)


def _client() -> SplitClient:
    data = ClientData(_Images(16), np.arange(16), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0))
    return SplitClient("client-000", data, _Backend(), peer=None, rng=np.random.default_rng(0))  # type: ignore[arg-type]


def _round_start_body() -> dict[str, Any]:
    torch.manual_seed(0)
    return {"fedsga": dict(vars(FedSGAConfig())), "train": {"batch_size": 8}, "phi_s": to_numpy_state(ShallowHead(FEAT, PROTO).state_dict()),
            "prototypes": np.zeros((CLASSES, PROTO), np.float32),
            "estimator": to_numpy_state(MonotoneEstimator().state_dict())}


def _contrib(favoured: int) -> np.ndarray:
    """Contributions whose descriptor weights are near one-hot on ``favoured`` (as they were in real runs)."""
    c = np.full(M, 0.1)
    c[favoured] = 10.0
    return c


def _reported_q(client: SplitClient, rounds: list[tuple[np.ndarray, np.ndarray, np.ndarray]]) -> float:
    """Local training rounds (prompts before, prompts after, summed contributions), then the q the next
    round's observation reports."""
    method = FedSGADevice(_round_start_body())
    for before, after, contrib in rounds:
        plan = _Plan(TrainConfig(), False, 1, set(), prompts=before.copy())
        client.state.prompts = before.copy()
        method.after_train(client, plan, _Trained(contrib.copy(), steps=1, new_prompts=after.copy()))
    _, report = method.choose_split(client, client.state.prompts)
    return float(report["q"])


def _prompts(seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(M, D)).astype(np.float32)


def test_prompts_that_do_not_move_give_q_zero_when_the_favoured_token_switches() -> None:
    P = _prompts()
    assert np.argmax(descriptor_weights(_contrib(0))) != np.argmax(descriptor_weights(_contrib(2)))
    # two rounds in which no prompt moves, the weights' arg-max switching from token 0 to token 2
    # (the paper's ||m^t - m^{t-1}|| was ||(alpha^t - alpha^{t-1}) @ P||, about the tokens' spread)
    q = _reported_q(_client(), [(P, P, _contrib(0)), (P, P, _contrib(2))])
    assert q == 0.0


@pytest.mark.parametrize("favoured", [0, 1, 3])
def test_prompts_that_do_not_move_give_q_zero_whatever_the_weights(favoured: int) -> None:
    P = _prompts(favoured + 5)
    assert _reported_q(_client(), [(P, P, _contrib((favoured + 1) % M)), (P, P, _contrib(favoured))]) == 0.0
    for alpha in (np.full(M, 1 / M), np.eye(M)[favoured], descriptor_weights(np.arange(1.0, M + 1))):
        assert prompt_variation(P, P, alpha) == 0.0


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_scaling_the_movement_scales_q(scale: float) -> None:
    P, d1, d2 = _prompts(), _prompts(2) * 0.01, _prompts(3) * 0.01

    def q(s: float) -> float:
        first, second = P + s * d1, P + s * d1 + s * d2
        return _reported_q(_client(), [(P, first, _contrib(0)), (first, second, _contrib(2))])

    base = q(1.0)
    assert base > 0
    assert q(scale) == pytest.approx(scale * base, rel=1e-5)  # float32 prompts


def test_q_is_the_weighted_movement_of_the_last_training() -> None:
    P, d = _prompts(), _prompts(4) * 0.01
    contrib = _contrib(1)
    expect = np.linalg.norm(descriptor_weights(contrib) @ d.astype(np.float64))
    assert _reported_q(_client(), [(P, P + d, contrib)]) == pytest.approx(expect, rel=1e-5)
    assert _reported_q(_client(), []) == 0.0  # before the prompts have trained once
