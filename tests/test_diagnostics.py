"""The diagnostics behind RESULTS.md re-run a finished run exactly (same seed, same model)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from _runs import tiny_config

from fedsga_edge.simulation import run_simulation

REPO = Path(__file__).resolve().parents[1]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / "diagnostics" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_prefix_mismatch_reproduces_the_run_and_swaps_in_each_devices_prefix(tmp_path, digits) -> None:
    cfg = tiny_config("static", rounds=2, partition="dirichlet", alpha=0.3)
    summary = run_simulation(cfg, tmp_path / "run", bundle=digits)
    rows = _load("prefix_mismatch").main([str(tmp_path / "run"), "--every", "1", "--test-subset", "100000"])
    assert [r["round"] for r in rows] == [1, 2]
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    # the whole test set: the re-run's global model is the run's, and swapping prefixes in restored it
    assert rows[-1]["global_acc"] == last["test_acc"] == summary["final_acc"]
    assert len(rows[-1]["own_prefix_acc"]) == cfg.clients
    assert any(a != round(rows[-1]["global_acc"], 4) for a in rows[-1]["own_prefix_acc"].values())


def test_calibration_signal_ranks_devices_within_a_round_and_pools_relative_to_it(tmp_path, capsys) -> None:
    """AUC within a calibration round, r's spread in the rounds after it, and the pool over rounds with both
    labels, each input taken about its round's mean (a round's level is no device signal)."""
    mod = _load("calibration_signal")
    s = np.array([1.0, 1.0, 0.0, 0.0])
    assert mod.auc(np.array([3.0, 4.0, 1.0, 2.0]), s) == 1.0 and mod.auc(np.array([1.0, 1.0, 1.0, 1.0]), s) == 0.5
    assert mod.auc(np.array([1.0, 2.0]), np.array([1.0, 1.0])) is None

    def dev(**v):
        return {"a": 0.0, "delta": 1.0, "q": 0.0, "r_prev": 0.5, **v}

    # round 1's margins log(Lref / L1): c0 +log 2 (its shallow path did better), c1 -log 2
    rows = [{"round": 1, "clients": {"c0": dev(s=1, a=1.0, L1=1.0, Lref=2.0), "c1": dev(s=0, a=0.0, L1=2.0, Lref=1.0)}},
            {"round": 2, "clients": {"c0": dev(r=0.8), "c1": dev(r=0.3)}},
            # round 3: a is higher for both, the labels rank them the other way round
            {"round": 3, "clients": {"c0": dev(s=0, a=6.0), "c1": dev(s=1, a=5.0)}},
            {"round": 4, "clients": {"c0": dev(s=1), "c1": dev(s=1)}},
            # a first observation (delta = r_prev = 0) is no pair of Gamma's: a round of only those is no round
            {"round": 5, "clients": {"c0": dev(s=1, delta=0.0, r_prev=0.0), "c1": dev(s=0, delta=0.0, r_prev=0.0)}}]
    cal = mod.calibration_rounds(rows)
    assert [c["round"] for c in cal] == [1, 3, 4] and cal[0]["r_after"] == [(0.3, 0.8)]
    run = tmp_path / "fedsga" / "iid" / "seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mod.main([str(tmp_path)])
    out = capsys.readouterr().out
    assert "| fedsga/iid/seed0 | 1 | 2 | 0.50 | 1.00 | 0.50 | 0.50 | 0.50 | 0.50 | 0.50 |" in out  # r spread after: 0.8 - 0.3
    # round 3's labels go against round 1's margins: m_prev ranks them the wrong way round (no margin before round 1)
    assert "| fedsga/iid/seed0 | 3 | 2 | 0.50 | 0.00 | 0.50 | 0.50 | 0.50 | 0.00 |" in out
    assert np.allclose(cal[1]["m_prev"], [np.log(2.0), -np.log(2.0)]) and np.allclose(cal[0]["m_prev"], 0.0)
    assert "| fedsga/iid/seed0 | 3 | 2 | 0.50 | 0.00 |" in out and "| fedsga/iid/seed0 | 4 | 2 | 1.00 | - |" in out
    # pooled: round 1 says a ranks up, round 3 down; about each round's mean they cancel (round 4 has one label)
    assert "3 calibration rounds, 2 with both labels" in out and "AUC a 0.50" in out and "AUC m_prev 0.12" in out
    assert "one r for every device (spread < 0.01) in 0 of the 1 rounds after a calibration" in out  # 0.3 vs 0.8
    mod.main([str(tmp_path / "fedsga")])  # one method's folder alone
    assert "3 calibration rounds, 2 with both labels" in capsys.readouterr().out


def test_bn_recalibration_at_every_evaluation_reproduces_the_run_and_puts_the_statistics_back(tmp_path, digits) -> None:
    import torch

    mod = _load("bn_recalibration")
    cfg = tiny_config("static", rounds=2)
    summary = run_simulation(cfg, tmp_path / "run", bundle=digits)
    got = mod.every_eval(str(tmp_path / "run"), n_batches=3)
    # the re-run is the run (its last round's figure), although statistics were recomputed after round 1
    assert got["reproduced"] and got["rows"][-1]["test_acc"] == summary["final_acc"]
    assert all(r["logged"] == r["test_acc"] for r in got["rows"]) and len(got["rows"]) == 2  # every round logged
    assert got["headline"] == np.mean([r["test_acc"] for r in got["rows"]])
    assert any(r["test_acc_bn_recomputed"] != r["test_acc"] for r in got["rows"])
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    model.train()
    model(torch.randn(8, 3, 6, 6))  # some statistics, not the initial ones
    before = {k: v.clone() for k, v in model.state_dict().items()}
    saved = mod.recomputed(model, model, [torch.randn(8, 3, 6, 6) + 3.0])
    assert not torch.equal(model[1].running_mean, before["1.running_mean"])
    mod.put_back(model, saved)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()) and model[1].momentum == 0.1


def test_compare_pairs_groups_from_different_folders_on_their_common_seeds(tmp_path) -> None:
    def group(name: str, accs: dict[int, float], flops: float) -> Path:
        for seed, acc in accs.items():
            run = tmp_path / name / f"seed{seed}"
            run.mkdir(parents=True)
            (run / "summary.json").write_text(json.dumps({"headline_acc": acc, "client_flops_per_sample": flops,
                                                          "bytes_total": int(flops * 1e6) + seed * 200_000}))
        return tmp_path / name

    ref = group("ref", {10: 0.20, 11: 0.30, 12: 0.25}, 100.0)
    other = group("other", {10: 0.25, 11: 0.28, 13: 0.9}, 150.0)  # seed 12 unfinished, 13 not in ref
    seeds, rows = _load("compare").compare([("ref", (ref,)), ("other", (other,))])
    assert seeds == [10, 11]
    p = rows[1]["paired"]
    assert p["n"] == 2 and p["wins"] == 1 and np.isclose(p["mean"], (0.05 - 0.02) / 2)
    assert np.isclose(p["se"], np.std([0.05, -0.02], ddof=1) / np.sqrt(2))
    text = _load("compare").markdown(seeds, rows)
    assert "| other | 26.50 ± 2.12 | +1.50 ± 3.50 (1/2) | 25.00, 28.00 | 1.50 ± 0.00 | 152.1 |" in text
    assert "| ref | 25.00 ± 7.07 | 0 (reference) |" in text and "| 1.00 ± 0.00 | 102.1 |" in text
    # one group from several folders (reported and fresh seeds kept apart): their seeds joined, never one twice
    fresh = group("fresh", {12: 0.35}, 150.0)
    assert _load("compare").compare([("ref", (ref,)), ("other", (other, fresh))])[0] == [10, 11, 12]
    with pytest.raises(SystemExit, match="seed 10 is in more than one"):
        _load("compare").compare([("ref", (ref, ref)), ("other", (other,))])


def test_compare_tables_each_depth_head_with_the_headline_one_in_bold(tmp_path) -> None:
    runs = {("heads", 10): {"headline_acc": 0.4, "final_acc_by_split": {"1": 0.30, "2": 0.41, "3": 0.35},
                            "eval_split": 3, "headline_acc_depth_mean": 0.42},
            ("heads", 11): {"headline_acc": 0.5, "final_acc_by_split": {"3": 0.50, "1": 0.48, "2": 0.49},
                            "eval_split": 1, "headline_acc_depth_mean": 0.52},
            ("one", 10): {"headline_acc": 0.45, "final_acc_by_split": {"1": 0.45, "2": 0.45, "3": 0.45}, "eval_split": None},
            ("one", 11): {"headline_acc": 0.47, "final_acc_by_split": {"1": 0.47, "2": 0.47, "3": 0.47}, "eval_split": None}}
    for (name, seed), summary in runs.items():
        (tmp_path / name / f"seed{seed}").mkdir(parents=True)
        (tmp_path / name / f"seed{seed}" / "summary.json").write_text(json.dumps(summary))
    mod = _load("compare")
    text = mod.depth_heads(*mod.compare([("one", (tmp_path / "one",)), ("heads", (tmp_path / "heads",))]))
    # heads in depth order, the headline's in bold; spread (11 + 2) / 2 = 6.5; depth-mean beside the headline
    assert "| heads | 30.0 / 41.0 / **35.0** | **48.0** / 49.0 / 50.0 | 6.5 | 45.00 ± 7.07 | 47.00 ± 7.07 |" in text
    assert "| one | one head | one head | 0.0 | 46.00 ± 1.41 | - |" in text
    assert "depth-mean" not in mod.main([str(tmp_path / "one"), str(tmp_path / "heads")])  # only when asked
    assert "| heads | 30.0" in mod.main(["--depth-heads", f"one={tmp_path / 'one'}", f"heads={tmp_path / 'heads'}"])
