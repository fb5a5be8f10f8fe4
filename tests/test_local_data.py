"""Devices that bring their own data: `device --data`, a coordinator without training data,
federated evaluation, `fedsga-edge partition` and `trial --device-data`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from _export_artifacts import device_artifacts
from _coordinator import only_reply
from _runs import tiny_config
from fedsga_edge.device.evaluate import hold_out
from test_device_runtime import BLOCK_TORCH

from fedsga_edge.data import ArrayImageSet
from fedsga_edge.data.local import LocalDataError, RunData, read_local_data, read_run_data, scan_local_data
from fedsga_edge.runbuild import plan_run
from fedsga_edge.simulation import Simulation
from fedsga_edge.wire import Message

CLI = [sys.executable, "-m", "fedsga_edge.cli.main"]
PART = ["--dataset", "digits", "--clients", "3", "--seed", "0"]


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env=os.environ | {"COLUMNS": "200", "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def partitioned(tmp_path_factory) -> Path:
    """digits under Dirichlet(0.5) for 3 devices, as folders, with the test split and dataset.json."""
    out = tmp_path_factory.mktemp("part") / "digits"
    res = _cli("partition", *PART, "--partition", "dirichlet", "--alpha", "0.5", "--out", str(out), "--test")
    assert res.returncode == 0, res.stderr[-3000:]
    return out


# -- the partition command and the folder reader ---------------------------------------------------------

@pytest.mark.parametrize("fmt", ["folder", "npz"])
def test_partition_writes_the_simulation_shares_and_the_device_reads_them_back_in_order(partitioned, tmp_path,
                                                                                          digits, fmt) -> None:
    """Each device folder holds exactly its simulate share: the same pixels and labels, in the same order, so
    the held-out slice a device draws from its folder is the one simulate draws from the partition."""
    if fmt == "folder":
        out = partitioned
    else:
        out = tmp_path / "npz"
        res = _cli("partition", *PART, "--partition", "dirichlet", "--alpha", "0.5", "--out", str(out),
                   "--format", "npz")
        assert res.returncode == 0, res.stderr[-3000:]
    cfg = tiny_config("static", clients=3, partition="dirichlet", alpha=0.5, eval_holdout=0.2)
    plan = plan_run(cfg, digits, seed_globals=False, torch_free=True)
    run = read_run_data(out / "dataset.json")
    assert run.classes == digits.classes and run.image_size == 32 and run.mean == pytest.approx(digits.mean)
    desc = json.loads((out / "dataset.json").read_text())
    for i, cid in enumerate(plan.client_ids):
        share = np.sort(np.concatenate([plan.parts[i], plan.eval_parts[i]]))
        assert desc["devices"][cid] == len(share)
        images, counts = read_local_data(out / (cid if fmt == "folder" else f"{cid}.npz"), run)
        assert np.array_equal(images.images, digits.train.get_batch(share))  # bit for bit, in the share's order
        assert np.array_equal(images.labels, digits.train.labels[share])
        assert sum(counts.values()) == len(share)
        train, held = hold_out(np.arange(len(share)), cfg.eval_holdout, cfg.seed, cid)
        assert np.array_equal(share[train], plan.parts[i]) and np.array_equal(share[held], plan.eval_parts[i])
    if fmt == "folder":
        test, _ = read_local_data(out / "test", run)
        assert np.array_equal(test.images, digits.test.images) and np.array_equal(test.labels, digits.test.labels)


def _png(path: Path, size: int = 32, mode: str = "RGB") -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    if mode == "I;16":
        Image.fromarray(np.full((size, size), 1000, np.uint16)).save(path)
    else:
        Image.new(mode, (size, size)).save(path)


RUN = RunData(["cat", "dog"], 32, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25))


def _good(root: Path) -> Path:
    for c in ("cat", "dog"):
        for j in range(3):
            _png(root / c / f"{j}.png")
    return root


def test_bad_local_data_gets_an_error_that_names_the_file_and_what_to_do(tmp_path) -> None:
    images, counts = read_local_data(_good(tmp_path / "ok"), RUN)
    assert len(images) == 6 and counts == {"cat": 3, "dog": 3} and images.images.shape == (6, 32, 32, 3)
    _png(tmp_path / "grey" / "cat" / "0.png", 64, "L")  # greyscale, larger: converted and resized
    _png(tmp_path / "grey" / "dog" / "0.jpg", 40, "RGB")
    assert len(read_local_data(tmp_path / "grey", RUN)[0]) == 2

    cases = {
        "unknown class": (lambda r: _png(r / "bird" / "0.png"),
                          r"class folder .*bird is not a class of this run.*cat, dog.*rename it"),
        "empty folder": (lambda r: (r / "dog" / "empty").mkdir() or (r / "cat2").mkdir(), r"is empty|inside a class"),
        "corrupt image": (lambda r: (r / "cat" / "9.png").write_bytes(b"\x89PNG\r\n\x1a\n broken"),
                          r"cat/9\.png is not a readable image.*corrupt or truncated"),
        "16-bit image": (lambda r: _png(r / "dog" / "9.png", mode="I;16"), r"dog/9\.png is a I;16 image.*8-bit"),
        "too small": (lambda r: _png(r / "dog" / "9.png", 16), r"dog/9\.png is 16x16, smaller than the run's 32x32"),
        "not an image": (lambda r: (r / "cat" / "notes.txt").write_text("x"), r"notes\.txt is not an image file"),
        "loose file": (lambda r: _png(r / "0.png"), r"0\.png is a file beside the class folders"),
    }
    for name, (spoil, pattern) in cases.items():
        root = _good(tmp_path / name.replace(" ", "_"))
        spoil(root)
        with pytest.raises(LocalDataError, match=pattern):
            read_local_data(root, RUN)
    empty_class = _good(tmp_path / "empty_class")
    (empty_class / "cat2").mkdir()
    with pytest.raises(LocalDataError, match=r"class folder .*cat2 is empty: put that class's images in it"):
        scan_local_data(empty_class)
    with pytest.raises(LocalDataError, match="no such file or folder"):
        scan_local_data(tmp_path / "absent")
    np.savez(tmp_path / "d.npz", x_train=np.zeros((4, 32, 32, 3), np.uint8), y_train=np.array([0, 1, 2, 0]),
             classes=np.array(["cat", "dog", "fox"]))
    with pytest.raises(LocalDataError, match="class 'fox' is not a class of this run"):
        read_local_data(tmp_path / "d.npz", RUN)
    np.savez(tmp_path / "e.npz", x_train=np.zeros((4, 32, 32, 3), np.uint8), y_train=np.array([1, 0, 1, 0]),
             classes=np.array(["dog", "cat"]))  # names map to the run's ids, whatever the file's order
    assert list(read_local_data(tmp_path / "e.npz", RUN)[0].labels) == [0, 1, 0, 1]


def test_device_data_is_not_read_from_the_data_root_variable() -> None:
    """FEDSGA_EDGE_DATA is the data sets' root (the systemd unit sets it): --data has a variable of its own."""
    import typer.main

    from fedsga_edge.cli.main import app

    commands = typer.main.get_command(app).commands
    data = next(p for p in commands["device"].params if p.name == "data")
    assert data.envvar == "FEDSGA_EDGE_DEVICE_DATA"
    assert {"classes", "test_data"} <= {p.name for p in commands["coordinator"].params}
    assert {"device_data", "classes", "test_data"} <= {p.name for p in commands["trial"].params}


