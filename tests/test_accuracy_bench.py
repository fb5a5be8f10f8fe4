"""benchmarks/accuracy.py: tables and results.json from a tiny digits preset, resuming, the paper plan."""

from __future__ import annotations

import json

import numpy as np
import pytest
from _bench import load_bench
from _runs import assert_test_accuracy


@pytest.fixture(scope="module")
def bench():
    return load_bench("accuracy")


@pytest.mark.slow
def test_smoke_preset_writes_tables_and_resumes(bench, tmp_path, capsys, digits):
    import torch

    threads = torch.get_num_threads()
    argv = ["--preset", "smoke", "--out", str(tmp_path), "--no-progress"]
    first = bench.main(argv)
    assert torch.get_num_threads() == threads  # the benchmark's thread setting does not leak
    assert first["skipped"] == 0 and len(first["runs"]) == 4  # 2 methods x 1 partition x 2 seeds

    results = json.loads((tmp_path / "results.json").read_text())
    assert results["preset"] == "smoke"
    keys = {(r["method"], r["partition"], r["seed"]) for r in results["runs"]}
    assert keys == {(m, "iid", s) for m in ("static", "fedsga") for s in (0, 1)}
    for r in results["runs"]:
        s = r["summary"]
        rows = [json.loads(line) for line in (tmp_path / r["dir"] / "metrics.jsonl").read_text().splitlines()]
        # the headline is the last round's count of right answers over the whole test set, as metrics.jsonl has it
        assert s["final_acc"] == rows[-1]["test_acc"]
        assert_test_accuracy(rows[-1], len(digits.test))
        assert s["client_flops_per_sample"] > 0 and s["client_params"] > 0
        # client FLOPs: training plus what the method adds on the device (FedSGA's observation and probes)
        assert s["client_flops_per_sample"] == pytest.approx(s["client_train_flops_per_sample"]
                                                             + s["client_method_flops_per_sample"])
        assert (s["client_method_flops_per_sample"] > 0) == (r["method"] == "fedsga")
    fedsga = [r["summary"] for r in results["runs"] if r["method"] == "fedsga"]
    assert all(s["calibration_flops"]["client"] > 0 and s["calibration_all_k_flops"] > 0 for s in fedsga)
    assert all("mean_r" in s["diagnostics"] and "s_positive_rate" in s["diagnostics"] for s in fedsga)

    md = capsys.readouterr().out
    assert (tmp_path / "tables.md").read_text().strip() == results["tables_markdown"].strip()
    for heading in ("Table 2", "Table 4", "Table 5", "Calibration cost", "FedSGA diagnostics"):
        assert heading in md
    table2 = md.split("**Table 2")[1].split("**Table 4")[0]
    rows = [line for line in table2.splitlines() if line.startswith("| ") and "Method" not in line]
    assert [r.split("|")[1].strip() for r in rows] == ["Static at p_ref (SplitFed)", "**FedSGA**"]
    assert all("±" in r and r.rstrip().endswith("| 2 |") for r in rows)  # mean ± std over 2 seeds

    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("summary.json")}
    again = bench.main(argv)
    assert again["skipped"] == 4
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("summary.json")} == stamps
    assert again["tables"] == first["tables"]
    # the tables need only the records: a clone without the data set rebuilds them (absent.npz would be refused)
    rebuilt = bench.main(argv + ["--data", f"npz:{tmp_path / 'absent' / 'office31_32.npz'}", "--tables-only"])
    assert rebuilt["skipped"] == 4 and "**Table 2" in rebuilt["tables"]

    # runs made with other settings do not stand for this plan's: refused by name, nothing re-run or rewritten
    with pytest.raises(SystemExit, match=r"4 finished runs were made with other settings(.|\n)*train\.lr 0\.1, plan 0\.05"):
        bench.main(argv + ["--lr", "0.05", "--tables-only"])
    with pytest.raises(SystemExit, match="other settings"):
        bench.main(argv + ["--lr", "0.05"])
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("summary.json")} == stamps
    plan = bench.main(argv + ["--lr", "0.05", "--dry-run"])  # the dry run shows which, and does not refuse
    assert len(plan["plan"]) == 4
    assert "made with other settings: train.lr 0.1, plan 0.05" in capsys.readouterr().out


