"""The baselines beyond the paper's own: each method's core rule, checked so that breaking the
rule fails the test (docs/method.md, "Baselines beyond the paper's own")."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from _coordinator import bodies
from _runs import tiny_config

from fedsga_edge.simulation import Simulation
from fedsga_edge.wire import RemoteProtocolError


# -- MU-SplitFed: tau server steps per activation --------------------------------------------------------

def _activation(sim: Simulation, k: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    model = sim.coordinator.model
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(n, *model.interface_shape(model.depth_of(k), 0), generator=gen)
    return z, torch.randint(0, 10, (n,), generator=gen)


def _hand_steps(model, head, cfg, z, y, k: int, steps: int) -> tuple[dict, torch.Tensor]:
    """``steps`` plain SGD steps of suffix + head on one activation; the state and the first step's dz."""
    model, head = copy.deepcopy(model), copy.deepcopy(head)
    tc = cfg.train
    opt = torch.optim.SGD(list(model.parameters()) + list(head.parameters()), lr=tc.lr, momentum=tc.momentum,
                          weight_decay=tc.weight_decay)
    model.train()
    dz = None
    for _ in range(steps):
        zz = z.clone().requires_grad_(True)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model.head(model.suffix(zz, model.depth_of(k))), y).backward()
        opt.step()
        dz = zz.grad if dz is None else dz
    return model.state_dict(), dz


@pytest.mark.parametrize("tau", [1, 3])
def test_musplitfed_server_takes_exactly_tau_steps_per_activation(digits, tau: int) -> None:
    sim = Simulation(tiny_config("musplitfed", rounds=1, clients=2, strategy_args={"tau": tau}), digits)
    c = sim.coordinator
    k = sim.cfg.split
    z, y = _activation(sim, k)
    expected = {s: _hand_steps(c.model, c.head, sim.cfg, z, y, k, s) for s in (tau - 1, tau, tau + 1) if s}
    count = {"steps": 0}
    opt_step = c.server.shared.opt.step

    def counted(*a, **kw):
        count["steps"] += 1
        return opt_step(*a, **kw)

    c.server.shared.opt.step = counted
    zz = z.clone()
    c.server.step("client-000", zz, y, k, c.strategy)
    assert count["steps"] == tau
    state = c.model.state_dict()
    for s, (want, dz) in expected.items():
        same = all(torch.equal(state[n], want[n]) for n in want)
        assert same == (s == tau), f"server state {'differs from' if s == tau else 'equals'} {s} hand-made steps"
    assert torch.equal(zz.grad, expected[tau][1])  # the device's gradient: the first step's


def test_musplitfed_round_counts_tau_steps_for_every_activation(digits) -> None:
    """In a simulated round, every device batch (one activation) moves the server tau times."""
    tau, clients, batches = 3, 2, 2
    sim = Simulation(tiny_config("musplitfed", rounds=1, clients=clients, max_batches=batches,
                                 strategy_args={"tau": tau}), digits)
    opt = sim.coordinator.server.shared.opt
    count = {"steps": 0}
    opt_step = opt.step

    def counted(*a, **kw):
        count["steps"] += 1
        return opt_step(*a, **kw)

    opt.step = counted
    rec = next(sim.rounds())
    assert rec["failures"] == {} and len(rec["splits"]) == clients
    assert count["steps"] == tau * clients * batches


def test_musplitfed_with_per_client_copies_steps_each_device_copy_tau_times(digits) -> None:
    """With SplitFed-v1's per-client copies (the cifar-v1 preset) each device's own copy takes the tau steps:
    after a round of one batch per device, each copy equals tau hand-made steps from the round's snapshot."""
    from fedsga_edge.coordinator.server_side import PerClientServer

    tau = 3
    sim = Simulation(tiny_config("musplitfed", rounds=1, clients=2, max_batches=1, server_copies="per_client",
                                 strategy_args={"tau": tau}), digits)
    c = sim.coordinator
    assert isinstance(c.server, PerClientServer) and c.server.steps == tau
    c.begin_round(1)
    before = {n: v.clone() for n, v in c.model.state_dict().items()}
    k = sim.cfg.split
    for device in ("client-000", "client-001"):
        z, y = _activation(sim, k)
        want, dz = _hand_steps(c.model, c.head, sim.cfg, z, y, k, tau)
        zz = z.clone()
        c.server.step(device, zz, y, k, c.strategy)
        got = c.server.copy_for(device).model.state_dict()
        assert all(torch.equal(got[n], want[n]) for n in want), device
        assert torch.equal(zz.grad, dz)  # the first step's gradient goes back to the device
    assert all(torch.equal(v, before[n]) for n, v in c.model.state_dict().items())  # copies only: the global waits


