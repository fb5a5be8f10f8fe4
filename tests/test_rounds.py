"""Concurrent rounds, the round state machine, calibration probes and strategies (docs/method.md)."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

from fedsga_edge.wire import RemoteProtocolError
from _coordinator import bodies, only_reply
from _runs import tiny_config
import torch

from fedsga_edge.config import FedSGAConfig, RunConfig, TrainConfig
from fedsga_edge.coordinator import RoundError, RoundState, Strategy, register_strategy
from fedsga_edge.device.fedsga import FedSGADevice
from fedsga_edge.method import reference_index
from fedsga_edge.simulation import Simulation
from fedsga_edge.tensors import probe_mode
from fedsga_edge.wire import Message

TIMING = {"round_s", "wall_s"}


def tiny(strategy: str = "static", **kw) -> RunConfig:
    return tiny_config(strategy, batch_size=16, max_batches=2, **kw)


def strip(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


# -- scheduling --------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", ["round_robin", "random"])
def test_same_seed_same_metrics_bit_for_bit(schedule: str, digits) -> None:
    cfg = lambda: tiny("fedsga", schedule=schedule, partition="dirichlet", alpha=0.5)  # noqa: E731
    a = strip(list(Simulation(cfg(), digits).rounds()))
    b = strip(list(Simulation(cfg(), digits).rounds()))
    assert a == b


def test_one_device_every_schedule_agrees(digits) -> None:
    runs = [strip(list(Simulation(tiny("static", clients=1, rounds=1, schedule=s), digits).rounds()))
            for s in ("round_robin", "random", "sequential")]
    assert runs[0] == runs[1] == runs[2]


def test_schedule_changes_the_order_the_server_sees(digits) -> None:
    """Interleaved and one-after-another training are different computations with >1 device (in the
    fixed device order, so that client-000 goes first; the shuffled order: tests/test_order.py)."""
    rr = Simulation(tiny("static", clients=2, rounds=1, schedule="round_robin", device_order="fixed"), digits)
    seq = Simulation(tiny("static", clients=2, rounds=1, schedule="sequential", device_order="fixed"), digits)
    order = {}
    for name, sim in (("rr", rr), ("seq", seq)):
        seen: list[str] = []
        receive = sim.coordinator.receive

        def spy(msg, now=None, seen=seen, receive=receive):
            if msg.kind == "activation":
                seen.append(msg.sender)
            return receive(msg, now)

        sim.coordinator.receive = spy
        sim.transport._handlers["coordinator"] = sim.peer.serve(spy)
        next(sim.rounds())
        order[name] = seen
    assert order["rr"] == ["client-000", "client-001"] * 2
    assert order["seq"] == ["client-000"] * 2 + ["client-001"] * 2


def test_a_device_that_misses_the_deadline_is_left_out(digits) -> None:
    sim = Simulation(tiny("static", clients=3, rounds=2, round_timeout=1e-4,
                          train=TrainConfig(local_epochs=1, batch_size=16, max_batches=4)), digits)
    before = {k: v.clone() for k, v in sim.model.state_dict().items()}
    rec = next(sim.rounds())
    assert rec["failures"] and all(r == "missed the round deadline" for r in rec["failures"].values())
    assert set(rec["failures"]) | set(rec["splits"]) == set(sim.client_ids)
    assert all(torch.isfinite(v.float()).all() for v in sim.model.state_dict().values())
    if not rec["splits"]:  # nobody finished: the device-side blocks are untouched
        first = next(k for k in before if k.startswith("blocks.0.") and k.endswith("weight"))
        assert torch.equal(before[first], sim.model.state_dict()[first])
    assert not any(c.busy for c in sim.clients)


# -- the round state machine --------------------------------------------------------------------
def test_round_state_refuses_what_its_phase_does_not_allow() -> None:
    rs = RoundState()
    with pytest.raises(RoundError, match="no round is running"):
        rs.check_request("a", 1, "activation")
    rs.begin(1, {"a": 1, "b": None}, calibrate=False, deadline=10.0)
    with pytest.raises(RoundError, match="round 2"):
        rs.check_request("a", 2, "activation")
    with pytest.raises(RoundError, match="not a device"):
        rs.check_request("mallory", 1, "activation")
    rs.check_request("a", 1, "update")
    rs.accept_update("a", {})
    with pytest.raises(RoundError, match="already sent"):
        rs.check_request("a", 1, "activation")
    assert not rs.complete and rs.waiting == ["b"]
    assert not rs.expire(9.9) and rs.expire(10.0)
    assert rs.failures == {"b": "missed the round deadline"} and rs.phase == "closed"
    with pytest.raises(RoundError):
        rs.accept_update("b", {})


def test_each_device_walks_the_round_in_order() -> None:
    """fetch -> activations -> probe -> update; a request out of that order is the device's error."""
    rs = RoundState()
    rs.begin(1, {"a": None, "b": 2}, calibrate=True, deadline=None)
    for kind in ("fetch", "activation", "activation", "probe"):
        rs.check_request("a", 1, kind)
        rs.advance("a", kind)
    for kind in ("fetch", "activation", "probe"):  # nothing but the update after the probe
        with pytest.raises(RoundError, match="after 'a''s 'probed'"):
            rs.check_request("a", 1, kind)
    rs.check_request("b", 1, "activation")
    rs.advance("b", "activation")
    with pytest.raises(RoundError, match="'fetch' is not allowed after 'b''s 'training'"):
        rs.check_request("b", 1, "fetch")  # weights come before training, never in the middle
    rs.check_request("b", 1, "error")  # giving up is allowed at any step
    assert isinstance(RoundError("x"), RemoteProtocolError)  # the sender's fault, refused, never ours