@pytest.mark.slow
def test_wire_formats_run_side_by_side_paired_by_seed(bench, tmp_path, capsys):
    """--wire-formats: one folder per format, and a table whose bytes ratio is each format's act+grad bytes
    (as metrics.jsonl records them) over fp32's on the same seed."""
    argv = ["--preset", "smoke", "--methods", "static", "--seeds", "0", "--out", str(tmp_path), "--no-progress"]
    first = bench.main([*argv, "--wire-formats", "fp32,int4"])
    assert first["skipped"] == 0
    assert sorted(r["dir"] for r in first["runs"]) == ["static/iid/seed0/fp32", "static/iid/seed0/int4"]
    sent = {}
    for r in first["runs"]:
        rows = [json.loads(line) for line in (tmp_path / r["dir"] / "metrics.jsonl").read_text().splitlines()]
        assert all(0 < row["bytes_act_grad"] < row["bytes_up"] + row["bytes_down"] for row in rows)  # weights are the rest
        sent[r["wire_format"]] = sum(row["bytes_act_grad"] for row in rows)
        assert r["summary"]["bytes_act_grad_per_round"] == pytest.approx(sent[r["wire_format"]] / len(rows))
    ratio = sent["int4"] / sent["fp32"]
    assert 0.125 < ratio <= 0.13  # two levels a byte, a float32 scale per 256 values, the envelope

    table = capsys.readouterr().out.split("**Wire formats side by side**")[1].split("###")[0]
    rows = {line.split("|")[3].strip(): [c.strip() for c in line.split("|")[1:-1]]
            for line in table.splitlines() if line.startswith("| Static")}
    assert list(rows) == ["fp32", "int4"]
    assert rows["fp32"][4] == "0 (reference)" and rows["fp32"][6] == "1.0000 (n=1)"
    assert rows["int4"][6] == f"{ratio:.4f} (n=1)"
    assert rows["int4"][4].endswith("(0/1)") or rows["int4"][4].endswith("(1/1)")
    assert (tmp_path / "tables.md").read_text().count("### Wire format") == 2  # then each format's own tables

    again = bench.main([*argv, "--wire-formats", "int4,fp32"])  # finished formats resume
    assert again["skipped"] == 2
    # one format keeps the plain layout, so runs finished before --wire-formats existed still resume
    plain = bench.main([*argv, "--wire-format", "int4", "--dry-run"])
    assert [r["dir"] for r in plain["plan"]] == ["static/iid/seed0"]
    with pytest.raises(SystemExit):
        bench.main([*argv, "--wire-formats", "fp32,int4", "--wire-format", "int4", "--dry-run"])
    with pytest.raises(SystemExit):
        bench.main([*argv, "--wire-formats", "fp32,int3", "--dry-run"])


def test_paper_preset_dry_run_plans_every_run(bench, tmp_path, capsys):
    plan = bench.main(["--preset", "paper", "--dry-run", "--out", str(tmp_path)])
    scale = plan["scale"]
    assert (scale["model"], scale["width"], scale["clients"], scale["rounds"]) == ("resnet18_cifar", 1.0, 20, 100)
    assert (scale["batch_size"], scale["lr"], scale["local_epochs"], scale["train_subset"]) == (64, 0.1, 5, 0)
    assert scale["static_split"] == 2  # p_ref of ResNet-18's three candidates
    runs = plan["plan"]
    methods = {r["method"] for r in runs}
    assert set(bench.DEFAULT_METHODS) <= methods
    assert {r["partition"] for r in runs} == {"iid", "dir0.1"}
    assert len(runs) == len(methods) * 2 * len(scale["seeds"]) and len(scale["seeds"]) >= 2
    assert not any(tmp_path.iterdir())  # a dry run writes nothing
    assert "per-run config" in capsys.readouterr().out


