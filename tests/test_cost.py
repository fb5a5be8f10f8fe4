"""What a round's record says the devices computed (docs/method.md, "Costs").

``client_flops_per_sample`` is training plus what the method adds on the device (FedSGA's observation
forward and calibration probes), over the samples trained; the two parts are also kept apart, and
``client_params`` weighs every device by the samples it trained, as the FLOPs do.
"""

from __future__ import annotations

from typing import Any

import pytest
from _runs import tiny_config

from fedsga_edge.config import TrainConfig
from fedsga_edge.coordinator.server import samples_per_epoch
from fedsga_edge.runfiles import summarize
from fedsga_edge.simulation import Simulation


def small(strategy: str, **kw: Any):
    """Every sample trained once (no batch cap), on a few hundred digits split unevenly."""
    base = dict(clients=2, rounds=1, partition="dirichlet", alpha=0.5, train_subset=160,
                train=TrainConfig(local_epochs=1, batch_size=32, max_batches=0))
    return tiny_config(strategy, **(base | kw))


def train_per_sample(sim: Simulation, rec: dict[str, Any]) -> float:
    """Training FLOPs per sample as the data says: |D_i| samples each (one epoch, no cap)."""
    sizes = sim.coordinator.clients
    return sum(sizes[c] * sim.costs.train(k) for c, k in rec["splits"].items()) / sum(sizes[c] for c in rec["splits"])


def test_samples_per_epoch_cuts_batches_as_the_device_does() -> None:
    # balanced (the default): 33 = 11 + 11 + 11; 50 = 13 + 13 + 12 + 12
    assert samples_per_epoch(33, 16, 0) == 33 and samples_per_epoch(33, 16, 1) == 11
    assert samples_per_epoch(33, 16, 2) == 22 and samples_per_epoch(50, 16, 2) == 26
    # tail (runs before the option): 16 + 17, the last batch of one folded in; 50 = 16 + 16 + 16 + 2
    assert samples_per_epoch(33, 16, 0, "tail") == 33 and samples_per_epoch(33, 16, 1, "tail") == 16
    assert samples_per_epoch(33, 16, 2, "tail") == 16 + 17 and samples_per_epoch(50, 16, 2, "tail") == 32
    for batching in ("balanced", "tail"):
        assert samples_per_epoch(1, 16, 0, batching) == 1 and samples_per_epoch(0, 16, 0, batching) == 0


def test_a_fedsga_round_counts_its_probes_and_observation_on_the_device(digits) -> None:
    """Round 1 calibrates: every device probes. Client FLOPs exceed training FLOPs by exactly the
    round's observation and probe FLOPs over the samples trained."""
    sim = Simulation(small("fedsga"), digits)
    rec = next(sim.rounds())
    samples = sum(sim.coordinator.clients[c] for c in rec["splits"])
    added = rec["calibration_flops"]["client"] + rec.get("observation_flops", {}).get("client", 0)
    assert rec["calibration_flops"]["client"] > 0 and rec["client_samples"] == samples
    assert rec["client_train_flops_per_sample"] == pytest.approx(train_per_sample(sim, rec))
    assert rec["client_method_flops_per_sample"] == pytest.approx(added / samples)
    assert rec["client_flops_per_sample"] - rec["client_train_flops_per_sample"] == pytest.approx(added / samples)
    assert rec["client_flops_per_sample"] > train_per_sample(sim, rec) * 1.001


def test_a_strategys_observation_flops_are_folded_in(digits) -> None:
    """Whatever a strategy writes as ``observation_flops`` (FedSGA's observation forwards) counts."""
    sim = Simulation(small("static"), digits)
    end_round = sim.strategy.end_round

    def with_observation(updates: dict[str, Any], record: dict[str, Any]) -> None:
        end_round(updates, record)
        record["observation_flops"] = {"client": 7_000_000 * len(updates)}

    sim.strategy.end_round = with_observation
    rec = next(sim.rounds())
    samples = sum(sim.coordinator.clients[c] for c in rec["splits"])
    assert rec["client_method_flops_per_sample"] == pytest.approx(7_000_000 * len(rec["splits"]) / samples)
    assert rec["client_flops_per_sample"] == pytest.approx(train_per_sample(sim, rec) + 7_000_000 * 2 / samples)


