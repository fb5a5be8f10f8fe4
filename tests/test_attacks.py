"""A device that keeps attacking inside the bounds (benchmarks/attacks.py, docs/protocol.md "Robust
aggregation", "Claims", "Anomaly scores and quarantine"): each class of attack against the defence meant for it,
on a tiny run (digits, a narrow resnet, one batch a round)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from _bench import load_bench

from fedsga_edge.coordinator.limits import capped_samples
from fedsga_edge.coordinator.server import weighed_samples

TINY = dict(seed=0, width=0.125, max_batches=1, server_copies="per_client")


@pytest.fixture(scope="module")
def attacks():
    return load_bench("attacks")


def _capture_updates(sim) -> dict[str, dict]:
    """Every device's update weights as the coordinator receives them (the attacker's after its rewrite)."""
    seen: dict[str, dict] = {}
    receive = sim.coordinator.receive

    def wrapped(msg, *a, **k):
        if msg.kind == "update":
            seen[msg.sender] = {n: np.array(v) for n, v in msg.body["weights"].items()}
        return receive(msg, *a, **k)
    sim.coordinator.receive = wrapped
    return seen


@pytest.mark.parametrize("scenario", ["scaled", "drag"])
def test_a_device_whose_activations_stay_off_the_fleets_is_quarantined_and_nobody_else(attacks, digits,
                                                                                      scenario) -> None:
    _, records = attacks.simulate(scenario, "on", digits, clients=4, rounds=3, **TINY)
    attacker = attacks.ATTACKER
    score = records[0]["anomaly"][attacker]["act"]
    assert (score > 1.0) if scenario == "scaled" else (score < -5.0)  # log2 of 2.9 and of 1e-3
    assert all(abs(s.get("act", 0.0)) < 1.0 for d, s in records[0]["anomaly"].items() if d != attacker)
    assert set(records[0]["held_out"]) == {attacker}  # out of the very round it scored in
    assert set(records[1]["quarantined"]) == {attacker} and "activations" in records[1]["quarantined"][attacker]
    assert attacker not in records[2]["splits"]  # refused from then on
    assert not records[2].get("clipped", {}).get("activations")  # the honest devices' bound was never dragged


@pytest.mark.parametrize("scenario", ["sign_flip", "label_flip"])
def test_median_aggregation_keeps_every_coordinate_within_the_honest_copies(attacks, digits, scenario) -> None:
    from fedsga_edge.simulation import Simulation

    cfg = replace(attacks.config(scenario, "off", clients=5, rounds=1, **TINY), aggregation="median")
    sim = Simulation(cfg, digits)
    attacks.Attacker(sim, scenario)
    seen = _capture_updates(sim)
    rec = sim.run_round(1)
    assert set(rec["splits"]) == set(seen)
    new = sim.coordinator.model.state_dict()
    honest = [w for d, w in seen.items() if d != attacks.ATTACKER]
    for name, w in seen[attacks.ATTACKER].items():  # the device-side block at split 1
        if w.dtype.kind != "f":
            continue
        lo, hi = np.min([h[name] for h in honest], axis=0), np.max([h[name] for h in honest], axis=0)
        got = new[name].numpy()
        assert (got >= lo - 1e-6).all() and (got <= hi + 1e-6).all(), name
    if scenario == "sign_flip":  # its change is 4.9x the others' the wrong way: the update score says so
        assert rec["anomaly"][attacks.ATTACKER]["update"] > 1.0


def test_a_sign_flipped_update_leaves_the_very_round_it_was_sent_in(attacks, digits) -> None:
    from fedsga_edge.simulation import Simulation

    sim = Simulation(attacks.config("sign_flip", "on", clients=5, rounds=1, **TINY), digits)
    attacks.Attacker(sim, "sign_flip")
    seen = _capture_updates(sim)
    rec = sim.run_round(1)
    attacker = attacks.ATTACKER
    assert set(rec["held_out"]) == {attacker} and "direction" in rec["held_out"][attacker]
    assert rec["anomaly"][attacker]["direction"] < 0 < min(s["direction"] for d, s in rec["anomaly"].items()
                                                              if d != attacker)
    new = sim.coordinator.model.state_dict()
    honest = [d for d in seen if d != attacker]
    counts = sim.coordinator.clients
    for name, w in seen[attacker].items():  # the device-side block: the honest copies' weighted mean
        if w.dtype.kind == "f":
            mean = sum(counts[d] * seen[d][name].astype(np.float64) for d in honest) / sum(counts[d] for d in honest)
            assert np.allclose(new[name].numpy(), mean, atol=1e-5), name


def test_a_claimed_sample_count_weighs_at_most_the_cap_times_the_fleets_median(attacks, digits) -> None:
    from fedsga_edge.simulation import Simulation

    assert capped_samples({"a": 100, "b": 120, "evil": 10**9}, "evil", 3.0) == 360.0
    assert capped_samples({"a": 100, "b": 120, "evil": 10**9}, "evil", 0.0) == 10**9  # 0: as claimed
    sim = Simulation(attacks.config("sample_lie", "on", clients=4, rounds=1, **TINY), digits)
    attacks.Attacker(sim, "sample_lie")
    co = sim.coordinator
    honest = [n for d, n in co.clients.items() if d != attacks.ATTACKER]
    assert weighed_samples(co, attacks.ATTACKER) == pytest.approx(3.0 * float(np.median(honest + [10**9])))
    assert weighed_samples(co, "client-000") == co.clients["client-000"]  # an honest claim under the cap stands
    assert attacks.ATTACKER in sim.run_round(1)["splits"]  # the lie is consistent, so its update is accepted


def test_a_forged_evaluation_moves_the_weighted_figure_but_not_the_median(attacks, digits) -> None:
    _, records = attacks.simulate("forged_eval", "on", digits, clients=5, rounds=2, **TINY)
    rec = next(r for r in records if "fed_by_device" in r)
    by_device = rec["fed_by_device"]
    assert by_device[attacks.ATTACKER]["acc"] == 1.0  # accepted: a figure in range is a claim, not an error
    honest = [v["acc"] for d, v in by_device.items() if d != attacks.ATTACKER]
    assert min(honest) <= rec["fed_acc_median"] <= max(honest)
    assert rec["fed_acc_median"] == pytest.approx(float(np.median(honest + [1.0])))


def test_quarantine_needs_a_streak_of_rounds_and_survives_a_checkpoint() -> None:
    from fedsga_edge.coordinator.anomaly import AnomalyScores
    from fedsga_edge.wire import RemoteProtocolError

    scores = AnomalyScores(threshold=1.0, rounds=2)
    honest = {"a": 0.1, "b": -0.2, "c": 0.0}
    _, held = scores.observe(1, honest | {"evil": 1.5}, {})
    assert set(held) == {"evil"}  # left out of the round it scored in, before any streak
    _, held = scores.observe(2, honest | {"evil": 0.3}, {})  # one odd round, then an ordinary one: the streak restarts
    assert not scores.quarantined and not held
    _, held = scores.observe(3, honest, {"evil": 3.0})  # an update's norm alone is recorded, it acts on nothing
    assert not held and not scores.quarantined
    scores.observe(3, honest, {}, direction={"a": 0.9, "b": 0.8, "c": 0.7, "evil": -0.5})
    rec, held = scores.observe(4, honest, {"evil": 2.0}, direction={"a": 0.9, "b": 0.8, "c": 0.7, "evil": -0.6})
    assert rec["evil"] == {"update": 2.0, "direction": -0.6} and set(scores.quarantined) == {"evil"}
    assert set(held) == {"evil"}
    assert "round 4" in scores.quarantined["evil"] and "direction -0.60" in scores.quarantined["evil"]
    restored = AnomalyScores(threshold=1.0, rounds=2)
    restored.load_state_dict(scores.state_dict())
    with pytest.raises(RemoteProtocolError, match="quarantined: round 4"):
        restored.check("evil")
    restored.check("a")
    off = AnomalyScores(threshold=0.0, rounds=1)  # off: scores recorded, nobody quarantined
    assert off.observe(1, {"evil": 9.0}, {}) == ({"evil": {"act": 9.0}}, {}) and not off.quarantined
    few = AnomalyScores(threshold=1.0, rounds=1)  # two others: one of them may be the attacker, nothing acts
    assert few.observe(1, {"a": 0.0, "b": 0.0, "evil": 9.0}, {})[1] == {} and not few.quarantined
    loss = AnomalyScores(threshold=1.0, rounds=1)  # a loss counts upwards only
    _, held = loss.observe(1, {}, {}, honest | {"evil": 3.0, "fits": -3.0})
    assert set(held) == {"evil"}


def test_the_first_batch_loss_is_the_rounds_and_a_low_loss_never_counts() -> None:
    from fedsga_edge.coordinator.anomaly import LOSS_FLOOR, AnomalyScores

    scores = AnomalyScores(threshold=1.0, rounds=2)
    for d, loss in {"a": 0.2, "b": 0.3, "c": 0.25, "flip": 3.0, "fits": 0.0}.items():
        scores.step_loss(d, loss)
        scores.step_loss(d, 0.01)  # later steps of the round: the copy has trained on the batch already
    got = scores.loss_scores(list(scores.losses))
    assert got["flip"] == pytest.approx(np.log2((3.0 + LOSS_FLOOR) / (0.25 + LOSS_FLOOR)))  # the upper median
    assert got["fits"] < -0.9 and all(abs(got[d]) < 0.6 for d in "abc")
    assert set(scores.observe(2, {}, {}, got)[1]) == {"flip"}
    scores.begin_round()
    assert not scores.losses


@pytest.mark.full("two 6-round runs at the benchmark's regime (about 5 minutes on the shared 2 cores)")
def test_labels_flipped_are_left_out_while_an_honest_device_with_skewed_labels_is_not(attacks, digits) -> None:
    regime = dict(seed=100, clients=5, rounds=6, width=0.125, max_batches=0, server_copies="per_client",
                  momentum=0.9)
    _, flipped = attacks.simulate("label_flip", "on", digits, **regime)
    held = [r.get("held_out", {}) for r in flipped]
    assert any(attacks.ATTACKER in h and "loss" in h[attacks.ATTACKER] for h in held)
    assert not any(d != attacks.ATTACKER for h in held for d in h)
    _, skewed = attacks.simulate("clean", "on", digits, partition="dirichlet", alpha=0.1, **regime)
    assert not any(r.get("held_out") for r in skewed) and not skewed[-1].get("quarantined")


def test_the_summary_pairs_each_attack_with_the_clean_run_of_its_seed(attacks) -> None:
    runs = {f"{d}/{sc}/{seed}": {"final_acc": acc, "quarantined": {attacks.ATTACKER: "x"} if sc != "clean" else {},
                                 "honest_held_rounds": 0}
            for d, sc, seed, acc in [("on", "clean", 0, 0.90), ("on", "clean", 1, 0.95), ("off", "clean", 0, 0.91),
                                     ("off", "clean", 1, 0.95), ("on", "scaled", 1, 0.94), ("on", "scaled", 0, 0.92)]}
    text = attacks.summary({"runs": runs})
    # seed 0: +2 points, seed 1: -1 point: mean +0.5, SE = std([2, -1]) / sqrt 2 = 1.5
    assert "| on | scaled | 0.920, 0.940 | +0.5 ± 1.5 (1/2) | 2/2 | 0 |" in text
    assert "on minus off, paired over 2 seeds): -0.50 ± 0.50 points" in text


def test_a_batch_off_the_fleets_norms_is_refused_before_it_steps_the_server() -> None:
    import torch

    from fedsga_edge.coordinator.anomaly import AnomalyScores
    from fedsga_edge.coordinator.influence import ActivationBound
    from fedsga_edge.wire import RemoteProtocolError

    bounds, scores = ActivationBound(3.0), AnomalyScores(threshold=1.0, rounds=2)
    for d, m in (("a", 1.0), ("b", 1.1)):
        bounds.accept(d, 1, torch.full((8,), m))
    scores.check_batch(bounds, 1, "evil", torch.full((8,), 2.9))  # two others: one of them may be the liar
    bounds.accept("c", 1, torch.full((8,), 0.9))
    scores.check_batch(bounds, 1, "d", torch.full((8,), 1.2))  # honest spread passes
    with pytest.raises(RemoteProtocolError, match="refused as anomalous"):
        scores.check_batch(bounds, 1, "evil", torch.full((8,), 2.9))
    assert bounds.median(1, "evil") == pytest.approx(2.9)  # remembered as sent: its round score says the same
    _, held = scores.observe(1, {}, {})
    assert set(held) == {"evil"} and scores.streak["evil"] == 1
    off = AnomalyScores(threshold=0.0, rounds=2)  # off: nothing refused
    off.check_batch(bounds, 1, "evil", torch.full((8,), 1e-3))


@pytest.mark.parametrize("n", [2, 3, 4, 7, 10])
def test_each_devices_others_median_is_the_median_of_the_others_from_one_sort(n) -> None:
    """The direction score's reference (coordinator/anomaly.py): per device the coordinate-wise median of every
    other device's change, from one sort of all of them; equal to a median taken without each row, ties too."""
    import torch

    from fedsga_edge.coordinator.anomaly import _leave_one_out_medians

    g = torch.Generator().manual_seed(n)
    rows = [torch.randint(-3, 4, (257,), generator=g).double() for _ in range(n)]  # small ints: many ties
    others = _leave_one_out_medians(rows)
    for i in range(n):
        want = torch.stack([r for j, r in enumerate(rows) if j != i]).median(dim=0).values
        assert torch.equal(others(i), want), i