def test_gpu_preset_plans_fedsga_against_static_on_all_of_cifar10_at_full_width(bench, tmp_path):
    plan = bench.main(["--preset", "gpu", "--dry-run", "--out", str(tmp_path)])
    scale = plan["scale"]
    assert (scale["width"], scale["train_subset"], scale["device"]) == (1.0, 0, "auto")
    assert sorted((r["method"], r["partition"]) for r in plan["plan"]) == [("fedsga", "dir0.1"), ("static", "dir0.1")]
    assert not any(tmp_path.iterdir())


def test_server_lr_reaches_every_run_of_the_plan(bench):
    def configs(*flags: str) -> list:
        preset = bench.resolve(bench.build_parser().parse_args(["--preset", "cpu", *flags]))
        return [r["config"] for r in bench.plan(preset, "digits", None)]

    assert all(c.server_lr == 0.03 for c in configs())  # the CPU preset's own (RESULTS.md says why)
    assert all(c.server_lr == 0.1 for c in configs("--server-lr", "0.1"))


def test_the_splitfed_v1_preset_is_the_cifar_regime_with_per_client_server_copies_at_the_devices_rate(bench):
    def configs(preset: str) -> list:
        p = bench.resolve(bench.build_parser().parse_args(["--preset", preset, "--methods", "static,fedavg"]))
        return [r["config"] for r in bench.plan(p, "digits", None)]

    v1, v2 = configs("cifar-v1"), configs("cifar")
    assert [c.server_copies for c in v1] == ["per_client"] * len(v1) and {c.server_copies for c in v2} == {"shared"}
    assert all(c.server_lr == c.train.lr == 0.2 for c in v1)
    for a, b in zip(v1, v2):  # nothing else differs: the pair measures the server side alone
        da, db = a.to_dict(), b.to_dict()
        assert {k for k in da if da[k] != db[k]} == {"server_copies", "server_lr"}


def test_the_office_v1_preset_is_the_office_regime_with_per_client_copies_and_table_2s_eleven_methods(bench):
    def configs(preset: str, methods: str = "static,fedavg") -> list:
        p = bench.resolve(bench.build_parser().parse_args(["--preset", preset, "--methods", methods]))
        return [r["config"] for r in bench.plan(p, "digits", None)]

    v1, shared = configs("office-v1"), configs("office")
    assert [c.server_copies for c in v1] == ["per_client"] * len(v1)
    assert all(c.server_lr == c.train.lr == 0.1 for c in v1)
    for a, b in zip(v1, shared):  # the pair measures the server side alone
        da, db = a.to_dict(), b.to_dict()
        assert {k for k in da if da[k] != db[k]} == {"server_copies", "server_lr"}
    preset = bench.PRESETS["office-v1"]
    assert sorted(preset.methods) == sorted(["fedavg", "fedprox", "fedbabu", "fedgh", "fedas", "static", "mergesfl",
                                             "fedmut", "musplitfed", "multisfl", "fedsga"])
    assert preset.partitions == ["domain0.5"] and preset.seeds == [10, 11, 12]
    # MergeSFL's one merged server step keeps its shared copy whatever the preset says (its method line)
    merge = configs("office-v1", "mergesfl")
    assert {c.server_copies for c in merge} == {"shared"}


def test_schedule_reaches_every_run_of_the_plan(bench, tmp_path):
    preset = bench.resolve(bench.build_parser().parse_args(["--preset", "cpu"]))
    assert {r["config"].schedule for r in bench.plan(preset, "digits", None)} == {"round_robin"}
    assert {r["config"].schedule for r in bench.plan(preset, "digits", None, schedule="random")} == {"random"}
    plan = bench.main(["--preset", "cpu", "--schedule", "sequential", "--dry-run", "--out", str(tmp_path)])
    assert plan["scale"]["schedule"] == "sequential"


