"""The server's work as a reported cost (coordinator/server_work.py) and a controlled variable (--server-steps):
steps and FLOPs counted where the server steps, in every record and the summary, and Table 5's columns."""

from __future__ import annotations

import json

import pytest
import torch
from _bench import load_bench
from _runs import tiny_config

from fedsga_edge.coordinator.server import samples_per_epoch
from fedsga_edge.coordinator.server_work import step_flops
from fedsga_edge.runfiles import summarize
from fedsga_edge.simulation import Simulation


_RUNS: dict[str, tuple[Simulation, list[dict]]] = {}


def _run(strategy: str, digits, **kw) -> tuple[Simulation, list[dict]]:
    """One round of two devices, two batches each; the same run once for every test of this file."""
    key = f"{strategy} {sorted(kw.items())}"
    if key not in _RUNS:
        sim = Simulation(tiny_config(strategy, clients=2, rounds=1, max_batches=2, eval_every=1, **kw), digits)
        _RUNS[key] = sim, list(sim.rounds())
    return _RUNS[key]


def test_server_steps_k_multiplies_the_recorded_steps_and_changes_the_weights(digits) -> None:
    """--server-steps 2: every accepted activation takes two steps of the copy it trains, so the record's steps
    and FLOPs double, and the trained weights are not K=1's."""
    one, recs1 = _run("static", digits)
    two, recs2 = _run("static", digits, server_steps=2)
    assert one.coordinator.server.steps == 1 and two.coordinator.server.steps == 2
    activations = 2 * 2  # two devices, two batches each, one activation per batch
    assert recs1[0]["server_steps"] == activations and recs2[0]["server_steps"] == 2 * activations
    assert recs2[0]["server_flops"] == 2 * recs1[0]["server_flops"] > 0
    w1, w2 = one.model.state_dict(), two.model.state_dict()
    assert any(not torch.equal(w1[n], w2[n]) for n in w1)
    assert summarize(recs2, two.cfg, 0.0)["server_steps"] == 2 * activations  # summary.json: the rounds' sum


def test_server_flops_are_the_counted_step_per_row_times_the_rows_stepped(digits) -> None:
    """Static at one split: FLOPs = per-row forward + backward of the server blocks (counted by torch's FLOP
    counter, about three forwards from split k) x every row the devices trained."""
    sim, recs = _run("static", digits)
    c, k = sim.coordinator, sim.cfg.split
    model = c.model
    per_row = step_flops(c.strategy, model, c.head, torch.zeros(4, *model.interface_shape(model.depth_of(k), 0)), k)
    assert 2 * sim.costs.suffix_fwd(k) < per_row < 4 * sim.costs.suffix_fwd(k)
    tc = sim.cfg.train
    rows = sum(samples_per_epoch(n, tc.batch_size, tc.max_batches, tc.batching) for n in c.clients.values())
    assert recs[0]["server_flops"] == pytest.approx(per_row * rows, rel=1e-6)


def test_a_method_without_a_server_step_records_none_and_fedgh_its_head_steps(digits) -> None:
    """FedAvg's server only averages: 0 steps, 0 FLOPs. FedGH's server trains its head: one step per uploaded
    class mean (and epoch), each counted."""
    _, avg = _run("fedavg", digits)
    assert (avg[0]["server_steps"], avg[0]["server_flops"]) == (0, 0)
    _, gh = _run("fedgh", digits, strategy_args={"server_lr": 0.01, "server_epochs": 2})
    assert gh[0]["server_steps"] == 2 * gh[0]["class_means"] > 0 and gh[0]["server_flops"] > 0


def test_fedsgas_phi_s_steps_count_beside_the_server_blocks(digits) -> None:
    """FedSGA's server also trains phi_s, one step per activation once the prototypes exist (from round 2):
    round 2 counts twice round 1's steps; round 1's FLOPs include the calibration probes' server forwards."""
    sim = Simulation(tiny_config("fedsga", clients=2, rounds=2, max_batches=1), digits)
    first, second = sim.rounds()
    activations = 2  # two devices, one batch each
    assert first["server_steps"] == activations and "phi_s_loss" not in first
    assert second["server_steps"] == 2 * activations and "phi_s_loss" in second
    assert first["server_flops"] > first["calibration_flops"]["server"] > 0


