import io

import pytest
import torch

from fedsga_edge.method import CalibrationBuffer, MonotoneEstimator, fit


def _random_inputs(n: int, num_obs: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    a = torch.rand(n, 1, generator=gen, dtype=torch.float64) * 2 - 1
    rest = torch.rand(n, num_obs - 1, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(
        -4, 3, (n, num_obs - 1), generator=gen
    )
    return torch.cat([a, rest], dim=1), torch.rand(n, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("num_obs", [2, 3])
def test_monotone_for_random_weights_and_inputs(num_obs):
    gen = torch.Generator().manual_seed(num_obs)
    for _ in range(5):
        est = MonotoneEstimator(num_obs=num_obs, hidden=8).double()
        with torch.no_grad():
            for p in est.parameters():
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 3)
            est.obs_scale.copy_(torch.rand(num_obs, generator=gen, dtype=torch.float64) * 5 + 1e-3)
        obs, r_prev = _random_inputs(64, num_obs, gen)
        base = est(obs, r_prev)
        assert bool(((base >= 0) & (base <= 1)).all())
        step = torch.rand(64, generator=gen, dtype=torch.float64) + 1e-3
        for j, direction in enumerate([1.0, -1.0, -1.0][:num_obs]):
            moved = obs.clone()
            moved[:, j] += step
            assert bool((direction * (est(moved, r_prev) - base) >= -1e-12).all()), j
        assert bool((est(obs, r_prev + step) - base >= -1e-12).all())


def test_untrained_output_near_half_and_in_range():
    torch.manual_seed(0)
    est = MonotoneEstimator()
    obs = torch.tensor([[1.0, 0.0, 0.0], [-1.0, 1e6, 1e6], [0.3, 2.0, 0.01]])
    r = est(obs, torch.tensor([1.0, 0.0, 0.5]))
    assert r.shape == (3,)
    assert bool(((r > 0.47) & (r < 0.53)).all())


def _toy_buffer(n: int = 64) -> CalibrationBuffer:
    gen = torch.Generator().manual_seed(0)
    buf = CalibrationBuffer(num_obs=3)
    while len(buf) < n:
        a = float(torch.rand((), generator=gen)) * 2 - 1
        delta = float(torch.rand((), generator=gen)) * 50.0  # arbitrary scales
        q = float(torch.rand((), generator=gen)) * 0.01
        r_prev = float(torch.rand((), generator=gen))
        score = a - delta / 50 - q / 0.01 + 0.8
        if abs(score) > 0.15:
            buf.append(torch.tensor([a, delta, q]), r_prev, int(score > 0))
    return buf


def test_fit_separates_monotone_toy_problem_deterministically():
    buf = _toy_buffer()
    torch.manual_seed(1)
    est = MonotoneEstimator()
    twin = MonotoneEstimator()
    twin.load_state_dict(est.state_dict())
    before = fit(MonotoneEstimator(), buf, steps=0)
    stats = fit(est, buf, steps=200, lr=0.05)
    assert stats["accuracy"] >= 0.95
    assert stats["loss"] < before["loss"] and stats["brier"] < before["brier"]
    assert stats == fit(twin, buf, steps=200, lr=0.05)
    assert torch.allclose(est.obs_scale[1:], buf.tensors()[0][:, 1:].abs().median(0).values)


def test_fit_rejects_empty_or_mismatched_buffer():
    with pytest.raises(ValueError):
        fit(MonotoneEstimator(), CalibrationBuffer())
    buf = CalibrationBuffer(num_obs=2)
    buf.append([0.1, 0.2], 0.5, 1)
    with pytest.raises(ValueError):
        fit(MonotoneEstimator(num_obs=3), buf)


def test_state_dict_round_trips():
    buf = _toy_buffer(8)
    est = MonotoneEstimator()
    fit(est, buf, steps=5)
    saved = io.BytesIO()
    torch.save({"est": est.state_dict(), "buf": buf.state_dict()}, saved)
    saved.seek(0)
    state = torch.load(saved, weights_only=True)
    est2, buf2 = MonotoneEstimator(), CalibrationBuffer()
    est2.load_state_dict(state["est"])
    buf2.load_state_dict(state["buf"])
    obs, r_prev, s = buf.tensors()
    assert len(buf2) == 8 and all(torch.equal(x, y) for x, y in zip(buf.tensors(), buf2.tensors()))
    assert torch.equal(est(obs, r_prev), est2(obs, r_prev))
    with pytest.raises(ValueError):
        buf.append([0.1, 0.2], 0.5, 1)