# -- federated evaluation, in one process ---------------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["static", "fedavg"])
def test_federated_figures_are_the_round_start_model_on_each_held_out_slice(digits, strategy) -> None:
    """Round 2's federated figure is the global model after round 1 on the devices' held-out slices: the
    coordinator's own evaluation of that model on the same images gives the same counts (a split device's
    activations scored on the round-start suffix; a whole-model device scoring itself)."""
    sim = Simulation(tiny_config(strategy, clients=2, eval_holdout=0.25), digits)
    co, b = sim.coordinator, sim.bundle
    r1 = sim.run_round(1)
    assert r1["fed_model_round"] == 0 and r1["fed_count"] == sum(len(c.data.eval_indices) for c in sim.clients)
    expected = {}
    for c in sim.clients:
        held = c.data.eval_indices
        assert not set(held) & set(c.data.indices)  # never trained on
        ev = co.evaluate(ArrayImageSet(b.train.get_batch(held), b.train.labels[held]), b.mean, b.std)
        expected[c.cid] = ev
    r2 = sim.run_round(2)
    assert r2["fed_model_round"] == 1
    for cid, ev in expected.items():
        got = r2["fed_by_device"][cid]
        assert got["count"] == len(sim.clients[int(cid[-1])].data.eval_indices)
        assert got["acc"] == pytest.approx(ev["test_acc"], abs=1e-9), cid
        assert got["loss"] == pytest.approx(ev["test_loss"], rel=1e-4), cid
    n = sum(d["count"] for d in r2["fed_by_device"].values())
    assert r2["fed_acc"] == pytest.approx(sum(d["acc"] * d["count"] for d in r2["fed_by_device"].values()) / n)