def test_musplitfed_refuses_the_bn_context_it_cannot_step() -> None:
    from fedsga_edge.coordinator.server_side import make_server_side
    from torch import nn

    cfg = tiny_config("musplitfed", server_bn_context=2)
    with pytest.raises(ValueError, match="server-bn-context"):
        make_server_side(nn.Linear(2, 2), nn.Module(), cfg, lambda d: 1.0, steps=2)


# -- FedMut: mutated copies that average to the global model ---------------------------------------------

def _fedmut_round_two(digits, clients: int, **args) -> tuple[Simulation, dict[str, dict], dict[str, torch.Tensor]]:
    """Round 1 trained (no mutation yet: no global update), round 2 started: each device's round-start weights."""
    from fedsga_edge.tensors import from_numpy

    sim = Simulation(tiny_config("fedmut", rounds=2, clients=clients, max_batches=1, strategy_args=args), digits)
    next(sim.rounds())
    before = {n: v.clone() for n, v in sim.coordinator.model.state_dict().items()}
    starts = bodies(sim.coordinator.begin_round(2))
    copies = {cid: {n: from_numpy(a, "cpu") for n, a in b["weights"].items()} for cid, b in starts.items()}
    return sim, copies, before


def _mean(copies: dict[str, dict], name: str) -> torch.Tensor:
    return torch.stack([c[name].double() for c in copies.values()]).mean(0)


def test_fedmut_copies_average_to_the_global_model_and_differ_from_it(digits) -> None:
    sim, copies, glob = _fedmut_round_two(digits, 4, acc_rate=0.0)
    params = dict(sim.coordinator.model.named_parameters())
    delta = sim.coordinator.strategy._delta
    assert sorted(copies) == [f"client-00{i}" for i in range(4)]
    for n, g in glob.items():
        if n not in params:  # BatchNorm statistics and counters travel unmutated
            assert all(torch.equal(c[n], g) for c in copies.values()), n
            continue
        # the pairs cancel: exactly in the factors (+1, -1), to float32 rounding in the weights
        assert torch.allclose(_mean(copies, n), g.double(), rtol=0, atol=8 * torch.finfo(torch.float32).eps
                              * (1 + float(g.abs().max()) + 4 * float(delta[n].abs().max()))), n
        for c in copies.values():  # each copy is w +/- alpha g: mutated by alpha times the last update
            assert torch.allclose((c[n] - g).abs().double(), 4.0 * delta[n].abs().double(), atol=1e-5), n
    for c in copies.values():  # and so differs from the global model
        assert max(float((c[n] - glob[n]).abs().max()) for n in params) > 1e-3
    factors = sim.coordinator.strategy._factors
    assert all(sum(f[n] for f in factors.values()) == 0.0 for n in params)
    assert {f[n] for f in factors.values() for n in params} == {1.0, -1.0}
    # a device's fetch is answered with its own copy, not the global model (FedAvg fetches the head)
    head = [n for n in glob if sim.coordinator.model.unit_of(n) == sim.coordinator.model.num_blocks]
    cid = "client-002"
    fetch = SimpleNamespace(sender=cid, body={"blocks": [], "head": True})
    kind, reply = sim.coordinator._on_fetch(fetch)
    assert kind == "weights" and sorted(reply["weights"]) == sorted(head)
    assert all(torch.equal(torch.from_numpy(reply["weights"][n]), copies[cid][n]) for n in head)
    assert any(not torch.equal(copies[cid][n], glob[n]) for n in head)