def test_requests_from_outside_the_round_are_refused_and_change_nothing(digits) -> None:
    sim = Simulation(tiny("static", clients=2, rounds=1), digits)
    co = sim.coordinator
    co.begin_round(1)
    state = {k: v.clone() for k, v in co.model.state_dict().items()}
    shape = co.model.interface_shape(co.model.depth_of(2))
    good = {"z": np.ones((4, *shape), np.float32), "y": np.zeros(4, np.int64), "split": 2}
    bad = [
        Message("activation", "sim-0", 1, 1, "mallory", good),  # not a device of the round
        Message("activation", "sim-0", 2, 2, "client-000", good),  # another round
        Message("activation", "sim-0", 1, 3, "client-000", good | {"z": np.full((4, *shape), np.nan, np.float32)}),
        Message("activation", "sim-0", 1, 4, "client-000", good | {"y": np.full(4, 10, np.int64)}),  # label range
        Message("activation", "sim-0", 1, 5, "client-000", good | {"split": 1}),  # not its assigned split
        Message("update", "sim-0", 1, 6, "client-000", {"weights": {}, "num_samples": 5, "depth": 2, "split": 2,
                                                         "train_loss": 0.0}),
    ]
    for msg in bad:
        reply = only_reply(co.receive(msg))
        assert reply is not None and reply.kind == "error", msg
    assert co.remote_errors == len(bad)
    for k, v in co.model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert only_reply(co.receive(Message("activation", "sim-0", 1, 7, "client-000", good))).kind == "gradient"


# -- calibration -------------------------------------------------------------------------------
def _probe_message(co, x: torch.Tensor, y: torch.Tensor, blocks_model) -> Message:
    m = blocks_model
    d1, dref = m.depth_of(1), m.depth_of(reference_index(m.num_splits))
    with probe_mode(m):
        h1 = m.prefix(x, d1)
        href = m.run_blocks(h1, d1, dref)
    body = {"z1": h1.numpy(), "zref": href.numpy(), "y": y.numpy(), "o": [0.5, 0.1, 0.0], "r_prev": 0.0}
    return Message("probe", "sim-0", 1, 1, "client-000", body)


