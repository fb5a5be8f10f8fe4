import io
import math

import pytest
import torch

from fedsga_edge.method import Prototypes


def test_prototype_ema_hand_computed():
    p = Prototypes(num_classes=3, dim=2, mu=0.5)
    p.update(torch.tensor([[2.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 0]))
    s = 1 / math.sqrt(2)
    assert torch.allclose(p.tensor()[0], torch.tensor([s, s]))
    assert p.initialized.tolist() == [True, False, False]
    assert torch.equal(p.tensor()[1:], torch.zeros(2, 2))
    p.update(torch.tensor([[0.0, 1.0], [4.0, 0.0]]), torch.tensor([0, 1]))
    blended = torch.tensor([0.5 * s, 0.5 * s + 0.5])
    assert torch.allclose(p.tensor()[0], blended / blended.norm())
    assert torch.allclose(p.tensor()[1], torch.tensor([1.0, 0.0]))  # first sight: the mean itself
    assert p.initialized.tolist() == [True, True, False]


def test_accumulate_commit_equals_one_update():
    torch.manual_seed(0)
    Z, y = torch.randn(10, 4), torch.randint(0, 3, (10,))
    a, b = Prototypes(3, 4), Prototypes(3, 4)
    a.update(torch.randn(6, 4), torch.tensor([0, 1, 2, 0, 1, 2]))
    b.load_state_dict(a.state_dict())
    a.update(Z, y)
    b.accumulate(Z[:4], y[:4])
    b.accumulate(Z[4:], y[4:])
    b.commit()
    assert torch.allclose(a.tensor(), b.tensor())


def test_prototypes_state_dict_round_trip_and_copy():
    p = Prototypes(3, 2)
    p.update(torch.tensor([[1.0, 1.0]]), torch.tensor([2]))
    held = p.tensor()
    buf = io.BytesIO()
    torch.save(p.state_dict(), buf)
    buf.seek(0)
    q = Prototypes(3, 2)
    q.load_state_dict(torch.load(buf, weights_only=True))
    assert torch.equal(q.tensor(), p.tensor()) and torch.equal(q.initialized, p.initialized)
    p.update(torch.tensor([[1.0, -1.0]]), torch.tensor([2]))
    assert not torch.equal(held, p.tensor())  # tensor() handed out a copy


def test_ema_runs_over_directions_so_mu_keeps_its_weight():
    # Harmonized class means have norm ~14. Mixed raw into a unit prototype, 0.1 * 14 e2 outweighs
    # 0.9 * e1 and mu = 0.9 acted like ~0.4; the mean's direction is what enters the EMA.
    p = Prototypes(num_classes=1, dim=2, mu=0.9)
    e1, e2 = torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])
    p.update(e1.unsqueeze(0), torch.tensor([0]))
    p.update(torch.stack([14.0 * e2, 14.0 * e2]), torch.tensor([0, 0]))
    c = p.tensor()[0]
    assert c @ e1 > c @ e2
    expected = torch.tensor([0.9, 0.1])  # mu * e1 + (1 - mu) * e2, then normalised
    assert torch.allclose(c, expected / expected.norm())
    assert c.norm().item() == pytest.approx(1.0)


def test_embedding_scale_does_not_change_the_prototypes():
    torch.manual_seed(1)
    Z, y = torch.randn(12, 5), torch.randint(0, 3, (12,))
    a, b = Prototypes(3, 5), Prototypes(3, 5)
    a.update(torch.randn(9, 5), torch.arange(9) % 3)
    b.load_state_dict(a.state_dict())
    a.update(Z, y)
    b.update(14.0 * Z, y)
    assert torch.allclose(a.tensor(), b.tensor(), atol=1e-6)