def test_fedmut_acceleration_leans_the_pairs_along_the_last_update(digits) -> None:
    """The reference code's default: one of each pair gets -(1 - 0.3), so the copies' mean is
    w + alpha * 0.3 / 2 * g in the first mutated round; with alpha = 0 nothing is mutated."""
    sim, copies, glob = _fedmut_round_two(digits, 2)
    delta = sim.coordinator.strategy._delta
    for n, _ in sim.coordinator.model.named_parameters():
        want = glob[n].double() + 4.0 * 0.3 / 2 * delta[n].double()
        assert torch.allclose(_mean(copies, n), want, atol=1e-5), n
    _, copies, glob = _fedmut_round_two(digits, 2, alpha=0.0)
    assert all(torch.equal(c[n], glob[n]) for c in copies.values() for n in glob)


def test_fedmut_odd_fleet_one_device_gets_the_global_model(digits) -> None:
    sim, copies, glob = _fedmut_round_two(digits, 3, acc_rate=0.0)
    plain = [cid for cid, c in copies.items() if all(torch.equal(c[n], glob[n]) for n in glob)]
    assert len(plain) == 1
    paired = [c for cid, c in copies.items() if cid not in plain]
    for n, _ in sim.coordinator.model.named_parameters():
        assert torch.allclose(_mean({"a": paired[0], "b": paired[1]}, n), glob[n].double(), atol=1e-6), n



def test_fedmut_mutation_state_survives_a_checkpoint(digits, tmp_path) -> None:
    """A resumed coordinator sends the same mutated copies: w_prev, the acceleration's clock and the
    factors' generator are in the checkpoint (torch.save / weights_only load, as the service does)."""
    cfg = tiny_config("fedmut", rounds=3, clients=2, max_batches=1)
    sim = Simulation(cfg, digits)
    gen = sim.rounds()
    next(gen), next(gen)
    torch.save(sim.coordinator.checkpoint_state(), tmp_path / "ck.pt")
    other = Simulation(cfg, digits)
    other.coordinator.restore(torch.load(tmp_path / "ck.pt", weights_only=True))
    a, b = bodies(sim.coordinator.begin_round(3)), bodies(other.coordinator.begin_round(3))
    assert sim.coordinator.strategy.mutations == other.coordinator.strategy.mutations == 2
    for cid in a:
        assert a[cid]["weights"].keys() == b[cid]["weights"].keys()
        assert all((a[cid]["weights"][n] == b[cid]["weights"][n]).all() for n in a[cid]["weights"])
    glob = sim.coordinator.model.state_dict()
    assert any(not torch.equal(torch.from_numpy(a[cid]["weights"][n]), glob[n]) for cid in a for n in glob)

# -- FedBABU: the head never moves, the body trains ------------------------------------------------------

def _head_and_body(model) -> tuple[dict, dict]:
    state = {n: v.clone() for n, v in model.state_dict().items()}
    head = {n: v for n, v in state.items() if model.unit_of(n) == model.num_blocks}
    return head, {n: v for n, v in state.items() if n not in head}


def test_fedbabu_head_bytes_unchanged_after_federated_rounds_body_trained(digits) -> None:
    sim = Simulation(tiny_config("fedbabu", rounds=2, clients=2, max_batches=2), digits)
    head0, body0 = _head_and_body(sim.coordinator.model)
    assert head0 and body0
    records = list(sim.rounds())
    assert len(records) == 2 and all(r["failures"] == {} for r in records)
    head, body = _head_and_body(sim.coordinator.model)
    assert all(torch.equal(head[n], head0[n]) for n in head0)  # byte for byte
    assert any(not torch.equal(body[n], body0[n]) for n in body0 if body0[n].is_floating_point())
    for client in sim.clients:  # and every device kept it too (not only the aggregate)
        dev_head, _ = _head_and_body(client.model)
        assert all(torch.equal(dev_head[n], head0[n]) for n in head0)