def _held_out_figures(sim: Simulation) -> dict[str, dict]:
    """The coordinator's own evaluation of its current model on each device's held-out slice."""
    co, b = sim.coordinator, sim.bundle
    return {c.cid: co.evaluate(ArrayImageSet(b.train.get_batch(c.data.eval_indices), b.train.labels[c.data.eval_indices]),
                               b.mean, b.std) for c in sim.clients}


@pytest.mark.parametrize("strategy", ["static", "fedavg"])
def test_the_final_model_gets_its_own_evaluation_recorded_against_its_round(digits, strategy) -> None:
    """Round t's own-data figure is of the model after round t-1 and says so; after the last round an
    evaluation-only exchange scores the model the run ended with (the one the last test figure measured) on
    every device's held-out slice: the last round's ``fed_final``, ``fed_model_round`` that round. It trains
    nothing: the model, the devices' round counts and the round's updates stay as the last round left them."""
    from fedsga_edge.owndata import final_own_data, own_data_of

    sim = Simulation(tiny_config(strategy, clients=2, eval_holdout=0.25, rounds=2), digits)
    r1 = sim.run_round(1)
    assert "fed_final" not in r1 and r1["fed_model_round"] == 0
    r2 = sim.run_round(2)
    assert r2["fed_model_round"] == 1
    state = {k: v.clone() for k, v in sim.coordinator.model.state_dict().items()}
    final = r2["fed_final"]
    assert final["fed_model_round"] == 2 and not final["failures"]
    for cid, ev in _held_out_figures(sim).items():  # the final model, scored by the coordinator on the same images
        assert final["fed_by_device"][cid]["acc"] == pytest.approx(ev["test_acc"], abs=1e-9), cid
        assert final["fed_by_device"][cid]["loss"] == pytest.approx(ev["test_loss"], rel=1e-4), cid
    assert all(v.equal(state[k]) for k, v in sim.coordinator.model.state_dict().items())
    assert [c.state.rounds for c in sim.clients] == [2, 2] and set(r2["splits"]) == {c.cid for c in sim.clients}
    records = [r1, r2]
    assert own_data_of(records, 1)["fed_acc"] == r2["fed_acc"]  # round 1's model: scored at round 2's start
    assert final_own_data(records)["fed_acc"] == final["fed_acc"]


def test_a_simulated_run_writes_the_final_evaluation_in_metrics_and_summary(digits, tmp_path) -> None:
    from fedsga_edge.simulation import run_simulation

    summary = run_simulation(tiny_config("static", clients=2, eval_holdout=0.25, rounds=1), tmp_path, bundle=digits)
    rec = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert rec["round"] == 1 and rec["fed_model_round"] == 0 and rec["fed_final"]["fed_model_round"] == 1
    assert summary["fed_model_round"] == 1 and summary["final_fed_acc"] == rec["fed_final"]["fed_acc"]
    assert json.loads((tmp_path / "summary.json").read_text())["fed_model_round"] == 1