def _digits_batch(digits, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    from fedsga_edge.tensors import image_batch

    idx = np.arange(n)
    x = image_batch(digits.train.get_batch(idx), digits.mean, digits.std, "cpu")
    return x, torch.from_numpy(digits.train.labels[idx].astype(np.int64))


def test_probe_with_equal_blocks_gives_equal_losses_and_changes_no_state(digits) -> None:
    cfg = tiny("fedsga", clients=1, rounds=1, fedsga=FedSGAConfig(harmonizer=False))
    co = Simulation(cfg, digits).coordinator
    co.begin_round(1)
    x, y = _digits_batch(digits)
    before = {k: v.clone() for k, v in co.model.state_dict().items()}
    reply = only_reply(co.receive(_probe_message(co, x, y, co.model)))  # device blocks == the server's blocks
    assert reply.kind == "probe_result" and reply.body == {}  # the label is made at the round's end
    assert len(co.strategy.cal_buffer) == 0
    rec, _ = co.end_round()
    (c,) = co.strategy._calibration
    assert c["L1"] == pytest.approx(c["Lref"], rel=1e-5) and c["s"] == 1 and rec["calibration"]["probes"] == 1
    for k, v in co.model.state_dict().items():  # BatchNorm statistics included
        assert torch.equal(v, before[k]), k
    assert len(co.strategy.cal_buffer) == 1


def test_device_probe_changes_no_state(digits) -> None:
    sim = Simulation(tiny("fedsga", clients=1, rounds=1), digits)
    next(sim.rounds())
    client = sim.clients[0]
    before = {k: v.clone() for k, v in client.model.state_dict().items()}
    client.model.eval()
    probe = FedSGADevice.probe(client, 8, client.state.prompts, [0.1, 0.2, 0.3], 0.5)
    assert probe["z1"].shape[0] == 8 and np.isfinite(probe["zref"]).all()
    for k, v in client.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert not client.model.training  # the mode it had is restored


def test_after_local_training_the_probe_paths_differ(digits) -> None:
    cfg = tiny("fedsga", clients=2, rounds=1, fedsga=FedSGAConfig(harmonizer=False))
    rec = next(Simulation(cfg, digits).rounds())
    for c in rec["clients"].values():
        assert math.isfinite(c["L1"]) and c["L1"] != pytest.approx(c["Lref"], rel=1e-4)
        K = 3  # resnet18_cifar's candidates; p_ref = 2
        assert 1 <= c["k_policy"] <= K
    for cid, c in rec["clients"].items():  # calibration rounds train at least to p_ref, else at the policy's split
        assert rec["splits"][cid] == max(c["k_policy"], 2)


def test_no_harmonizer_labels_take_both_values(digits) -> None:
    # 6 devices: 18 labels (4 devices' 12 were all 1 once the epochs were cut in balanced batches)
    cfg = tiny("fedsga", clients=6, rounds=3, partition="dirichlet", alpha=0.3,
               fedsga=FedSGAConfig(harmonizer=False, cal_every=1),
               train=TrainConfig(local_epochs=1, batch_size=32, max_batches=4))
    labels = [c["s"] for r in Simulation(cfg, digits).rounds() for c in r["clients"].values()]
    assert set(labels) == {0, 1}, labels


def test_estimator_is_refit_once_per_calibration_round_and_used_next_round(digits, monkeypatch) -> None:
    sim = Simulation(tiny("fedsga", clients=2, rounds=3, fedsga=FedSGAConfig(cal_every=2)), digits)
    co = sim.coordinator
    fits = []
    import fedsga_edge.method as method

    real_fit = method.fit

    def counting_fit(est, buf):
        fits.append(len(buf))
        return real_fit(est, buf)

    monkeypatch.setattr(method, "fit", counting_fit)  # the FedSGA strategy looks it up at the round's end
    r1, r2, r3 = list(sim.rounds())
    # round 1 calibrates but its pairs (first observations) are not stored, so Gamma keeps its prior;
    # round 2 calibrates (2 pairs, one refit); round 3 does not
    assert fits == [2]
    assert r1["calibration"]["pairs"] == 0 and r1["calibration"]["brier"] is None
    assert "calibration" in r2 and "calibration" not in r3
    assert all("s" in c for c in r2["clients"].values()) and not any("s" in c for c in r3["clients"].values())


# -- evaluation, costs, strategies -------------------------------------------------------------
def test_evaluation_under_every_depth_embedding(digits) -> None:
    sim = Simulation(tiny("fedsga", clients=2, rounds=1), digits)
    rec = next(sim.rounds())
    by_split = rec["test_acc_by_split"]
    assert set(by_split) == {"1", "2", "3"}
    assert rec["test_acc"] == by_split[str(rec["eval_split"])]
    trained = rec["splits"].values()
    assert rec["eval_split"] in set(trained)
    share = rec["test_pred_share"]  # the headline model's predictions per class, summing to 1
    assert len(share) == 10 and sum(share) == pytest.approx(1.0, abs=1e-3) and min(share) >= 0


def test_the_headline_embedding_follows_the_latest_round_not_the_run(digits) -> None:
    """Splits that shift (p_2 for two rounds, then p_3) are scored with the embedding trained last: the run's
    cumulative samples would still say p_2 in round 3 (2 rounds against 1)."""
    sim = Simulation(tiny("fedsga", clients=2, rounds=3, fedsga=FedSGAConfig(estimator=False)), digits)
    sim.strategy.assign = lambda t, clients: {c: 2 if t <= 2 else 3 for c in clients}
    recs = list(sim.rounds())
    assert [set(r["splits"].values()) for r in recs] == [{2}, {2}, {3}]
    assert [r["eval_split"] for r in recs] == [2, 2, 3]
    assert recs[2]["test_acc"] == recs[2]["test_acc_by_split"]["3"]


def test_client_flops_are_weighted_by_data(digits) -> None:
    """Every sample trained once (no batch cap), so the samples trained are |D_i| (tests/test_cost.py)."""
    sim = Simulation(tiny_config("random", clients=3, rounds=1, partition="dirichlet", alpha=0.3, train_subset=240,
                                 batch_size=16, max_batches=0), digits)
    rec = next(sim.rounds())
    sizes = sim.coordinator.clients
    expect = sum(sizes[c] * sim.costs.train(k) for c, k in rec["splits"].items()) / sum(sizes[c] for c in rec["splits"])
    assert rec["client_flops_per_sample"] == pytest.approx(expect)
    if len(set(rec["splits"].values())) > 1:
        plain = np.mean([sim.costs.train(k) for k in rec["splits"].values()])
        assert rec["client_flops_per_sample"] != pytest.approx(plain)


def test_fedprox_config_uses_the_cli_default_mu(digits) -> None:
    from fedsga_edge.cli.simulate import simulate

    cli_mu = inspect.signature(simulate).parameters["mu"].default.default
    sim = Simulation(tiny("fedprox", clients=1, rounds=1), digits)
    starts = bodies(sim.coordinator.begin_round(1))
    assert starts["client-000"]["train"]["mu"] == cli_mu == RunConfig().prox_mu > 0
    static = bodies(Simulation(tiny("static", clients=1, rounds=1), digits).coordinator.begin_round(1))
    assert static["client-000"]["train"]["mu"] == 0.0


@register_strategy
class _Shallowest(Strategy):
    """A baseline in one class: everyone at p_1 (the registry is all the coordinator needs)."""

    name = "test-shallowest"

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: 1 for c in clients}