def test_splitfed_at_matched_steps_takes_musplitfeds_server_steps(digits) -> None:
    """The control: static with --server-steps tau steps its server as often as MU-SplitFed at tau."""
    _, mu = _run("musplitfed", digits, strategy_args={"tau": 2})
    _, matched = _run("static", digits, server_steps=2)
    assert mu[0]["server_steps"] == matched[0]["server_steps"] and mu[0]["server_flops"] == matched[0]["server_flops"]


def test_server_steps_is_refused_where_the_strategy_trains_its_own_server_side(digits) -> None:
    with pytest.raises(ValueError, match="--server-steps 2: multisfl trains its own server side"):
        Simulation(tiny_config("multisfl", clients=2, rounds=1, server_steps=2), digits)


def test_the_matched_control_is_a_named_method_of_table_2() -> None:
    from fedsga_edge.coordinator.strategies.static import Static
    from fedsga_edge.coordinator.strategy import all_methods

    strategy, spec = all_methods()["static-steps2"]
    assert strategy == "static" and spec.group == "main" and spec.overrides == {"server_steps": 2}
    assert "2 server steps per activation" in spec.label
    assert Static.method_name(tiny_config("static", server_steps=2), 3) == "static-steps2"
    assert Static.method_name(tiny_config("static"), 3) == "static"


def test_table_5_reports_the_server_work_per_round_and_a_dash_for_older_records() -> None:
    bench = load_bench("accuracy")
    base = {"split_histogram": {"2": 20}, "client_params": 1e4, "client_flops_per_sample": 1e8,
            "client_method_flops_per_sample": 0.0, "wall_s": 10.0, "bytes_total": 1e6, "rounds": 10}
    new = [base | {"_seed": s, "server_steps": 400, "server_flops": 4e10} for s in (0, 1)]
    old = [base | {"_seed": s} for s in (0, 1)]
    md = "\n".join(bench._cost_table({("static", "iid"): new, ("musplitfed", "iid"): old}, ["iid"],
                                     ["static", "musplitfed"]))
    header = next(line for line in md.splitlines() if line.startswith("| Method"))
    cols = [c.strip() for c in header.split("|")]
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")] for line in md.splitlines()
            if line.startswith("| ") and not line.startswith("| Method")}
    steps, flops = cols.index("server steps / round"), cols.index("server GFLOPs / round")
    splitfed, mu = rows["Static at p_ref (SplitFed)"], rows["MU-SplitFed, first-order devices (tau server updates)"]
    assert (splitfed[steps], splitfed[flops]) == ("40.0", "4.00")
    assert (mu[steps], mu[flops]) == ("—", "—")
    assert "predate that count (not estimated)" in md


def test_table_5_dashes_the_client_flops_of_records_that_predate_the_device_passes_count(tmp_path) -> None:
    """A FedAS record whose rows lack ``method_flops`` counted its training alone: Table 5 gives "—" for its client
    FLOPs, the method's part and the ratio, not a figure that leaves the alignment out; with the count, the figures."""
    bench = load_bench("accuracy")
    base = {"split_histogram": {"0": 20}, "client_params": 1e4, "client_flops_per_sample": 1e8,
            "client_method_flops_per_sample": 0.0, "wall_s": 10.0, "bytes_total": 1e6, "rounds": 1}
    runs = {}
    for name, row in (("old", {"round": 1}), ("new", {"round": 1, "method_flops": {"client": 5}})):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"strategy": "fedas"}))
        (d / "metrics.jsonl").write_text(json.dumps(row) + "\n")
        runs[name] = bench.with_final_by_split(dict(base), d)
    assert runs["old"]["device_passes_uncounted"] and runs["old"]["client_method_flops_per_sample"] is None
    assert "device_passes_uncounted" not in runs["new"]
    ref = [base | {"_seed": 0}]
    for name, want in (("old", ["—", "—", "—"]), ("new", ["100.00", "0.00", "1.00 (n=1)"])):
        md = "\n".join(bench._cost_table({("fedas", "iid"): [runs[name] | {"_seed": 0}], ("static", "iid"): ref},
                                         ["iid"], ["fedas", "static"]))
        header = next(line for line in md.splitlines() if line.startswith("| Method"))
        cols = [c.strip() for c in header.split("|")]
        row = next([c.strip() for c in line.split("|")] for line in md.splitlines() if line.startswith("| FedAS"))
        at = [cols.index(c) for c in cols if c.startswith(("client MFLOPs", "of which", "client FLOPs /"))]
        assert [row[i] for i in at] == want, name