def test_the_final_evaluation_refuses_training_and_reads_no_weights(digits) -> None:
    """A device that trains in the final evaluation is refused; an update's weights there are never read."""
    sim = Simulation(tiny_config("static", clients=1, eval_holdout=0.25, rounds=1), digits)
    co = sim.coordinator
    out = co.begin_round(2, devices=["client-000"], evaluate_only=True)
    body = only_reply(out).body
    assert body["evaluate_only"] and body["evaluate"]
    k = co.round.assigned["client-000"]
    shape = co.model.interface_shape(co.model.depth_of(k))
    act = {"z": np.zeros((4, *shape), np.float32), "y": np.array([0, 1, 2, 3]), "split": k}
    reply = only_reply(co.receive(Message("activation", "sim-0", 2, 1, "client-000", act)))
    assert reply.kind == "error" and "final evaluation" in reply.body["reason"]
    reply = only_reply(co.receive(Message("evaluate", "sim-0", 2, 2, "client-000", act)))
    assert reply.kind == "eval_result"
    before = {n: v.clone() for n, v in co.model.state_dict().items()}
    junk = {"weights": {"nonsense": np.ones(3)}, "num_samples": 1}
    assert only_reply(co.receive(Message("update", "sim-0", 2, 3, "client-000", junk))).kind == "ack"
    rec, _ = co.end_round()
    assert rec["fed_count"] == 4 and rec["fed_model_round"] == 1 and not co.fed_eval.only
    assert all(v.equal(before[n]) for n, v in co.model.state_dict().items())


def test_evaluate_requests_that_break_the_rules_are_refused_and_change_nothing(digits) -> None:
    sim = Simulation(tiny_config("static", clients=2, eval_holdout=0.25, rounds=3), digits)
    co = sim.coordinator
    co.begin_round(1)
    k = co.round.assigned["client-000"]
    shape = co.model.interface_shape(co.model.depth_of(k))
    good = {"z": np.zeros((4, *shape), np.float32), "y": np.array([0, 1, 2, 3]), "split": k}
    bad = {
        "NaN": dict(good, z=np.full((4, *shape), np.nan, np.float32)),
        "wrong shape": dict(good, z=np.zeros((4, 3), np.float32)),
        "labels out of range": dict(good, y=np.array([0, 1, 2, 99])),
        "split out of range": dict(good, split=99),
        "more than a batch": dict(good, z=np.zeros((40, *shape), np.float32), y=np.zeros(40, np.int64)),
        "no y": {"z": good["z"], "split": k},
    }
    for seq, (name, body) in enumerate(bad.items(), start=1):
        reply = only_reply(co.receive(Message("evaluate", "sim-0", 1, seq, "client-000", body)))
        assert reply.kind == "error", name
    held = co.fed_eval.expected["client-000"]
    co.fed_eval.expected["client-000"] = 3  # more samples than the device said it holds out
    reply = only_reply(co.receive(Message("evaluate", "sim-0", 1, 9, "client-000", good)))
    assert reply.kind == "error" and "more than the 3" in reply.body["reason"]
    co.fed_eval.expected["client-000"] = held
    assert co.fed_eval.tally == {}
    reply = only_reply(co.receive(Message("evaluate", "sim-0", 1, 10, "client-000", good)))
    assert reply.kind == "eval_result" and reply.body["count"] == 4
    co.end_round()
    co.begin_round(2)  # round 2 follows an evaluation round (eval_every 1): it evaluates too
    assert co.fed_eval.active
    sim2 = Simulation(tiny_config("static", clients=1, eval_holdout=0.25, rounds=3, eval_every=2), digits)
    sim2.coordinator.begin_round(2)  # after round 1, not an evaluation round
    reply = only_reply(sim2.coordinator.receive(Message("evaluate", "sim-0", 2, 1, "client-000", good)))
    assert reply.kind == "error" and "not an evaluation round" in reply.body["reason"]


# -- real processes --------------------------------------------------------------------------------------------