def test_a_new_strategy_is_one_registered_class(digits) -> None:
    rec = next(Simulation(tiny("test-shallowest", clients=2, rounds=1), digits).rounds())
    assert set(rec["splits"].values()) == {1} and rec["failures"] == {}


def test_mixed_depths_aggregate_through_the_coordinator(digits) -> None:
    """Random splits: each block's new value is the data-weighted mean of the devices that ran it
    and the server's copy weighted by the data of the devices whose activations passed through it."""
    sim = Simulation(tiny("random", clients=3, rounds=1, partition="dirichlet", alpha=0.5, seed=3), digits)
    co = sim.coordinator
    seen = {}
    aggregate = co._aggregate

    def spy(updates, *screened):
        seen["updates"] = {c: dict(u) for c, u in updates.items()}
        seen["server"] = {k: v.clone() for k, v in co.model.state_dict().items()}
        return aggregate(updates, *screened)

    co._aggregate = spy
    rec = next(sim.rounds())
    assert len(set(rec["splits"].values())) > 1, "seed 3 should give mixed depths"
    L = co.model.num_blocks
    for j in range(L):
        name = next(n for n in co.model.state_dict() if n.startswith(f"blocks.{j}.") and n.endswith("weight"))
        num, den = torch.zeros_like(seen["server"][name], dtype=torch.float64), 0.0
        server_w = 0.0
        for cid, u in seen["updates"].items():
            n = float(co.clients[cid])
            if int(u["depth"]) > j:
                num += n * torch.from_numpy(np.array(u["weights"][name])).double()
                den += n
            else:
                server_w += n
        num += server_w * seen["server"][name].double()
        den += server_w
        assert torch.allclose(co.model.state_dict()[name].double(), num / den, atol=1e-6), name