def test_domain_preset_dry_run_plans_office31_domain_skew(bench, tmp_path, capsys):
    plan = bench.main(["--preset", "domain", "--dry-run", "--out", str(tmp_path)])
    scale = plan["scale"]
    office = bench.REPO.parent / "shared" / "data" / "office31" / "office31_32.npz"
    assert scale["data"] == f"npz:{office}"
    assert (scale["clients"], scale["train_subset"], scale["local_epochs"], scale["augment"]) == (9, 0, 1, True)
    assert scale["partitions"] == ["domain0.5"] and scale["seeds"] == [0, 1]
    runs = plan["plan"]
    assert {r["method"] for r in runs} == {"fedsga", "static", "static-p1", "random", "fedavg", "fedsga-no-harmonizer"}
    assert len(runs) == 6 * 2 and all(r["dir"].split("/")[1] == "domain0.5" for r in runs)
    out = capsys.readouterr().out
    assert "partition=domain(0.5)" in out and '"partition": "domain", "alpha": 0.5' in out
    assert "static-p1/domain0.5/seed0" in out and "strategy=static split=1 " in out
    assert not any(tmp_path.iterdir())

    mine = str(tmp_path / "mine.npz")
    other = bench.main(["--preset", "domain", "--dry-run", "--data", mine, "--out", str(tmp_path)])
    assert other["scale"]["data"] == f"npz:{tmp_path / 'mine.npz'}"


def test_static_methods_pin_their_split(bench):
    K, ref = bench.num_splits("resnet18_cifar", 0.25), bench.reference_split("resnet18_cifar", 0.25)
    assert (K, ref) == (3, 2)
    pinned = ("static", "static-p1", "static-pK", "fedsga", "fedsga-no-estimator", "fedsga-no-estimator-pK")
    splits = {m: bench.method_split(m, ref, K) for m in pinned}
    assert splits == {"static": 2, "static-p1": 1, "static-pK": 3, "fedsga": 2, "fedsga-no-estimator": 2,
                      "fedsga-no-estimator-pK": 3}
    assert all(m in bench.METHODS and m in bench.LABELS for m in ("static", "static-p1", "static-pK"))


def test_ablation_table_pairs_each_variant_with_its_full_method(bench):
    def runs(accs):
        return [{"_seed": s, "headline_acc": a} for s, a in enumerate(accs)]

    g = {("static", "iid"): runs([0.50, 0.60]), ("fedsga", "iid"): runs([0.55, 0.60]),
         ("fedsga-no-adapt", "iid"): runs([0.50, 0.58])}
    md = bench._acc_table(g, ["iid"], list(bench.METHODS), "Table 4", bench.ABLATIONS, vs_full=True)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in md if line.startswith("| ")}
    # the variant: against static (0.00, -2.00 points) and against full FedSGA (-5.00, -2.00), each paired by seed
    assert rows[bench.LABELS["fedsga-no-adapt"]][1:3] == ["-1.00 ± 1.00 (0/2)", "-3.50 ± 1.50 (0/2)"]
    assert rows[bench.LABELS["fedsga"]][1:3] == ["+2.50 ± 2.50 (1/2)", "0 (full)"]


def test_the_accuracy_table_sets_the_final_models_own_data_figure_beside_its_test_figure(bench):
    """Per partition an own-data column (the summary's ``final_own_acc``: the final model's, mean over devices),
    mean ± std over seeds; "—" where a seed's run predates the final evaluation, and without any such figure no
    column but a note saying why."""
    def runs(accs, own=None):
        return [{"_seed": s, "headline_acc": a} | ({} if own is None else {"final_own_acc": own[s]})
                for s, a in enumerate(accs)]

    g = {("static", "iid"): runs([0.50, 0.60], [0.70, 0.80]), ("fedbabu", "iid"): runs([0.40, 0.50], [0.90, 0.70]),
         ("fedavg", "iid"): runs([0.55, 0.65])}
    md = bench._acc_table(g, ["iid"], list(bench.METHODS), "Table 2", bench.MAIN_METHODS)
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in md if line.startswith("| ")}
    assert rows["Method"] == ["IID", "Δ IID", "own data IID", "seeds"]
    assert rows[bench.LABELS["static"]][2] == "75.00 ± 7.07" and rows[bench.LABELS["fedbabu"]][2] == "80.00 ± 14.14"
    assert rows[bench.LABELS["fedavg"]][2] == "—" and "own data: each device's held-out slice" in md[0]
    old = {k: [{"_seed": s["_seed"], "headline_acc": s["headline_acc"]} for s in v] for k, v in g.items()}
    md = bench._acc_table(old, ["iid"], list(bench.METHODS), "Table 2", bench.MAIN_METHODS)
    assert "own data" not in md[2] and any(line.startswith("No own-data column: these records") for line in md)