def test_torch_device_freezes_the_head_when_told_and_only_then(digits) -> None:
    """The torch backend's whole-model step: with freeze_head the head's bytes stay, the body moves."""
    import numpy as np

    from fedsga_edge.config import TrainConfig

    sim = Simulation(tiny_config("fedavg", rounds=1, clients=2), digits)
    client = sim.clients[0]
    be = client.backend
    idx = client.data.indices[:16]
    for freeze in (True, False):
        head0, body0 = _head_and_body(be.model)
        be.train_begin(TrainConfig(freeze_head=freeze), be.num_blocks, True, None)
        x = be.inputs(client.data.images.get_batch(idx), False)
        y = np.asarray(client.data.images.labels[idx], dtype=np.int64)
        for _ in range(2):
            be.full_step(x, y)
        be.train_end()
        head, body = _head_and_body(be.model)
        assert all(torch.equal(head[n], head0[n]) for n in head0) == freeze
        assert any(not torch.equal(body[n], body0[n]) for n in body0 if body0[n].is_floating_point())


def test_freeze_head_travels_only_when_set() -> None:
    """Other methods' round starts keep their bytes (and a device predating the field takes them)."""
    from fedsga_edge.config import TrainConfig

    assert "freeze_head" not in TrainConfig().to_wire()
    assert TrainConfig(freeze_head=True).to_wire()["freeze_head"] is True


# -- FedBABU's fine-tuned evaluation: a copy of the head fine-tuned on each device's own data ------------------

def _babu(digits, epochs: int) -> Simulation:
    """Label skew (Dirichlet 0.1): a device's local class prior is what a fine-tuned head can learn and the
    random fixed head cannot."""
    return Simulation(tiny_config("fedbabu", rounds=2, clients=4, width=0.125, max_batches=2, eval_holdout=0.2,
                                  partition="dirichlet", alpha=0.1, strategy_args={"finetune_epochs": epochs}), digits)


def _state(client) -> dict:
    return {n: v.clone() for n, v in client.model.state_dict().items()}


def test_fedbabu_finetuned_figure_per_round_above_the_fixed_head_and_0_epochs_is_the_global_one(digits) -> None:
    import numpy as np

    from fedsga_edge.device.evaluate import finetuned_evaluation

    tuned, plain = _babu(digits, 5), _babu(digits, 0)
    for t in (1, 2):
        r, r0 = tuned.run_round(t), plain.run_round(t)
        assert r["failures"] == {} and r0["failures"] == {}
        # the fine-tuning is evaluation only: the global model and its figures are those of the 0-epoch run
        for key in ("fed_acc", "fed_loss", "fed_count", "test_acc", "train_loss"):
            assert r[key] == r0[key], key
        # 0 epochs: the fine-tuned figure is the global one, per device and in the mean
        assert r0["fed_acc_finetuned"] == r0["fed_acc"] and r0["fed_loss_finetuned"] == r0["fed_loss"]
        assert all(d["acc_finetuned"] == d["acc"] and d["loss_finetuned"] == d["loss"]
                   for d in r0["fed_by_device"].values())
        devices = r["fed_by_device"]
        assert set(devices) == set(r["splits"]) and all("acc_finetuned" in d for d in devices.values())
        n = sum(d["count"] for d in devices.values())
        for key in ("acc", "loss"):  # the data-weighted mean of the devices' figures
            mean = sum(d[f"{key}_finetuned"] * d["count"] for d in devices.values()) / n
            assert r[f"fed_{key}_finetuned"] == pytest.approx(mean)
    # with a random fixed head, fine-tuning the head on local (skewed) data helps a lot (measured: 0.45 vs 0.12)
    assert r["fed_acc_finetuned"] > r["fed_acc"] + 0.15, (r["fed_acc_finetuned"], r["fed_acc"])

    # the fine-tuning trains a copy: the device's model (BatchNorm statistics too), its training mode and its
    # random streams are as they were; the same round gives the same figure (its own seeded batch order)
    client = tuned.clients[0]
    plan = SimpleNamespace(full=True, train=tuned.cfg.train)
    before, rng0, gen0 = _state(client), client.rng.bit_generator.state, client.backend.gen.get_state().clone()
    client.model.train()
    got = finetuned_evaluation(client, plan, 5, 3)
    after = _state(client)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert client.model.training and client.backend._opt is None
    assert client.rng.bit_generator.state == rng0 and torch.equal(client.backend.gen.get_state(), gen0)
    assert got == finetuned_evaluation(client, plan, 5, 3)
    glob = finetuned_evaluation(client, plan, 0, 3)
    assert set(got) == {"eval_loss_finetuned", "eval_acc_finetuned"} and got != glob
    assert np.isfinite(got["eval_loss_finetuned"])