# Run the CLI with some modules unimportable and some paths unreadable (an audit hook on open/listdir):
# what the process cannot reach, it cannot have used.
GUARDED_CLI = textwrap.dedent(
    """
    import os, sys
    _BLOCK = [m for m in os.environ.get("GUARD_BLOCK", "").split(",") if m]
    class _Blocked:
        def find_spec(self, name, path=None, target=None):
            if any(name == m or name.startswith(m + ".") for m in _BLOCK):
                raise ImportError(f"{name} is not installed here")
    sys.meta_path.insert(0, _Blocked())
    _DENY = [p for p in os.environ.get("GUARD_DENY", "").split(os.pathsep) if p]
    _ALLOW = [p for p in os.environ.get("GUARD_ALLOW", "").split(os.pathsep) if p]
    def _hook(event, args):
        if event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
            p = os.path.abspath(os.fsdecode(args[0]))
            if any(p.startswith(d) for d in _DENY) and not any(p.startswith(a) for a in _ALLOW):
                raise PermissionError(13, "not this process's data", p)
    sys.addaudithook(_hook)
    from fedsga_edge.cli.main import app
    app(sys.argv[1:])
    """
)

FLAGS = ["--dataset", "digits", "--model", "resnet18_cifar", "--width", "0.25", "--seed", "0", "--local-epochs", "1",
         "--max-batches", "2", "--batch-size", "32", "--round-timeout", "300", "--clients", "3", "--eval-holdout",
         "0.2"]


def _spawn(script: Path, args: list[str], log: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(script), *args], stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env=os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"} | env)


@pytest.mark.integration
@pytest.mark.slow
def test_partition_writes_a_mixed_fleet_as_simulate_draws_it(tmp_path, digits) -> None:
    """``--partition mixed``: the even-positioned devices get IID shares, the odd ones Dirichlet(--alpha) shares,
    exactly the ones simulate's plan gives the same flags."""
    out = tmp_path / "mixed"
    res = _cli("partition", "--dataset", "digits", "--clients", "4", "--seed", "2", "--partition", "mixed",
               "--alpha", "0.05", "--out", str(out), "--format", "npz")
    assert res.returncode == 0, res.stderr[-3000:]
    plan = plan_run(tiny_config("static", clients=4, seed=2, partition="mixed", alpha=0.05, eval_holdout=0.0), digits,
                    seed_globals=False, torch_free=True)
    run = read_run_data(out / "dataset.json")
    classes = []
    for i, cid in enumerate(plan.client_ids):
        images, counts = read_local_data(out / f"{cid}.npz", run)
        assert np.array_equal(images.labels, digits.train.labels[plan.parts[i]])
        classes.append(sum(1 for n in counts.values() if n >= 0.05 * len(images.labels)))
    assert classes[0] == classes[2] == 10 and max(classes[1], classes[3]) < 10