def test_eval_holdout_reaches_every_run_of_the_plan(bench):
    preset = bench.resolve(bench.build_parser().parse_args(["--preset", "cpu", "--eval-holdout", "0.2"]))
    assert all(r["config"].eval_holdout == 0.2 for r in bench.plan(preset, "digits", None))


def test_partition_names(bench):
    assert bench.parse_partition("iid") == ("iid", 0.0)
    assert bench.parse_partition("dir0.1") == ("dirichlet", 0.1)
    assert bench.parse_partition("dirichlet0.5") == ("dirichlet", 0.5)
    assert bench.parse_partition("domain0.5") == ("domain", 0.5)
    assert bench.partition_label("domain0.5") == "Domain + Dirichlet(0.5)"
    assert bench.parse_partition("mixed0.05") == ("mixed", 0.05)
    assert bench.partition_label("mixed0.05") == "Mixed: IID + Dirichlet(0.05)"
    cfg = bench.make_config(bench.PRESETS["smoke"], "static", "mixed0.05", 3, 2, "digits", None)
    assert (cfg.partition, cfg.alpha, cfg.seed) == ("mixed", 0.05, 3)
    from fedsga_edge.report.runs import partition_name  # the report names a run's partition as the benchmark does

    assert partition_name(cfg.to_dict()) == "mixed0.05" and partition_name({"partition": "domain", "alpha": 0.5}) == \
        "domain0.5"
    for bad in ("shards", "domain", "domain0", "dirx", "mixed", "mixed0"):
        with pytest.raises(SystemExit):
            bench.parse_partition(bad)


def test_diagnostics_without_estimator_and_with_calibration(bench):
    # the no-estimator ablation reports empty per-client dicts: no r, no diagnostics, no crash
    assert bench.diagnostics([{"round": 1, "splits": {"c0": 2}, "clients": {"c0": {}}}]) == {}
    assert bench.diagnostics([{"round": 1, "splits": {"c0": 0}}]) == {}
    recs = [
        {"round": 1, "clients": {"c0": {"a": 0.0, "delta": 0.0, "q": 0.0, "r": 0.9, "L1": 2.0, "Lref": 2.0, "s": 1},
                                 "c1": {"a": 0.0, "delta": 0.0, "q": 0.0, "r": 0.5, "L1": 3.0, "Lref": 2.0, "s": 0}},
         "calibration": {"accuracy": 1.0, "brier": 0.1}},
        {"round": 2, "clients": {"c0": {"a": 0.5, "delta": 1.0, "q": 0.1, "r": 0.7},
                                 "c1": {"a": 0.5, "delta": 1.0, "q": 0.1, "r": 0.3}}},
    ]
    d = bench.diagnostics(recs)
    assert d["r_by_round"] == pytest.approx([0.7, 0.5])
    assert d["s_positive_rate"] == 0.5 and d["s_by_round"] == {"1": 0.5}
    assert d["mean_L1_over_Lref"] == pytest.approx(1.25) and d["estimator_accuracy"] == 1.0