def test_a_strategy_that_adds_nothing_costs_its_training(digits) -> None:
    sim = Simulation(small("static"), digits)
    rec = next(sim.rounds())
    assert rec["client_method_flops_per_sample"] == 0.0
    assert rec["client_flops_per_sample"] == rec["client_train_flops_per_sample"] == pytest.approx(
        train_per_sample(sim, rec))


def test_params_and_flops_weigh_devices_by_their_data(digits) -> None:
    """Two devices of unequal size at different splits: both figures are |D_i|-weighted means."""
    sim = Simulation(small("static"), digits)
    a, b = sim.client_ids
    sizes = sim.coordinator.clients
    assert sizes[a] != sizes[b]
    sim.strategy.assign = lambda t, devices: {a: 1, b: 3}  # static accepts exactly what it assigned
    rec = next(sim.rounds())
    assert rec["splits"] == {a: 1, b: 3}
    n, p, f = sizes[a] + sizes[b], sim.costs.params, sim.costs.train
    assert rec["client_params"] == pytest.approx((sizes[a] * p[1] + sizes[b] * p[3]) / n)
    assert rec["client_params"] != pytest.approx((p[1] + p[3]) / 2)
    assert rec["client_flops_per_sample"] == pytest.approx((sizes[a] * f(1) + sizes[b] * f(3)) / n)


def test_the_summary_keeps_the_parts_and_reads_older_runs() -> None:
    cfg = small("fedsga")
    new = [{"round": t, "splits": {"c": 1}, "bytes_up": 1, "bytes_down": 1, "client_params": 10.0,
            "client_flops_per_sample": 120.0 + t, "client_train_flops_per_sample": 100.0,
            "client_method_flops_per_sample": 20.0 + t, "observation_flops": {"client": 5},
            "calibration_flops": {"client": 7, "server": 9}} for t in (1, 2)]
    s = summarize(new, cfg, 1.0)
    assert (s["client_flops_per_sample"], s["client_train_flops_per_sample"], s["client_method_flops_per_sample"]) \
        == (121.5, 100.0, 21.5)
    assert s["observation_flops"] == {"client": 10} and s["calibration_flops"] == {"client": 14, "server": 18}
    # a run recorded before the parts: its client FLOPs were training alone, the method's part unknown
    old = [{k: v for k, v in r.items() if k not in ("client_train_flops_per_sample", "client_method_flops_per_sample",
                                                      "observation_flops")} for r in new]
    s = summarize(old, cfg, 1.0)
    assert s["client_train_flops_per_sample"] == s["client_flops_per_sample"] == 121.5
    assert s["client_method_flops_per_sample"] is None and s["observation_flops"] == {"client": 0}


def test_the_summary_and_the_last_line_carry_the_devices_own_figures_in_every_command() -> None:
    """simulate and the field commands build their summary here, so --eval-holdout's figures (and FedBABU's
    fine-tuned one) reach summary.json and the printed line whichever command ran."""
    from fedsga_edge.runfiles import fed_text

    cfg = small("fedbabu")
    rec = {"splits": {"c": 0}, "bytes_up": 1, "bytes_down": 1, "client_params": 1.0, "client_flops_per_sample": 1.0}
    records = [rec | {"round": 1, "fed_acc": 0.25, "fed_model_round": 0, "fed_acc_finetuned": 0.5},
               rec | {"round": 2}, rec | {"round": 3, "fed_acc": 0.375, "fed_model_round": 2, "fed_acc_finetuned": 0.625}]
    s = summarize(records, cfg, 1.0)
    assert (s["final_fed_acc"], s["fed_model_round"], s["final_fed_acc_finetuned"]) == (0.375, 2, 0.625)
    assert fed_text(s) == " final_fed_acc=0.3750 fed_model_round=2 final_fed_acc_finetuned=0.6250"
    # the final evaluation (the last round's fed_final) is the final model's figure: the summary's
    final = {"fed_acc": 0.5, "fed_model_round": 3, "fed_acc_finetuned": 0.75}
    s = summarize(records[:-1] + [records[-1] | {"fed_final": final}], cfg, 1.0)
    assert (s["final_fed_acc"], s["fed_model_round"], s["final_fed_acc_finetuned"]) == (0.5, 3, 0.75)
    plain = summarize([rec | {"round": 1}], cfg, 1.0)
    assert "final_fed_acc" not in plain and fed_text(plain) == ""
