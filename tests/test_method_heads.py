"""The device's numpy forwards of phi_s and Gamma equal the coordinator's torch modules."""

import numpy as np
import pytest
import torch

from fedsga_edge.method import MonotoneEstimator, ShallowHead, estimate, shallow_head
from fedsga_edge.method.estimator import CalibrationBuffer, fit
from fedsga_edge.method.heads import HeadError


def _np(module: torch.nn.Module) -> dict[str, np.ndarray]:
    return {k: v.detach().numpy() for k, v in module.state_dict().items()}


def test_shallow_head_matches_torch() -> None:
    torch.manual_seed(0)
    head = ShallowHead(in_dim=16, proto_dim=8)
    x = torch.randn(5, 16)
    np.testing.assert_allclose(shallow_head(_np(head), x.numpy()), head(x).detach().numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("num_obs", [3, 2])
def test_estimate_matches_torch_after_a_fit(num_obs: int) -> None:
    torch.manual_seed(1)
    gamma = MonotoneEstimator(num_obs=num_obs)
    buf = CalibrationBuffer(num_obs)
    rng = np.random.default_rng(0)
    for _ in range(20):  # a fit sets the input scales and moves every weight off its start
        o = rng.random(num_obs) * [1.0, 30.0, 5.0][:num_obs]
        buf.append(o.tolist(), float(rng.random()), int(o[0] > 0.5))
    fit(gamma, buf, steps=50)
    state = _np(gamma)
    for _ in range(5):
        o, r_prev = rng.random(num_obs) * 10, float(rng.random())
        want = gamma(torch.tensor(o[None], dtype=torch.float32), torch.tensor([r_prev])).item()
        assert estimate(state, o, r_prev) == pytest.approx(want, abs=1e-6)


def test_bad_weights_are_named() -> None:
    state = _np(MonotoneEstimator(3))
    with pytest.raises(HeadError, match="observation of 2"):
        estimate(state, [0.1, 0.2], 0.5)
    state.pop("w1_raw")
    with pytest.raises(HeadError, match="w1_raw"):
        estimate(state, [0.1, 0.2, 0.3], 0.5)
    head = _np(ShallowHead(4, 3))
    head["net.0.weight"] = np.full((3, 4), np.nan, np.float32)
    with pytest.raises(HeadError, match="finite"):
        shallow_head(head, np.ones((2, 4)))
    with pytest.raises(HeadError, match="fit features"):
        shallow_head(_np(ShallowHead(4, 3)), np.ones((2, 5)))