def test_devices_each_with_only_their_own_folder_and_a_coordinator_without_training_data(partitioned,
                                                                                          tmp_path) -> None:
    """The must-show: three device processes, each given a private copy of its own folder and unable to open
    the others' or the dataset (scikit-learn's digits loader unimportable and its files unreadable, the other
    folders unreadable), one of them
    torch-free on the ONNX backend; a coordinator with the class list and a test set, no training data. Every
    round completes with every device, and metrics.jsonl has the federated accuracy of every round."""
    from fedsga_edge.broker.launch import start_embedded

    art = device_artifacts()
    script = tmp_path / "guarded.py"
    script.write_text(GUARDED_CLI)
    own = []
    for i in range(3):  # each device's private copy; the partition the copies came from is gone
        dest = tmp_path / f"device-{i}" / "data"
        shutil.copytree(partitioned / f"client-{i:03d}", dest)
        own.append(dest)
    source = tmp_path / "source"
    shutil.copytree(partitioned, source)
    for i in range(3):
        shutil.rmtree(source / f"client-{i:03d}")  # the coordinator's side: dataset.json and the test split only
    import sklearn.datasets

    digits_files = str(Path(sklearn.datasets.__file__).parent)  # where scikit-learn keeps the digits data set
    deny = os.pathsep.join([str(tmp_path / f"device-{i}") for i in range(3)] + [str(partitioned), digits_files])
    running = start_embedded(tmp_path / "broker")
    run, procs = tmp_path / "run", []
    try:
        common = ["--broker", running.url, "--threads", "1", "--rounds", "2", *FLAGS]
        procs.append(_spawn(script, ["coordinator", "--run-dir", str(run), "--classes", str(source / "dataset.json"),
                                     "--test-data", str(source / "test"), *common], tmp_path / "coord.log",
                            GUARD_BLOCK="sklearn.datasets", GUARD_DENY=deny,
                            FEDSGA_EDGE_DATA=str(tmp_path / "nothing")))
        for i in range(3):
            onnx = ["--backend", "onnx", "--artifacts", str(art)] if i == 2 else []
            procs.append(_spawn(script, ["device", "--index", str(i), "--state-dir", str(tmp_path / f"state-{i}"),
                                         "--data", str(own[i]), *onnx, *common], tmp_path / f"d{i}.log",
                                GUARD_BLOCK="sklearn.datasets,torch" if i == 2 else "sklearn.datasets", GUARD_DENY=deny,
                                GUARD_ALLOW=str(tmp_path / f"device-{i}"),
                                FEDSGA_EDGE_DATA=str(tmp_path / "nothing")))
        procs[0].wait(timeout=500)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        running.stop()
    logs = {n: (tmp_path / f"{n}.log").read_text() for n in ("coord", "d0", "d1", "d2")}
    assert all(p.returncode == 0 for p in procs), {n: t[-2000:] for n, t in logs.items()}
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in recs] == [1, 2] and not any(r["failures"] for r in recs), recs
    final = recs[-1]["fed_final"]  # the final model on every device's slice, the torch-free one's included
    assert final["fed_model_round"] == 2 and set(final["fed_by_device"]) == set(recs[-1]["splits"])
    for r in recs:
        assert set(r["splits"]) == {"client-000", "client-001", "client-002"}
        assert set(r["fed_by_device"]) == set(r["splits"]) and 0 <= r["fed_acc"] <= 1
        assert r["fed_count"] == sum(d["count"] for d in r["fed_by_device"].values()) > 0
        assert 0 <= r["test_acc"] <= 1  # the coordinator's own test set, beside the federated figure
    desc = json.loads((partitioned / "dataset.json").read_text())
    registered = json.loads((run / "devices.json").read_text())
    for i in range(3):
        cid = f"client-{i:03d}"
        held = registered[cid]["eval_samples"]
        assert registered[cid]["num_samples"] + held == desc["devices"][cid]  # the sizes its hello reported
        line = next(json.loads(x) for x in (tmp_path / f"state-{i}" / "agent.log").read_text().splitlines()
                    if '"local_data"' in x)
        assert line["path"] == str(own[i]) and line["samples"] == desc["devices"][cid]
    assert registered["client-002"]["backend"] == "onnx"
    config = json.loads((run / "config.json").read_text())
    assert config["local_data"]["classes"] == desc["classes"] and config["client_sizes"] == {}