def test_the_envelope_alone_refuses_strangers_odd_kinds_and_other_rounds() -> None:
    """What the coordinator refuses before a body is decoded (the Peer's admit hook in the service)."""
    rs = RoundState()
    devices = {"a": 10, "b": 20}
    rs.check_envelope("a", "hello", 0, devices)  # registration comes before any round
    with pytest.raises(RoundError, match="no round is running"):
        rs.check_envelope("a", "activation", 1, devices)
    rs.begin(1, {"a": 1, "b": 1}, calibrate=False, deadline=None)
    rs.check_envelope("b", "update", 1, devices)
    for sender, kind, rnd, why in (("mallory", "activation", 1, "unknown device"), ("a", "round_start", 1, "does not send"),
                                   ("a", "gradient", 1, "does not send"), ("a", "activation", 2**64 - 1, "round 1 is running")):
        with pytest.raises(RoundError, match=why):
            rs.check_envelope(sender, kind, rnd, devices)


def test_the_depth_mean_figure_is_the_averaged_softmax_of_the_depth_heads() -> None:
    """Two depth heads that each get one of two samples wrong, by a small margin, and the other right by a
    large one: their averaged softmax gets both right. A strategy with one head (key 0) has no such figure."""
    from types import SimpleNamespace

    from fedsga_edge.coordinator.evaluation import evaluate

    heads = {1: torch.tensor([[3.0, 0.0], [0.1, 0.0]]),   # sample 0 (class 0) right, sample 1 (class 1) wrong
             2: torch.tensor([[0.0, 0.1], [0.0, 3.0]])}   # sample 0 wrong, sample 1 right

    class Images:
        labels = np.array([0, 1])

        def __len__(self) -> int:
            return 2

        def get_batch(self, idx: np.ndarray) -> np.ndarray:
            return np.zeros((len(idx), 2, 2, 3), np.uint8)

    model = SimpleNamespace(num_splits=2, eval=lambda: None, features=lambda x: x)
    for by_k, expect in ((heads, 1.0), ({0: heads[1]}, None)):
        strategy = SimpleNamespace(eval_logits=lambda m, f, by_k=by_k: by_k)
        rec = evaluate(model, torch.nn.Identity(), strategy, 1, 2, Images(), (0.0,) * 3, (1.0,) * 3, torch.device("cpu"))
        assert rec["test_acc"] == 0.5
        if expect is None:
            assert "test_acc_depth_mean" not in rec
        else:
            assert rec["test_acc_by_split"] == {"1": 0.5, "2": 0.5} and rec["test_acc_depth_mean"] == expect
