"""FedGH and FedAS: each method's core rule, checked so that breaking the rule fails the test
(docs/method.md, "Baselines beyond the paper's own"), and their device side (device/methods.py)."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch
from _coordinator import bodies
from _runs import tiny_config

from fedsga_edge.coordinator.server import screen
from fedsga_edge.device.methods import FedASDevice, FedGHDevice
from fedsga_edge.simulation import Simulation
from fedsga_edge.wire import RemoteProtocolError


def _head_and_body(model) -> tuple[dict, dict]:
    state = {n: v.detach().clone() for n, v in model.state_dict().items()}
    head = {n: v for n, v in state.items() if model.unit_of(n) == model.num_blocks}
    return head, {n: v for n, v in state.items() if n not in head}


def _spy(monkeypatch, cls, hook: str, seen: list) -> None:
    """Record (round's device id, the model right after the hook) each time ``cls.hook`` runs."""
    orig = getattr(cls, hook)

    def spy(self, client, plan):
        out = orig(self, client, plan)
        seen.append((client.cid, _head_and_body(client.model), out))
        return out

    monkeypatch.setattr(cls, hook, spy)


# -- FedGH: the server's head is SGD on the uploaded class means ------------------------------------------

def _softmax_step(W: np.ndarray, b: np.ndarray, x: np.ndarray, label: int, lr: float) -> None:
    """One SGD step of cross-entropy(W x + b, label), by hand: dL/dlogits = softmax - onehot."""
    logits = W @ x + b
    p = np.exp(logits - logits.max())
    p /= p.sum()
    p[label] -= 1.0
    W -= lr * np.outer(p, x)
    b -= lr * p


@pytest.mark.parametrize("epochs", [1, 2])
def test_fedgh_server_head_equals_hand_computed_sgd_on_the_class_means(digits, epochs: int) -> None:
    lr = 0.05
    sim = Simulation(tiny_config("fedgh", rounds=1, clients=2, strategy_args={"server_lr": lr,
                                                                              "server_epochs": epochs}), digits)
    c = sim.coordinator
    c.begin_round(1)
    head = c.model.head
    W, b = head.weight.detach().double().numpy().copy(), head.bias.detach().double().numpy().copy()
    rng = np.random.default_rng(3)
    D = head.in_features
    updates = {  # given out of id order: the server takes the devices in id order, classes as sent
        "client-001": {"method": {"classes": np.array([0, 4, 7]), "counts": np.array([3, 1, 9]),
                                  "means": rng.normal(size=(3, D)).astype(np.float32)}},
        "client-000": {"method": {"classes": np.array([2, 4]), "counts": np.array([5, 5]),
                                  "means": rng.normal(size=(2, D)).astype(np.float32)}},
    }
    for u in updates.values():
        c.strategy.check_update(u)
    with torch.no_grad():  # what the average of the devices' heads left there: the server must not start from it
        head.weight.add_(1.0)
    record: dict = {}
    c.strategy.end_round(updates, record)
    for _ in range(epochs):
        for cid in ("client-000", "client-001"):
            m = updates[cid]["method"]
            for label, x in zip(m["classes"], m["means"]):
                _softmax_step(W, b, np.asarray(x, np.float64), int(label), lr)
    assert np.allclose(head.weight.detach().double().numpy(), W, atol=1e-5)
    assert np.allclose(head.bias.detach().double().numpy(), b, atol=1e-5)
    assert record["class_means"] == 5 and math.isfinite(record["head_loss"])


def test_fedgh_bodies_stay_on_the_devices_and_the_head_is_the_servers(digits, monkeypatch) -> None:
    """Round 2: each device trains from its own round-1 body under the round's global head (not the
    coordinator's averaged body); it uploads one mean per class of the samples it trained on."""
    seen_before: list = []
    seen_report: list = []
    _spy(monkeypatch, FedGHDevice, "before_train", seen_before)
    _spy(monkeypatch, FedGHDevice, "report", seen_report)
    sim = Simulation(tiny_config("fedgh", rounds=2, clients=2, max_batches=2), digits)
    gen = sim.rounds()
    rec1 = next(gen)
    assert rec1["failures"] == {} and rec1["class_means"] > 0
    own = {cl.cid: _head_and_body(cl.model)[1] for cl in sim.clients}  # each device's trained body
    glob_head, glob_body = _head_and_body(sim.coordinator.model)  # round 2 starts from these
    rec2 = next(gen)
    assert rec2["failures"] == {}
    round2 = {cid: model for cid, model, _ in seen_before[2:]}
    assert sorted(round2) == ["client-000", "client-001"]
    for cid, (head, body) in round2.items():
        assert all(torch.equal(body[n], own[cid][n]) for n in body), cid  # its own body, byte for byte
        assert all(torch.equal(head[n], glob_head[n]) for n in head), cid  # the server's head
        assert any(not torch.equal(body[n], glob_body[n]) for n in body if body[n].is_floating_point())
    for cid, _, out in seen_report:  # one mean per class of the batches it trained on
        client = next(cl for cl in sim.clients if cl.cid == cid)
        idx = np.asarray(client.data.indices)[: 2 * 32]
        labels = np.asarray(client.data.images.labels)[idx]
        assert out["classes"].tolist() == sorted(set(labels.tolist()))
        assert out["counts"].tolist() == [int((labels == k).sum()) for k in out["classes"]]
        assert out["means"].shape == (len(out["classes"]), sim.coordinator.model.head.in_features)


def test_fedgh_test_figure_is_the_devices_own_models_not_the_averaged_body(digits) -> None:
    """FedGH has no global model: the headline is the data-weighted mean of each device's model (its own
    trained body under the server's head) on the test set; the averaged body's figure is kept beside it."""
    from fedsga_edge.coordinator.evaluation import evaluate

    sim = Simulation(tiny_config("fedgh", rounds=2, clients=3, max_batches=2), digits)
    *_, rec = list(sim.rounds())
    c = sim.coordinator
    head = {n: v for n, v in c.model.state_dict().items() if c.model.unit_of(n) == c.model.num_blocks}
    accs, weights = [], []
    for cl in sorted(sim.clients, key=lambda cl: cl.cid):
        model = copy.deepcopy(c.model)
        body = {n: v for n, v in cl.model.state_dict().items() if n not in head}
        model.load_state_dict(body | head)
        test = sim.bundle.test
        accs.append(evaluate(model, c.head, c.strategy, c.headline_split(), c.num_classes, test, sim.bundle.mean,
                             sim.bundle.std, c.device)["test_acc"])
        weights.append(c.clients[cl.cid])
    assert rec["test_acc_devices"] == pytest.approx(accs, abs=1e-12)
    assert rec["test_acc"] == pytest.approx(float(np.dot(weights, accs) / sum(weights)), abs=1e-12)
    glob = evaluate(c.model, c.head, c.strategy, c.headline_split(), c.num_classes, sim.bundle.test, sim.bundle.mean,
                    sim.bundle.std, c.device)["test_acc"]
    assert rec["test_acc_global"] == pytest.approx(glob, abs=1e-12)


def test_fedgh_devices_bodies_survive_a_checkpoint(digits, tmp_path) -> None:
    """A resumed coordinator scores the same device models (torch.save / weights_only load, as the service)."""
    cfg = tiny_config("fedgh", rounds=2, clients=2, max_batches=1)
    sim = Simulation(cfg, digits)
    next(sim.rounds())
    torch.save(sim.coordinator.checkpoint_state(), tmp_path / "ck.pt")
    other = Simulation(cfg, digits)
    assert other.coordinator.strategy.test_models() == []
    other.coordinator.restore(torch.load(tmp_path / "ck.pt", weights_only=True))
    a, b = sim.coordinator.strategy.test_models(), other.coordinator.strategy.test_models()
    assert len(a) == len(b) == 2
    for (wa, sa), (wb, sb) in zip(a, b):
        assert wa == wb and sa.keys() == sb.keys() and all(torch.equal(sa[n], sb[n]) for n in sa)


def test_fedgh_refuses_malformed_class_means(digits) -> None:
    sim = Simulation(tiny_config("fedgh", rounds=1, clients=2), digits)
    s = sim.coordinator.strategy
    D = sim.coordinator.model.head.in_features
    good = {"classes": np.array([1, 2]), "counts": np.array([1, 1]), "means": np.zeros((2, D), np.float32)}
    s.check_update({"method": good})
    bad = [None, dict(good, means=np.zeros((2, D + 1), np.float32)), dict(good, classes=np.array([1, 1])),
           dict(good, classes=np.array([1, 10])), dict(good, counts=np.array([0, 1])),
           dict(good, means=np.full((2, D), np.nan, np.float32)), dict(good, classes=np.array([1.0, 2.0]))]
    for m in bad:
        with pytest.raises(RemoteProtocolError):
            s.check_update({"method": m})


def test_strategies_without_a_device_side_refuse_method_fields(digits) -> None:
    sim = Simulation(tiny_config("fedavg", rounds=1, clients=2), digits)
    sim.coordinator.strategy.check_update({"weights": {}})
    with pytest.raises(RemoteProtocolError, match="takes no method fields"):
        sim.coordinator.strategy.check_update({"method": {"fisher": 1.0}})


# -- FedAS: Fisher-weighted aggregation, body alignment, own head ----------------------------------------

def test_fedas_aggregation_is_the_fisher_weighted_average(digits) -> None:
    """Three devices with Fisher 2, 0, 6: the new model is (2 w_0 + 6 w_2) / 8; the device with zero
    Fisher gets no weight however far its model is."""
    sim = Simulation(tiny_config("fedas", rounds=1, clients=3, clip_updates=0.0), digits)
    c = sim.coordinator
    c.begin_round(1)
    snap = {n: v.clone() for n, v in c.model.state_dict().items()}
    L = c.model.num_blocks
    gen = torch.Generator().manual_seed(0)
    fisher = {"client-000": 2.0, "client-001": 0.0, "client-002": 6.0}
    shift = {"client-000": 0.1, "client-001": 100.0, "client-002": -0.3}
    weights = {cid: {n: (v + shift[cid] * torch.randn(v.shape, generator=gen) if v.is_floating_point() else v)
                     for n, v in snap.items()} for cid in fisher}
    updates = {cid: {"depth": L + 1, "weights": {n: v.numpy() for n, v in weights[cid].items()},
                     "method": {"fisher": f}} for cid, f in fisher.items()}
    for u in updates.values():
        c.strategy.check_update(u)
    c._aggregate(*screen(c, updates))
    new = c.model.state_dict()
    for n, v in snap.items():
        if v.is_floating_point():
            want = (2.0 * weights["client-000"][n].double() + 6.0 * weights["client-002"][n].double()) / 8.0
            assert torch.allclose(new[n].double(), want, atol=1e-5), n
    record: dict = {}
    c.strategy.end_round(updates, record)
    assert record["fisher_weights"] == {"client-000": 0.25, "client-001": 0.0, "client-002": 0.75}


def test_fedas_refuses_a_bad_fisher(digits) -> None:
    s = Simulation(tiny_config("fedas", rounds=1, clients=2), digits).coordinator.strategy
    s.check_update({"method": {"fisher": 0.0}})
    for m in (None, {}, {"fisher": True}, {"fisher": -1.0}, {"fisher": float("nan")}, {"fisher": 1e9}):
        with pytest.raises(RemoteProtocolError):
            s.check_update({"method": m})


@pytest.mark.parametrize("align_lr", [0.0, 0.05])
def test_fedas_device_aligns_the_received_body_and_keeps_its_own_head(digits, monkeypatch, align_lr) -> None:
    """Round 2: the device's head is its own round-1 head, not the Fisher-averaged one; its body is the
    received global body moved by the alignment (unmoved with --fedas-align-lr 0)."""
    seen: list = []
    _spy(monkeypatch, FedASDevice, "before_train", seen)
    sim = Simulation(tiny_config("fedas", rounds=2, clients=2, max_batches=2,
                                 strategy_args={"align_lr": align_lr}), digits)
    gen = sim.rounds()
    rec1 = next(gen)
    assert rec1["failures"] == {} and set(rec1["fisher"]) == {"client-000", "client-001"}
    own_head = {cl.cid: _head_and_body(cl.model)[0] for cl in sim.clients}
    glob_head, glob_body = _head_and_body(sim.coordinator.model)
    assert all(f > 0 for f in rec1["fisher"].values())
    assert next(gen)["failures"] == {}
    for cid, (head, body), _ in seen[2:]:
        assert all(torch.equal(head[n], own_head[cid][n]) for n in head), cid
        assert any(not torch.equal(head[n], glob_head[n]) for n in head), cid
        params = [n for n in body if n.endswith("weight") and body[n].is_floating_point()]
        moved = any(not torch.equal(body[n], glob_body[n]) for n in params)
        assert moved == (align_lr > 0), cid


@pytest.mark.parametrize("strategy", ["fedas", "fedgh"])
def test_the_passes_a_method_adds_on_the_device_are_its_client_flops(digits, monkeypatch, strategy) -> None:
    """Each round's method FLOPs are the passes the devices ran, counted sample by sample at the backend:
    through ``align_step`` and ``fisher_trace`` at the whole model's training cost, through ``features`` at
    its forward cost. FedAS aligns from a device's second round on (2 align epochs here), FedGH only takes
    its class means."""
    from fedsga_edge.device.client import TorchBackend

    ran = {"train": 0, "fwd": 0}

    def count(name: str, kind: str) -> None:
        orig = getattr(TorchBackend, name)

        def spy(self, x, *args, **kwargs):
            ran[kind] += len(x)
            return orig(self, x, *args, **kwargs)

        monkeypatch.setattr(TorchBackend, name, spy)

    for name, kind in (("align_step", "train"), ("fisher_trace", "train"), ("features", "fwd")):
        count(name, kind)
    args = {"align_epochs": 2} if strategy == "fedas" else {}
    sim = Simulation(tiny_config(strategy, rounds=2, clients=2, max_batches=1, strategy_args=args), digits)
    costs, gen = sim.coordinator.costs, sim.rounds()
    for t in (1, 2):
        rec = next(gen)
        n = rec["client_samples"]  # one local epoch: every pass goes over the samples trained
        assert ran["fwd"] == n
        assert ran["train"] == (0 if strategy == "fedgh" else n if t == 1 else 3 * n), t
        want = ran["train"] * costs.full_train + ran["fwd"] * costs.full_fwd
        assert rec["method_flops"] == {"client": want}
        assert rec["client_method_flops_per_sample"] == pytest.approx(want / n)
        assert rec["client_flops_per_sample"] == pytest.approx(costs.full_train + want / n)
        ran.update(train=0, fwd=0)


def _client_batch(digits, strategy: str = "fedas"):
    sim = Simulation(tiny_config(strategy, rounds=1, clients=2), digits)
    client = sim.clients[0]
    idx = np.asarray(client.data.indices)[:32]
    x, y = client._inputs(idx, augment=False)
    return client.backend, x, y


def test_align_step_is_one_sgd_step_towards_the_class_prototypes(digits) -> None:
    be, x, y = _client_batch(digits)
    model = be.model
    classes = np.unique(y)[:3]
    means = np.random.default_rng(1).normal(size=(len(classes), model.head.in_features)).astype(np.float32)
    body = [p for blk in model.blocks for p in blk.parameters()]
    before = [p.detach().clone() for p in body]
    head0, _ = _head_and_body(model)
    # by hand: sum over the batch's classes in ``classes`` of the mean squared distance to their prototype
    import copy

    ref = copy.deepcopy(model)
    ref.train()
    f = ref.pool(ref.prefix(x, ref.num_blocks))
    loss = sum(((f[torch.from_numpy(y == k)] - torch.from_numpy(means[i])) ** 2).mean() for i, k in enumerate(classes))
    grads = torch.autograd.grad(loss, [p for blk in ref.blocks for p in blk.parameters()])
    got = be.align_step(x, y, classes, means, 0.1)
    assert got == pytest.approx(float(loss.detach()), rel=1e-5)
    for p, p0, g in zip(body, before, grads):
        assert torch.allclose(p.detach(), p0 - 0.1 * g, atol=1e-6)
    head, _ = _head_and_body(model)
    assert all(torch.equal(head[n], head0[n]) for n in head)  # the head is not aligned
    assert be.align_step(x, y, np.array([99]), means[:1], 0.1) == 0.0  # no class of the batch: no step


def test_fisher_trace_is_the_squared_gradient_of_the_mean_nll_and_leaves_no_trace(digits) -> None:
    be, x, y = _client_batch(digits)
    model = be.model
    state0 = {n: v.clone() for n, v in model.state_dict().items()}
    import copy

    ref = copy.deepcopy(model)
    ref.train()
    nll = torch.nn.functional.cross_entropy(ref(x), torch.from_numpy(y))
    want = sum(float((g.double() ** 2).sum()) for g in torch.autograd.grad(nll, list(ref.parameters())))
    assert be.fisher_trace(x, y) == pytest.approx(want, rel=1e-5)
    assert want > 0
    assert all(torch.equal(v, state0[n]) for n, v in model.state_dict().items())  # BatchNorm statistics too


# -- the device side's refusals --------------------------------------------------------------------------

def test_round_start_with_an_unknown_method_or_bad_settings_is_refused() -> None:
    from fedsga_edge.device.role import check_round_start

    from fedsga_edge.config import TrainConfig

    base = {"train": TrainConfig().to_wire(), "weights": {}, "full": True, "split": None}
    check_round_start(dict(base, method={"name": "fedgh"}))
    check_round_start(dict(base, method={"name": "fedas", "align_lr": 0.01, "align_epochs": 1}))
    for spec in ({"name": "nope"}, {"align_lr": 0.01}, "fedgh", {"name": "fedas", "align_lr": -1.0, "align_epochs": 1},
                 {"name": "fedas", "align_lr": 0.01, "align_epochs": 1.5}, {"name": "fedas"}):
        with pytest.raises(RemoteProtocolError, match="malformed round_start"):
            check_round_start(dict(base, method=spec))


@pytest.mark.parametrize("strategy", ["fedgh", "fedas"])
def test_the_torch_free_device_refuses_them_with_its_reason(digits, strategy: str) -> None:
    """The role on a backend that is not torch (the ONNX device's name) gives the round up, naming why,
    before it loads a weight (tests/test_onnx_device.py runs the real ONNX device on FedAvg's round)."""
    from types import SimpleNamespace

    from fedsga_edge.device.role import SplitClient
    from fedsga_edge.wire import Message

    sim = Simulation(tiny_config(strategy, rounds=1, clients=1), digits)
    body = bodies(sim.coordinator.begin_round(1))["client-000"]
    assert body["method"]["name"] == strategy and body["full"]
    sent: list = []
    peer = SimpleNamespace(send=lambda dst, kind, t, b: sent.append((kind, b)), call=None)
    onnx = SimpleNamespace(name="onnx", num_splits=3, num_blocks=4)
    client = SplitClient("client-000", sim.clients[0].data, onnx, peer, rng=np.random.default_rng(0))
    client.handle(Message("round_start", "run", 1, 0, "coordinator", body))
    assert client.step() is False
    assert sent and sent[0][0] == "error" and "--backend torch" in sent[0][1]["reason"]


def _held_out_acc(sim, cl, state) -> float:
    """The coordinator's evaluation of ``state`` (a whole model) on ``cl``'s held-out slice."""
    from fedsga_edge.coordinator.evaluation import evaluate
    from fedsga_edge.data import ArrayImageSet

    c, b, held = sim.coordinator, sim.bundle, cl.data.eval_indices
    model = copy.deepcopy(c.model)
    model.load_state_dict(state)
    images = ArrayImageSet(b.train.get_batch(held), b.train.labels[held])
    return evaluate(model, c.head, c.strategy, c.headline_split(), c.num_classes, images, b.mean, b.std,
                    c.device)["test_acc"]


def test_the_final_evaluation_scores_the_models_the_devices_use(digits) -> None:
    """The own-data figure of a personalised method is its devices' models, not the averaged one: under FedGH
    each device's own body (the one it uploaded) under the server's final head; under FedAS the final body
    aligned on the device, under the device's own head (the one it kept)."""
    sim = Simulation(tiny_config("fedgh", rounds=2, clients=2, max_batches=2, eval_holdout=0.25), digits)
    *_, rec = list(sim.rounds())
    final = rec["fed_final"]["fed_by_device"]
    models = sim.coordinator.strategy.test_models()  # each device's body under the server's head, by device id
    for cl, (_, state) in zip(sorted(sim.clients, key=lambda cl: cl.cid), models):
        assert final[cl.cid]["acc"] == pytest.approx(_held_out_acc(sim, cl, state), abs=1e-12), cl.cid

    sim = Simulation(tiny_config("fedas", rounds=2, clients=2, max_batches=2, eval_holdout=0.25), digits)
    *_, rec = list(sim.rounds())
    final = rec["fed_final"]["fed_by_device"]
    glob = sim.coordinator.model.state_dict()
    for cl in sim.clients:
        own = cl.method_state["fedas"]["head"]
        state = cl.model.state_dict()
        assert all(np.array_equal(state[n].numpy(), v) for n, v in own.items())  # its own head, not the average
        assert any(not torch.equal(state[n], glob[n]) for n in glob if n not in own)  # the body aligned
        assert final[cl.cid]["acc"] == pytest.approx(_held_out_acc(sim, cl, state), abs=1e-12), cl.cid