@pytest.mark.integration
@pytest.mark.slow
def test_bad_local_data_fails_at_device_start_before_the_device_registers(partitioned, tmp_path) -> None:
    """An unknown class folder, a corrupt image, an empty folder: each device process (torch-free: the data is
    read before any backend is built) exits with the file named and what to do, and what stands in for the
    coordinator on the broker sees its describe at most, never a hello."""
    import re

    from fedsga_edge.broker.launch import start_embedded
    from fedsga_edge.transport import Peer
    from fedsga_edge.transport.mqtt import MqttTransport

    bad = {}
    for name in ("unknown", "corrupt", "empty"):
        root = tmp_path / name
        shutil.copytree(partitioned / "client-000", root)
        bad[name] = root
    (bad["unknown"] / "ten").mkdir()
    shutil.copy(next((bad["unknown"] / "0").iterdir()), bad["unknown"] / "ten" / "x.png")
    victim = min((bad["corrupt"] / "3").iterdir())
    victim.write_bytes(victim.read_bytes()[:40])  # truncated
    for f in (bad["empty"] / "4").iterdir():
        f.unlink()
    description = read_run_data(partitioned / "dataset.json").to_wire()
    running = start_embedded(tmp_path / "broker")
    seen: list[tuple[str, str]] = []
    transport = MqttTransport.from_url(running.url, run="sim-0", client_id="coordinator")
    peer = Peer(transport, "coordinator", "sim-0")

    def coordinator(msg: Message) -> Message:
        seen.append((msg.sender, msg.kind))
        if msg.kind == "describe":
            return peer.reply(msg, "description", description)
        return peer.reply(msg, "error", {"reason": "this test registers nobody"})

    peer.register(coordinator)
    common = ["--broker", running.url, "--rounds", "1", "--backend", "onnx", "--artifacts", str(tmp_path / "none"),
              *FLAGS]
    try:
        devices = {name: subprocess.Popen([sys.executable, "-c", BLOCK_TORCH + "\nfrom fedsga_edge.cli.main import "
                                           "app\napp(sys.argv[1:])", "device", "--index", str(i), "--state-dir",
                                           str(tmp_path / f"s{i}"), "--data", str(root), *common],
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                          env=os.environ | {"OMP_NUM_THREADS": "1", "COLUMNS": "300"})
                   for i, (name, root) in enumerate(bad.items())}
        results = {name: (proc.communicate(timeout=300), proc.returncode) for name, proc in devices.items()}
    finally:
        transport.close()
        running.stop()
    expect = {"unknown": r"class folder \S*ten is not a class of this run .*rename it to one of them or remove it",
              "corrupt": rf"{victim.name} is not a readable image .*corrupt or truncated; replace or remove it",
              "empty": r"class folder \S*/4 is empty: put that class's images in it or remove it"}
    for name, ((_, stderr), rc) in results.items():
        err = " ".join(stderr.split())
        assert rc == 2, (name, stderr[-2000:])
        assert "did not register: its data:" in err and "Traceback" not in err, (name, err[-2000:])
        assert re.search(expect[name], err), (name, err[-2000:])
    assert {kind for _, kind in seen} <= {"describe"}  # no hello from any of them
    assert ("client-002", "describe") not in seen  # the empty folder is found before the coordinator is asked
    assert {("client-000", "describe"), ("client-001", "describe")} <= set(seen)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.full("a trial of device processes against a simulate of the same shares: 40 s; the folders' reading "
                  "is tested process by process in the default run")
def test_trial_with_device_folders_equals_simulate_on_the_same_share(tmp_path) -> None:
    """`trial --device-data` (a coordinator with no training data, the device process given its folder) and
    `simulate` (the in-process partition): with one device the same computation, so the same numbers, bit
    for bit: the folder holds the share's samples in the share's order (test 1), so the batches, the held-out
    slice and the federated figures are the same."""
    flags = ["--dataset", "digits", "--model", "resnet18_cifar", "--width", "0.25", "--seed", "0", "--local-epochs",
             "1", "--max-batches", "2", "--batch-size", "32", "--round-timeout", "300", "--clients", "1", "--rounds",
             "2", "--eval-holdout", "0.2", "--strategy", "static"]
    shares, trial, sim = tmp_path / "shares", tmp_path / "trial", tmp_path / "sim"
    assert _cli("partition", *flags, "--out", str(shares), "--test").returncode == 0
    res = _cli("trial", *flags, "--device-data", str(shares), "--test-data", str(shares / "test"), "--out", str(trial),
               "--quiet")
    assert res.returncode == 0, res.stderr[-3000:]
    res = _cli("simulate", *flags, "--out", str(sim), "--quiet", "--threads", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    a = [json.loads(x) for x in (trial / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (sim / "metrics.jsonl").read_text().splitlines()]
    assert len(a) == len(b) == 2
    for ra, rb in zip(a, b):
        for key in ("train_loss", "test_acc", "test_loss", "fed_acc", "fed_loss", "fed_count", "fed_by_device"):
            assert ra[key] == rb[key], (ra["round"], key, ra[key], rb[key])
    config = json.loads((trial / "config.json").read_text())
    assert config["local_data"]["test_samples"] == 360 and config["client_sizes"] == {}
    agent = [json.loads(x) for x in (trial / "devices" / "client-000" / "agent.log").read_text().splitlines()]
    assert next(e for e in agent if e["event"] == "local_data")["path"] == str((shares / "client-000").resolve())