def test_fedbabu_finetune_settings_and_figures_that_break_the_rules_are_refused(digits) -> None:
    import numpy as np

    from fedsga_edge.config import TrainConfig
    from fedsga_edge.device.role import SplitClient, check_round_start
    from fedsga_edge.simulation import validate_config
    from fedsga_edge.wire import Message, RemoteProtocolError

    for bad in (-1, 1001, 1.5, "5"):  # the option: refused before anything runs, naming its flag
        with pytest.raises(ValueError, match="--fedbabu-finetune-epochs"):
            validate_config(tiny_config("fedbabu", strategy_args={"finetune_epochs": bad}))
    with pytest.raises(ValueError, match="--fedbabu-finetune-epochs"):
        Simulation(tiny_config("fedbabu", strategy_args={"finetune_epochs": -1}), digits)

    # the round start: only FedBABU's carries the setting (FedAvg's keeps its bytes); a device checks it
    sim = Simulation(tiny_config("fedbabu", rounds=1, clients=1, eval_holdout=0.2), digits)
    body = bodies(sim.coordinator.begin_round(1))["client-000"]
    assert body["method"] == {"name": "fedbabu", "finetune_epochs": 5} and body["full"] and body["evaluate"]
    avg = Simulation(tiny_config("fedavg", rounds=1, clients=1, eval_holdout=0.2), digits)
    assert "method" not in bodies(avg.coordinator.begin_round(1))["client-000"]
    base = {"train": TrainConfig(freeze_head=True).to_wire(), "weights": {}, "full": True, "split": None}
    check_round_start(dict(base, method={"name": "fedbabu", "finetune_epochs": 0}))
    for spec in ({"name": "fedbabu"}, {"name": "fedbabu", "finetune_epochs": -1},
                 {"name": "fedbabu", "finetune_epochs": 2.0}, {"name": "fedbabu", "finetune_epochs": True}):
        with pytest.raises(RemoteProtocolError, match="malformed round_start"):
            check_round_start(dict(base, method=spec))

    # the torch-free device still gives FedBABU's round up, naming why
    sent: list = []
    peer = SimpleNamespace(send=lambda dst, kind, t, b: sent.append((kind, b)), call=None)
    onnx = SimpleNamespace(name="onnx", num_splits=3, num_blocks=4)
    client = SplitClient("client-000", sim.clients[0].data, onnx, peer, rng=np.random.default_rng(0))
    client.handle(Message("round_start", "run", 1, 0, "coordinator", body))
    assert client.step() is False and sent and "--backend torch" in sent[0][1]["reason"]

    # the coordinator: FedBABU's evaluating update must carry both fine-tuned figures, in range; FedAvg's none
    fed = sim.coordinator.fed_eval
    n = fed.expected["client-000"]
    good = {"eval_count": n, "eval_loss": 2.0, "eval_acc": 0.5, "eval_loss_finetuned": 1.0, "eval_acc_finetuned": 0.7}
    fed.check_update("client-000", good)
    for bad_update in ({k: v for k, v in good.items() if k != "eval_acc_finetuned"},
                       dict(good, eval_acc_finetuned=1.5), dict(good, eval_loss_finetuned=float("nan")),
                       {"eval_acc_finetuned": 0.7, "eval_loss_finetuned": 1.0}):
        with pytest.raises(RemoteProtocolError, match="finetuned"):
            fed.check_update("client-000", bad_update)
    avg_eval = avg.coordinator.fed_eval
    with pytest.raises(RemoteProtocolError, match="fine-tunes nothing"):
        avg_eval.check_update("client-000", dict(good, eval_count=avg_eval.expected["client-000"]))
    sim.coordinator.strategy.check_update({"method": {}})
    with pytest.raises(RemoteProtocolError, match="must be empty"):
        sim.coordinator.strategy.check_update({"method": {"x": 1}})
