"""The split baselines with their own server side: MultiSFL's branches, master and knowledge replay
(and, with it, the split device step on the torch-free ONNX device). Each test fails when the method's
core rule is broken (docs/method.md, "Baselines beyond the paper's own")."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _runs import tiny_config

from fedsga_edge.simulation import Simulation
from fedsga_edge.tensors import from_numpy

# -- MultiSFL: branch models, a master that is their aggregate, knowledge replay -------------------------


def _capture_updates(sim: Simulation) -> dict[str, dict]:
    """The accepted updates of the next round(s), as the strategy's end_round receives them."""
    seen: dict[str, dict] = {}
    end = sim.strategy.end_round

    def spy(updates, record):
        seen.clear()
        seen.update(copy.deepcopy(updates))
        return end(updates, record)

    sim.strategy.end_round = spy
    return seen


def _weighted(states: list[dict[str, torch.Tensor]], weights: list[float], name: str) -> torch.Tensor:
    return sum(w * s[name].double() for s, w in zip(states, weights)) / sum(weights)


def test_multisfl_master_is_the_data_weighted_aggregate_of_its_branches(digits) -> None:
    """Three devices on two branches (2 + 1): each branch = its devices' prefixes averaged by data + its own
    trained server copy; the master (the global model) = the branches averaged by their data; each branch
    then starts the next round at (1 - mix) W_b + mix * master, and its devices receive that prefix."""
    sim = Simulation(tiny_config("multisfl", rounds=2, clients=3, max_batches=2, clip_updates=0.0,
                                 strategy_args={"branches": 2, "mix": 0.25, "replay": 0.5}), digits)
    co, st = sim.coordinator, sim.strategy
    updates = _capture_updates(sim)
    start = {n: v.clone() for n, v in co.model.state_dict().items()}
    rec = next(sim.rounds())
    assert rec["failures"] == {} and len(updates) == 3
    dealt = dict(st.dealt)
    assert sorted(dealt.values()) == [0, 1, 1] and rec["branches"] == {"0": ["client-001"], "1": ["client-000", "client-002"]}
    unit, depth = co.model.unit_of, co.model.depth_of(sim.cfg.split)
    n = {c: co.clients[c] for c in updates}
    branch, mass = {}, {}
    for b in (0, 1):
        devs = sorted(c for c in updates if dealt[c] == b)
        ups = [{k: from_numpy(a, "cpu") for k, a in updates[c]["weights"].items()} for c in devs]
        server = co.server.trained[b]
        branch[b] = {name: (_weighted(ups, [n[c] for c in devs], name) if unit(name) < depth else server[name].double())
                     for name in start}
        mass[b] = sum(n[c] for c in devs)
    master = co.model.state_dict()
    for name, v in master.items():
        want = (mass[0] * branch[0][name] + mass[1] * branch[1][name]) / (mass[0] + mass[1])
        if v.is_floating_point():
            torch.testing.assert_close(v.double(), want, rtol=1e-5, atol=1e-6, msg=name)
        else:
            assert torch.equal(v, want.round().to(v.dtype)), name
    floats = [name for name, v in master.items() if v.is_floating_point()]
    assert any(not torch.allclose(branch[0][k], branch[1][k]) for k in floats)  # the branches differ
    for b in (0, 1):  # the mix, then round 2's devices receive their branch's prefix
        for name in floats:
            torch.testing.assert_close(st.branches[b][name].double(),
                                       0.75 * branch[b][name] + 0.25 * master[name].double(), rtol=1e-5, atol=1e-6)
    for cid, start in co.begin_round(2):
        body = start.body
        b = st.dealt[cid]
        assert b != dealt[cid]  # the deal rotates
        for name, a in body["weights"].items():
            assert torch.equal(from_numpy(a, "cpu"), st.branches[b][name]), (cid, name)