@pytest.mark.slow
def test_per_client_server_copies_is_the_engine_with_one_client(bench, tmp_path):
    """The diagnostic server mode changes nothing with one client, and something with two."""

    def losses(tag: str, mode: str, clients: int) -> list[float]:
        out = tmp_path / tag
        bench.main(["--preset", "smoke", "--methods", "static", "--seeds", "0", "--partitions", "dir0.3",
                    "--clients", str(clients), "--server-copies", mode, "--out", str(out), "--no-progress"])
        lines = (out / "static" / "dir0.3" / "seed0" / "metrics.jsonl").read_text().splitlines()
        return [json.loads(line)["test_loss"] for line in lines]

    assert losses("a", "shared", 1) == losses("b", "per-client", 1)
    assert losses("c", "shared", 2) != losses("d", "per-client", 2)


def test_subset_evaluations_record_the_prediction_share(bench, digits):
    from _runs import tiny_config

    from fedsga_edge.simulation import Simulation

    sim = Simulation(tiny_config("static", rounds=1), digits)
    next(sim.rounds())
    subset = bench.SubsetImages(digits.test, np.arange(60))
    out = bench.subset_eval(sim, subset, digits)
    assert set(out) == {"test_acc_subset", "test_loss_subset", "test_pred_share_subset"}
    share = out["test_pred_share_subset"]
    assert len(share) == len(digits.classes) and abs(sum(share) - 1) < 1e-3
    assert out == bench.subset_eval(sim, subset, digits)  # evaluating changes nothing


@pytest.mark.full("runs in processes beside in-process runs (about 30 s on the shared 2 cores)")
@pytest.mark.slow
def test_jobs_run_the_plan_in_processes_with_the_same_results_and_name_a_failed_run(bench, tmp_path, capsys):
    """--jobs 2: every run in its own process (its log in run.log), the same summaries as one job makes, one table;
    a run that fails is named with its log's end and the script exits non-zero after tabling the others."""
    argv = ["--preset", "smoke", "--methods", "static", "--no-progress"]
    one = bench.main(argv + ["--out", str(tmp_path / "one")])
    two = bench.main(argv + ["--out", str(tmp_path / "two"), "--jobs", "2"])
    assert two["skipped"] == 2 and all((tmp_path / "two" / r["dir"] / "run.log").exists() for r in two["runs"])
    acc = {r["dir"]: r["summary"]["final_acc"] for r in one["runs"]}
    assert {r["dir"]: r["summary"]["final_acc"] for r in two["runs"]} == acc and len(acc) == 2
    assert two["tables"].split("**Table 5")[0] == one["tables"].split("**Table 5")[0]  # Table 5 has wall seconds
    bad = tmp_path / "bad"
    (bad / "static" / "iid" / "seed1").mkdir(parents=True)
    (bad / "static" / "iid" / "seed1" / "metrics.jsonl").mkdir()  # the run cannot write its metrics: it fails
    with pytest.raises(SystemExit, match="1 runs failed .*static/iid/seed1"):
        bench.main(argv + ["--out", str(bad), "--jobs", "2"])
    assert "run static/iid/seed1 failed" in capsys.readouterr().err
    tabled = json.loads((bad / "results.json").read_text())["runs"]
    assert [r["dir"] for r in tabled] == ["static/iid/seed0"]  # the run that finished is in the tables


def test_jobs_materialise_the_data_once_before_the_workers_start(bench, tmp_path, monkeypatch):
    """Workers that each materialised a missing npz raced on one temporary file (a run failed at its first step):
    the parent makes it once, before any worker starts, and not at all when every run is done."""
    calls: list[str] = []
    monkeypatch.setattr(bench, "ensure_data", lambda spec: calls.append("data"))
    monkeypatch.setattr(bench, "run_parallel", lambda *a, **k: calls.append("workers") or [])
    argv = ["--preset", "smoke", "--methods", "static", "--no-progress", "--out", str(tmp_path), "--jobs", "2"]
    bench.main(argv)
    assert calls == ["data", "workers"]
    for seed in (0, 1):  # every run done: nothing to materialise
        d = tmp_path / "static" / "iid" / f"seed{seed}"
        d.mkdir(parents=True)
        (d / "summary.json").write_text("{}")
    calls.clear()
    monkeypatch.setattr(bench, "_run_all", lambda *a, **k: {})
    bench.main(argv)
    assert calls == ["workers"]