def _batch(model, k: int, labels: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(len(labels), *model.interface_shape(model.depth_of(k), 0), generator=gen), torch.tensor(labels)


def _sgd(model, cfg, k: int, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Plain SGD steps of a fresh optimizer over suffix + head, one per batch."""
    model = copy.deepcopy(model)
    tc = cfg.train
    opt = torch.optim.SGD(model.parameters(), lr=tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
    model.train()
    for z, y in batches:
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model.head(model.suffix(z.clone(), model.depth_of(k))), y).backward()
        opt.step()
    return model.state_dict()


def test_multisfl_replay_joins_the_rows_of_the_classes_a_branch_lacks(digits) -> None:
    """Each of a branch's own steps takes the replay rows into the same batch and loss (the reference's
    union step): branch 1 saw classes 0 and 1, so its 2 rows are class 2's, from client-002's batch (a
    device of the other branch; client-000's class-0 rows fill nothing). Its copy is exactly one SGD step
    on its batch plus those rows, and the device's gradient is its own rows' slice of that loss. Branch 0's
    steps have no helper (nobody else yet, then only its own branch). With replay 0 nothing is joined."""
    for rows in (16, 0):
        sim = Simulation(tiny_config("multisfl", rounds=1, clients=3), digits)
        co, st, k = sim.coordinator, sim.strategy, sim.cfg.split
        co.begin_round(1)
        st.dealt = {"client-000": 0, "client-001": 1, "client-002": 0}
        server = co.server
        server.rows = lambda device: rows
        a = _batch(co.model, k, [0, 0, 0, 0], 1)  # branch 0: class 0
        c = _batch(co.model, k, [1, 1, 2, 2], 2)  # branch 0 too: classes 1, 2
        b = _batch(co.model, k, [0, 0, 1, 1], 3)  # branch 1: classes 0, 1
        server.step("client-000", a[0].clone(), a[1], k, st)
        assert server.replayed == []  # nobody of another branch has sent yet
        server.step("client-002", c[0].clone(), c[1], k, st)
        assert server.replayed == []  # client-000 is of the same branch: no helper
        zb = b[0].clone()
        server.step("client-001", zb, b[1], k, st)
        got = server.copy_for("client-001").model.state_dict()
        names = [n for n, v in got.items() if v.is_floating_point() and co.model.unit_of(n) >= co.model.depth_of(k)]
        joined = (torch.cat([b[0], c[0][2:]]), torch.cat([b[1], c[1][2:]])) if rows else b
        want = _sgd(co.model, sim.cfg, k, [joined])
        assert all(torch.allclose(got[n], want[n], atol=1e-6) for n in names)
        z, fresh = joined[0].clone().requires_grad_(True), copy.deepcopy(co.model).train()
        F.cross_entropy(fresh.head(fresh.suffix(z, co.model.depth_of(k))), joined[1]).backward()
        torch.testing.assert_close(zb.grad, z.grad[:4], rtol=1e-5, atol=1e-7)
        if rows == 0:
            assert server.replayed == []
            continue
        assert server.replayed == [(1, "client-002", 2)]
        wrong = _sgd(co.model, sim.cfg, k, [(torch.cat([b[0], a[0][:2]]), torch.cat([b[1], a[1][:2]]))])
        assert not all(torch.allclose(got[n], wrong[n], atol=1e-6) for n in names)


def test_multisfl_replays_about_one_percent_of_a_device_data_by_default(digits) -> None:
    """The reference's budget: max(classes, floor(1 % of n)) rows per local epoch, spread over the epoch's
    steps; one branch per device and mix 1/(B + 1) unless set."""
    sim = Simulation(tiny_config("multisfl", rounds=1, clients=3, max_batches=0, batch_size=64), digits)
    st, co = sim.strategy, sim.coordinator
    n = co.clients["client-000"]
    assert st.replay_rows("client-000") == -(-max(10, n // 100) // -(-n // 64))
    rec = next(sim.rounds())
    assert st.B == 3 and st.mix == pytest.approx(0.25) and len(rec["branches"]) == 3
    assert 0 < rec["replay_rows"] <= 3 * st.replay_rows("client-000") * -(-n // 64)


def test_multisfl_with_a_branch_per_device_and_no_replay_trains_round_1_as_splitfed(digits) -> None:
    """One branch per device, no replay: every device trains its own server copy from the initial model,
    which is SplitFed with per-client server copies (SplitFed-v1), so the round-1 losses are the same. Two
    branches for three devices (a branch's copy taking two devices in turn) are not."""
    def losses(strategy: str, **kw) -> dict[str, float]:
        sim = Simulation(tiny_config(strategy, rounds=1, clients=3, max_batches=2, server_copies="per_client", **kw),
                         digits)
        updates = _capture_updates(sim)
        next(sim.rounds())
        return {c: float(u["train_loss"]) for c, u in updates.items()}

    splitfed = losses("static")
    assert losses("multisfl", strategy_args={"replay": 0.0}) == pytest.approx(splitfed, rel=1e-6)
    assert losses("multisfl", strategy_args={"branches": 2, "replay": 0.0}) != pytest.approx(splitfed, rel=1e-6)


def test_multisfl_with_every_branch_restarting_from_the_master_trains_every_round_as_splitfed(digits) -> None:
    """mix 1, a branch per device, no replay: each branch restarts from the master, so every round (round 2's
    start included: the master, what the devices receive, each branch copy's start, its BatchNorm statistics)
    is SplitFed-v1's, and round 2's losses and the global model are SplitFed's. The default's failure to
    learn at small budgets is its weak mix (docs/method.md), not this machinery."""
    def run(strategy: str, **kw) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
        sim = Simulation(tiny_config(strategy, rounds=2, clients=3, max_batches=2, server_copies="per_client",
                                     clip_updates=0.0, partition="dirichlet", alpha=0.1, **kw), digits)
        updates = _capture_updates(sim)
        for _ in sim.rounds():
            pass
        return {c: float(u["train_loss"]) for c, u in updates.items()}, sim.coordinator.model.state_dict()

    losses, model = run("static")
    mixed, branched = run("multisfl", strategy_args={"mix": 1.0, "replay": 0.0})
    assert mixed == pytest.approx(losses, rel=1e-6)
    for name, v in model.items():
        torch.testing.assert_close(branched[name].double(), v.double(), rtol=1e-5, atol=1e-6, msg=name)
    weak, _ = run("multisfl", strategy_args={"replay": 0.0})  # mix 1/(B + 1): round 2 starts from the branches
    assert weak != pytest.approx(losses, rel=1e-6)


def test_multisfl_branches_survive_a_checkpoint(digits) -> None:
    sim = Simulation(tiny_config("multisfl", rounds=2, clients=2, max_batches=1), digits)
    next(sim.rounds())
    state = sim.coordinator.checkpoint_state()
    other = Simulation(tiny_config("multisfl", rounds=2, clients=2, max_batches=1), digits)
    other.coordinator.restore(copy.deepcopy(state))
    for mine, theirs in zip(sim.strategy.branches, other.strategy.branches):
        assert all(torch.equal(mine[n], theirs[n]) for n in mine)


def test_multisfl_options_are_refused_out_of_range() -> None:
    from fedsga_edge.coordinator.strategy import create_strategy

    with pytest.raises(ValueError, match="branches"):
        create_strategy(tiny_config("multisfl", strategy_args={"branches": -1}), 4, ["a"], {})
    with pytest.raises(ValueError, match="mix"):
        create_strategy(tiny_config("multisfl", strategy_args={"mix": 1.5}), 4, ["a"], {})


def test_multisfl_earlier_setting_is_a_labelled_variant_of_the_benchmark() -> None:
    """``multisfl-2branch`` runs the earlier 2-branch setting under its own name and label; ``multisfl`` the
    reference code's configuration."""
    from _bench import load_bench

    from fedsga_edge.coordinator.strategy import method_of

    bench = load_bench("accuracy")
    two = bench.make_config(bench.PRESETS["cpu"], "multisfl-2branch", "dir0.1", 0, 2, "digits", None)
    ref = bench.make_config(bench.PRESETS["cpu"], "multisfl", "dir0.1", 0, 2, "digits", None)
    assert two.strategy == ref.strategy == "multisfl"
    assert {k: two.strategy_args[k] for k in ("branches", "mix", "replay")} == {"branches": 2, "mix": 0.5, "replay": 0.5}
    assert method_of(two, 4)["name"] == "multisfl-2branch" and "2 branches" in method_of(two, 4)["label"]
    assert method_of(ref, 4)["name"] == "multisfl" and bench.LABELS["multisfl-2branch"] != bench.LABELS["multisfl"]


# -- the split device step on the torch-free ONNX device ---------------------------------------------------

def test_multisfl_round_on_onnx_devices_matches_torch_devices(digits) -> None:
    """The device side is a prefix forward/backward of the branch's prefix: the ONNX device trains it as
    the torch device does (one local step: float32 rounding differs between the two backends)."""
    from _export_artifacts import device_artifacts

    def run(**kw) -> tuple[Simulation, dict]:
        sim = Simulation(tiny_config("multisfl", clients=2, rounds=2, max_batches=1), digits, **kw)
        recs = list(sim.rounds())
        return sim, recs

    ref, rec_t = run()
    sim, rec_o = run(backend="onnx", artifacts=device_artifacts())
    assert all(c.backend.name == "onnx" for c in sim.clients)
    for rt, ro in zip(rec_t, rec_o):
        assert not ro["failures"] and ro["branches"] == rt["branches"] and ro["splits"] == rt["splits"]
        assert ro["train_loss"] == pytest.approx(rt["train_loss"], rel=1e-3)
    va = torch.cat([v.flatten().double() for v in ref.model.state_dict().values() if v.is_floating_point()])
    vb = torch.cat([v.flatten().double() for v in sim.model.state_dict().values() if v.is_floating_point()])
    # round 2 trains the branches' own prefixes (not the master's); two rounds let the rounding grow, as in
    # tests/test_onnx_device.py's two-round comparison
    assert float((va - vb).norm() / va.norm()) < 1e-2


# -- MergeSFL's merged step, on the I/O-free coordinator ---------------------------------------------------

def _merging(digits, clients: int = 3, **kw):
    """A coordinator whose server side merges (MergeSFL's), round 1 begun at time 0."""
    from fedsga_edge.coordinator.strategies.mergesfl import MergeSFL

    sim = Simulation(tiny_config("static", clients=clients, rounds=1, clip_activations=0.0, **kw), digits)
    co = sim.coordinator
    co.server = MergeSFL(sim.cfg, co.model.num_splits, list(co.clients), {}).server_side(co.model, co.head, sim.cfg,
                                                                                         lambda d: 1.0)
    co.begin_round(1, now=0.0)
    return sim, co


def _activation_msg(device: str, seq: int, z: torch.Tensor, y: torch.Tensor, k: int):
    from fedsga_edge.wire import Message

    return Message("activation", "run", 1, seq, device, {"z": z.numpy(), "y": y.numpy(), "split": k})


def _count_steps(opt) -> dict[str, int]:
    count = {"steps": 0}
    step = opt.step

    def counted(*a, **kw):
        count["steps"] += 1
        return step(*a, **kw)

    opt.step = counted
    return count


def test_mergesfl_one_server_step_per_merged_batch_and_each_device_gets_its_slice(digits) -> None:
    """Three devices' activations (8, 5 and 3 samples) are held until the last arrives, then ONE server step
    on their concatenation: the server's weights equal a hand-made concatenated forward/backward/SGD step,
    and each device's gradient is its slice of the merged batch's input gradient times (16 / its size)."""
    sim, co = _merging(digits)
    k = sim.cfg.split
    model = copy.deepcopy(co.model)
    count = _count_steps(co.server.shared.opt)
    sizes = {"client-000": 8, "client-001": 5, "client-002": 3}
    batches = {d: _batch(model, k, [i % 10 for i in range(n)], seed) for seed, (d, n) in enumerate(sizes.items())}
    out = [co.receive(_activation_msg(d, seq, z, y, k), now=1.0)
           for seq, (d, (z, y)) in enumerate(batches.items(), start=1)]
    assert out[0] == [] and out[1] == []  # held: nothing to send yet
    # the last activation completes the step: every device's reply comes out of that one call
    assert [(d, m.kind) for d, m in out[2]] == [(d, "gradient") for d in sizes] and count["steps"] == 1
    replies = dict(out[2])
    # by hand: one forward/backward of the concatenation, one SGD step
    z = torch.cat([z for z, _ in batches.values()]).requires_grad_(True)
    y = torch.cat([y for _, y in batches.values()])
    tc = sim.cfg.train
    opt = torch.optim.SGD(model.parameters(), lr=tc.lr, momentum=tc.momentum, weight_decay=tc.weight_decay)
    model.train()
    loss = F.cross_entropy(model.head(model.suffix(z, model.depth_of(k))), y)
    loss.backward()
    opt.step()
    got, want = co.model.state_dict(), model.state_dict()
    names = [n for n, v in want.items() if v.is_floating_point() and co.model.unit_of(n) >= co.model.depth_of(k)]
    assert all(torch.allclose(got[n], want[n], atol=1e-6) for n in names)
    start = 0
    for d, n in sizes.items():
        dz = torch.from_numpy(replies[d].body["dz"])
        torch.testing.assert_close(dz, z.grad[start:start + n] * (16 / n), rtol=1e-5, atol=1e-7)
        assert replies[d].body["loss"] == pytest.approx(float(loss.detach()))
        assert replies[d].seq == list(sizes).index(d) + 1  # each reply answers its own request
        start += n


def test_mergesfl_releases_the_step_with_whoever_still_trains(digits) -> None:
    """A garbage activation is refused at once and holds nothing; a device that gives up, fails or is
    past the round's deadline no longer holds the step: the others get their gradients (or, once the
    round has closed, a refusal), so nothing waits forever."""
    sim, co = _merging(digits, round_timeout=10.0)
    k = sim.cfg.split
    count = _count_steps(co.server.shared.opt)
    a, c = (_batch(co.model, k, [0, 1, 2, 3], s) for s in range(2))
    from fedsga_edge.wire import Message

    def kinds(out):
        return [(d, m.kind) for d, m in out]

    assert co.receive(_activation_msg("client-000", 1, *a, k), now=1.0) == []
    bad = co.receive(_activation_msg("client-001", 1, a[0][:, :1], a[1], k), now=1.0)
    assert kinds(bad) == [("client-001", "error")]  # refused, nothing released
    assert co.receive(Message("error", "run", 1, 2, "client-001", {"reason": "gave up"}), now=1.0) == []
    assert count["steps"] == 0  # client-002 still trains
    out = co.receive(_activation_msg("client-002", 1, *c, k), now=1.0)
    assert kinds(out) == [("client-000", "gradient"), ("client-002", "gradient")] and count["steps"] == 1
    # client-002 fails: client-000's next activation is stepped alone
    assert co.receive(_activation_msg("client-002", 2, *c, k), now=1.0) == []  # held: client-000 trains on
    assert kinds(co.fail("client-000", "transport broke")) == [("client-002", "gradient")] and count["steps"] == 2
    # the deadline: a held request is refused, not left waiting
    _, co2 = _merging(digits, clients=2, round_timeout=10.0)
    assert co2.receive(_activation_msg("client-000", 1, *a, k), now=1.0) == []
    out = co2.tick(11.0)
    assert co2.round_complete and kinds(out) == [("client-000", "error")]


# -- MergeSFL in simulate: held activations answered later over the loopback -----------------------------

CLIENTS3 = ["client-000", "client-001", "client-002"]


def _count_merged(sim: Simulation) -> tuple[dict[str, int], list[list[str]]]:
    """Count the server's optimizer steps, and the devices whose activations each merged step concatenated."""
    side = sim.coordinator.server
    count = _count_steps(side.shared.opt)
    merged: list[list[str]] = []
    step_merged = side.step_merged

    def spy(batches, k, strategy):
        merged.append(sorted(d for d, _, _ in batches))
        return step_merged(batches, k, strategy)

    side.step_merged = spy
    return count, merged


@pytest.mark.parametrize("schedule", ["round_robin", "random", "sequential"])
def test_mergesfl_simulate_steps_the_server_once_per_merged_batch(digits, schedule) -> None:
    """Three devices, two batches each: the server steps twice, once per merged batch of all three devices'
    activations (six device batches), whatever the schedule; each device got each gradient (the held ones
    through the loopback's pending reply, counted as any reply) and sent its update."""
    sim = Simulation(tiny_config("mergesfl", clients=3, rounds=1, max_batches=2, schedule=schedule), digits)
    count, merged = _count_merged(sim)
    updates = _capture_updates(sim)
    rec = sim.run_round(1)
    assert rec["failures"] == {} and sorted(rec["splits"]) == CLIENTS3
    assert sum(u["steps"] for u in updates.values()) == 6 and all(u["steps"] == 2 for u in updates.values())
    assert count["steps"] == 2 and merged == [CLIENTS3, CLIENTS3]
    stats = sim.transport.stats
    for c in CLIENTS3:  # round_start, two gradients, the update's ack
        assert stats.messages_sent(src="coordinator", dst=c) == 4
    assert rec["bytes_down"] == stats.bytes_sent(src="coordinator")
    assert all(not c.busy for c in sim.clients)


def test_mergesfl_simulate_command_end_to_end(tmp_path) -> None:
    """``fedsga-edge simulate --strategy mergesfl`` on the digits: two rounds, every device in each, the
    test accuracy counted over the whole test set."""
    import json

    from typer.testing import CliRunner

    from _runs import assert_test_accuracy
    from fedsga_edge.cli.main import app

    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["simulate", "--strategy", "mergesfl", "--dataset", "digits", "--model",
                                   "resnet18_cifar", "--width", "0.25", "--clients", "2", "--rounds", "2",
                                   "--local-epochs", "1", "--max-batches", "2", "--batch-size", "32", "--seed", "0",
                                   "--out", str(out), "--quiet", "--threads", "1"], env={"COLUMNS": "300"})
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    for r in rows:
        assert r["failures"] == {} and sorted(r["splits"]) == ["client-000", "client-001"]
        assert len(set(r["splits"].values())) == 1  # every device at --split
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"] == 2 and summary["failures"] == 0 and summary["final_acc"] == rows[-1]["test_acc"]
    from fedsga_edge.data import load_dataset

    assert_test_accuracy(rows[-1], len(load_dataset("digits").test))
    assert json.loads((out / "config.json").read_text())["method"]["name"] == "mergesfl"


def test_mergesfl_held_request_replayed_is_not_stepped_twice_and_a_closed_round_refuses_it(digits) -> None:
    """Over the simulation's loopback and the coordinator's Peer: a held activation returns a pending reply;
    its repeat meanwhile is not handled; once the step is released (by the other device's activation) the
    pending reply holds the gradient and a replay is refused, the server having stepped once. A held
    request whose round closes at its deadline gets its refusal: nothing waits forever."""
    from fedsga_edge.transport import PendingReply, TransportError
    from fedsga_edge.wire import Message, decode, encode

    sim = Simulation(tiny_config("mergesfl", clients=2, rounds=1, round_timeout=10.0), digits)
    co, t = sim.coordinator, sim.transport
    count = _count_steps(co.server.shared.opt)
    co.begin_round(1, now=0.0)
    k = sim.cfg.split
    a, b = (_batch(co.model, k, [0, 1, 2, 3], s) for s in range(2))
    run = sim.peer.run

    def act(device, seq, zy):
        z, y = zy
        return encode(Message("activation", run, 1, seq, device, {"z": z.numpy(), "y": y.numpy(), "split": k}))

    first = act("client-000", 1, a)
    pending = t.request("client-000", "coordinator", first)
    assert isinstance(pending, PendingReply) and not pending.ready
    with pytest.raises(TransportError, match="no reply"):  # its repeat while held: not handled again
        t.request("client-000", "coordinator", first)
    reply = decode(t.request("client-001", "coordinator", act("client-001", 1, b)))
    assert reply.kind == "gradient" and count["steps"] == 1
    assert pending.ready and decode(pending.wait()).kind == "gradient"
    again = decode(t.request("client-000", "coordinator", first))  # a replay after the answer: refused
    assert again.kind == "error" and "replay" in again.body["reason"] and count["steps"] == 1
    # the deadline closes the round with client-000's next activation held: it gets its refusal
    held = t.request("client-000", "coordinator", act("client-000", 2, a))
    assert isinstance(held, PendingReply) and not held.ready
    sim.driver.send(co.tick(11.0))
    assert co.round_complete and held.ready and decode(held.wait()).kind == "error" and count["steps"] == 1


def test_mergesfl_round_on_onnx_devices_matches_torch_devices(digits) -> None:
    """The merged step's device side is the same prefix forward/backward: ONNX devices train it as torch
    devices do (float32 rounding differs between the two backends)."""
    from _export_artifacts import device_artifacts

    def run(**kw) -> tuple[Simulation, dict]:
        sim = Simulation(tiny_config("mergesfl", clients=2, rounds=1, max_batches=2), digits, **kw)
        count, merged = _count_merged(sim)
        rec = sim.run_round(1)
        assert count["steps"] == 2 and merged == [["client-000", "client-001"]] * 2
        return sim, rec

    ref, rt = run()
    sim, ro = run(backend="onnx", artifacts=device_artifacts())
    assert all(c.backend.name == "onnx" for c in sim.clients)
    assert not ro["failures"] and ro["splits"] == rt["splits"]
    assert ro["train_loss"] == pytest.approx(rt["train_loss"], rel=1e-3)
    va = torch.cat([v.flatten().double() for v in ref.model.state_dict().values() if v.is_floating_point()])
    vb = torch.cat([v.flatten().double() for v in sim.model.state_dict().values() if v.is_floating_point()])
    assert float((va - vb).norm() / va.norm()) < 1e-2
