"""The tuning budget (benchmarks/tuning.py): the same chance for every method, the choice made from the records."""

from __future__ import annotations

import json

import pytest
from _bench import load_bench


@pytest.fixture(scope="module")
def T():
    return load_bench("tuning")


def test_every_table2_method_has_the_same_budget(T):
    A = T.A
    assert set(T.BUDGET) == set(A.TABLE2_METHODS)
    parser = A.build_parser()
    for preset in ("cifar-v1", "office-v1"):
        values = A.PRESETS[preset].settings()
        for m in A.TABLE2_METHODS:
            knobs = T.BUDGET[m]
            assert 1 <= len(knobs) <= 2 and all(2 <= len(k.settings(values)) <= 5 for k in knobs)
            budget = T.settings(m, values)
            # the same number of settings for every method: the same number of chances on the tuning seeds
            assert budget[0] == ("preset", {}) and len(budget) == T.MAX_SETTINGS
            assert len({name for name, _ in budget}) == len(budget)
            for name, vals in budget:  # every setting is a command line accuracy.py accepts, with that value
                args = parser.parse_args(T.accuracy_argv(preset, m, vals, [0, 1], T.tuning_dir(preset), []))
                for option, v in vals.items():
                    if v is not None:
                        assert getattr(args, option) == v
    # a rate relative to the devices': at cifar-v1 (lr 0.2, the preset's server rate 0.2) SplitFed's server rate is
    # tried at 0.015, 0.05, 0.1, 0.2 and 0.4
    cifar = A.PRESETS["cifar-v1"].settings()
    assert [v for _, v in T.settings("static", cifar)] == [{}, {"server_lr": 0.015}, {"server_lr": 0.05},
                                                          {"server_lr": 0.1}, {"server_lr": 0.4}]
    with pytest.raises(SystemExit, match="no tuning budget"):
        T.settings("random", cifar)


def test_the_choice_is_the_best_mean_of_finished_settings_only(T):
    parts, seeds = ["iid", "dir0.1"], [0, 1]
    table = {"preset": {"iid": {0: 0.50, 1: 0.52}, "dir0.1": {0: 0.30, 1: 0.32}},
             "mu0.1": {"iid": {0: 0.55, 1: 0.57}, "dir0.1": {0: 0.31, 1: 0.33}},
             "mu0.001": {"iid": {0: 0.90, 1: 0.90}, "dir0.1": {0: 0.90}}}  # best, but one run short: never chosen
    assert T.choose(table, parts, seeds) == "mu0.1"
    table["mu0.1"] = table["preset"]
    assert T.choose(table, parts, seeds) == "preset"  # a tie keeps the preset's value
    assert T.choose({"preset": {"iid": {0: 0.5}}}, parts, seeds) is None


def test_tuning_refuses_a_reported_seed(T):
    for seeds in ("10", "0,12", "3,11"):
        with pytest.raises(SystemExit, match="reported seeds"):
            T.main(["--preset", "office-v1", "--seeds", seeds, "--dry-run"])
    with pytest.raises(SystemExit, match="'random' have no tuning budget"):  # named before FedAvg's runs start
        T.main(["--preset", "office-v1", "--methods", "fedavg,random"])


def test_the_choice_can_be_made_on_some_of_the_presets_partitions(T, tmp_path, capsys):
    """--partitions: every run of the budget on the partitions named (half of cifar-v1's runs on Dir(0.1) alone), and
    the choice made on them alone; a partition the preset's tables do not report is refused by name."""
    argv = ["--preset", "cifar-v1", "--methods", "fedavg", "--out", str(tmp_path), "--dry-run"]
    assert T.main(argv)["runs"] == 2 * T.main(argv + ["--partitions", "dir0.1"])["runs"] == 20
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "accuracy.py" in ln]
    assert len(lines) == 10 and all(ln.endswith("--partitions dir0.1") for ln in lines[5:])
    assert not any("--partitions" in ln for ln in lines[:5])
    with pytest.raises(SystemExit, match="--partitions 'dir0.5'.*iid,dir0.1"):
        T.main(argv + ["--partitions", "dir0.5"])
    for name in ("preset", "lr0.05", "lr0.1", "lr0.4", "lr0.8"):  # Dir(0.1)'s runs only: a choice on it alone
        for seed in (0, 1):
            d = tmp_path / "tuning" / "fedavg" / name / "fedavg" / "dir0.1" / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps({"final_acc": 0.5, "headline_acc": 0.6 if name == "lr0.4"
                                                        else 0.4}))
    tables = ["--preset", "cifar-v1", "--methods", "fedavg", "--out", str(tmp_path), "--tables-only"]
    assert T.main(tables)["shared"] is None  # IID's runs missing: nothing chosen on both partitions
    assert T.main(tables + ["--partitions", "dir0.1"])["shared"] == {"lr": 0.4}
    assert json.loads((tmp_path / "tuning" / "tuning.json").read_text())["partitions"] == ["dir0.1"]


def test_a_small_sweep_runs_records_and_chooses(T, tmp_path):
    """FedAvg's and FedProx's five settings on digits, one tuning seed: ten real runs, FedProx's at the devices'
    rate FedAvg's chose, the choice from their records, and the same choice again from the records alone."""
    argv = ["--preset", "smoke", "--seeds", "2", "--out", str(tmp_path)]
    with pytest.raises(SystemExit, match="FedAvg's budget has unfinished runs.*--methods fedavg"):
        T.main(argv + ["--methods", "fedprox"])  # the devices' rate is every method's: FedAvg's budget first
    assert not list(tmp_path.rglob("summary.json"))
    out = T.main(argv + ["--methods", "fedprox,fedavg"])
    runs = sorted(str(p.relative_to(tmp_path / "tuning")).split("/")[:2] for p in tmp_path.rglob("summary.json"))
    lr0 = T.A.PRESETS["smoke"].settings()["lr"]
    rate = {"preset": lr0} | {f"lr{lr0 * f:g}": lr0 * f for f in (0.25, 0.5, 2, 4)}
    assert runs == sorted([["fedavg", n] for n in rate] + [["fedprox", n] for n in ("mu0.001", "mu0.003", "mu0.03",
                                                                                    "mu0.1", "preset")])
    saved = json.loads((tmp_path / "tuning" / "tuning.json").read_text())
    rates = {n: by_part["iid"]["2"] for n, by_part in saved["methods"]["fedavg"]["settings"].items()}
    assert saved["methods"]["fedavg"]["chosen"] == max(rates, key=lambda n: (rates[n], n == "preset"))
    lr = rate[saved["methods"]["fedavg"]["chosen"]]
    assert saved["shared"] == ({} if lr == lr0 else {"lr": lr})
    for f in (tmp_path / "tuning" / "fedprox").rglob("config.json"):  # FedProx ran at FedAvg's chosen rate
        assert json.loads(f.read_text())["train"]["lr"] == pytest.approx(lr)
    fedprox = saved["methods"]["fedprox"]
    accs = {n: by_part["iid"]["2"] for n, by_part in fedprox["settings"].items()}
    assert fedprox["chosen"] == max(accs, key=lambda n: (accs[n], n == "preset"))
    # every method's choice is in the file (those with no runs: none yet), whichever --methods ran
    assert set(saved["methods"]) == set(T.BUDGET) and saved["methods"]["fedgh"]["chosen"] is None
    assert out["markdown"].count("**chosen**") == 2 and out["markdown"].count("| 1/1 |") == 10
    again = T.main(argv + ["--methods", "fedprox", "--tables-only"])
    assert again["choice"]["fedprox"]["chosen"] == fedprox["chosen"] and again["shared"] == saved["shared"]
    # a record made at another devices' rate is not this setting's run: shown as such, never counted
    cfg = tmp_path / "tuning" / "fedprox" / "mu0.1" / "fedprox" / "iid" / "seed2" / "config.json"
    cfg.write_text(json.dumps(json.loads(cfg.read_text()) | {"train": {"lr": 0.777}}))
    stale = T.main(argv + ["--methods", "fedprox", "--tables-only"])
    assert "mu0.1" not in {n for n, runs in stale["choice"]["fedprox"]["settings"].items() if runs["iid"]}
    assert stale["markdown"].count("0/1 (1 made with other settings)") == 1


def _tuning_json(path, preset="smoke", shared=None, holdout=0.2, **chosen):
    methods = {m: {"chosen": None, "values": None, "settings": {}} for m in ("fedavg", "static", "fedprox")}
    for m, values in chosen.items():
        methods[m] = {"chosen": "x", "values": values, "settings": {}}
    path.write_text(json.dumps({"preset": preset, "seeds": [0, 1], "partitions": ["iid"], "eval_holdout": holdout,
                                "shared": shared, "methods": methods}))
    return path


def test_tuned_runs_every_method_at_the_budgets_choice(T, tmp_path):
    """--tuned: FedAvg's devices' rate for every method, each strategy's own choice for its methods (a variant at
    its strategy's), an option on the command line over the choice; an unfinished budget or another preset's
    file refused by name."""
    A = T.A
    path = _tuning_json(tmp_path / "tuning.json", shared={"lr": 0.3}, fedavg={"lr": 0.3},
                        static={"server_lr": 0.07})

    def configs(*extra):
        p = A.resolve(A.build_parser().parse_args(["--preset", "smoke", "--methods", "static,static-p1,fedavg,random",
                                                   "--tuned", str(path), *extra]))
        return {r["method"]: r["config"] for r in A.plan(p, A.data_spec(p.data), None) if r["seed"] == 0}

    c = configs()
    assert {m: (cfg.train.lr, cfg.server_lr) for m, cfg in c.items()} == {
        "static": (0.3, 0.07), "static-p1": (0.3, 0.07), "fedavg": (0.3, c["fedavg"].server_lr),
        "random": (0.3, c["random"].server_lr)}
    assert c["random"].server_lr == A.PRESETS["smoke"].settings()["server_lr"]  # random's strategy: none tuned
    assert configs("--server-lr", "0.01")["static"].server_lr == 0.01  # the command line wins
    # the budget's held-out slice is the table's, unless the command line says otherwise
    assert {cfg.eval_holdout for cfg in c.values()} == {0.2}
    assert {cfg.eval_holdout for cfg in configs("--eval-holdout", "0.1").values()} == {0.1}
    _tuning_json(path, shared={"lr": 0.3}, fedavg={"lr": 0.3})  # static's budget unfinished
    with pytest.raises(SystemExit, match="no choice yet for static"):
        configs()
    _tuning_json(path, shared=None)
    with pytest.raises(SystemExit, match="no choice yet for fedavg, static"):
        configs()
    _tuning_json(path, preset="office-v1", shared={}, fedavg={}, static={})
    with pytest.raises(SystemExit, match="choice at preset 'office-v1', not 'smoke'"):
        configs()
    with pytest.raises(SystemExit, match="does not exist.*tuning.py --preset smoke"):
        A.resolve(A.build_parser().parse_args(["--preset", "smoke", "--tuned", str(tmp_path / "none.json")]))
    # a table at the choice has its own folder: it never meets (or is refused by) the preset's own records
    parse = A.build_parser().parse_args
    assert A.default_out(parse(["--preset", "office-v1", "--tuned"])) == A.records_dir("office-v1") / "tuned"
    assert A.default_out(parse(["--preset", "office-v1"])) == A.records_dir("office-v1")


def test_the_others_settings_run_at_the_devices_rate_fedavg_chose(T, tmp_path, capsys):
    """FedAvg's records choose a devices' rate other than the preset's: every other method's settings (a server
    rate relative to the devices' included) are planned at it, and the choice file says so."""
    lr0 = T.A.PRESETS["office-v1"].settings()["lr"]
    rates = (("preset", 0.20), (f"lr{lr0 / 4:g}", 0.05), (f"lr{lr0 / 2:g}", 0.10), (f"lr{lr0 * 2:g}", 0.30),
             (f"lr{lr0 * 4:g}", 0.25))
    for name, acc in rates[:-1]:  # one rate short: FedAvg's budget is unfinished, and a rate not run might win
        for seed in (0, 1):
            d = tmp_path / "tuning" / "fedavg" / name / "fedavg" / "domain0.5" / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps({"final_acc": acc, "headline_acc": acc}))
    with pytest.raises(SystemExit, match="FedAvg's budget has unfinished runs"):
        T.main(["--preset", "office-v1", "--methods", "static", "--out", str(tmp_path), "--jobs", "1"])
    for name, acc in rates[-1:]:
        for seed in (0, 1):
            d = tmp_path / "tuning" / "fedavg" / name / "fedavg" / "domain0.5" / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps({"final_acc": acc, "headline_acc": acc}))
    out = T.main(["--preset", "office-v1", "--methods", "static", "--out", str(tmp_path), "--dry-run"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "accuracy.py" in ln]
    assert lines and all(f"--lr {lr0 * 2:g}" in ln for ln in lines)
    # the preset's server rate (0.1) is the chosen devices' rate x 0.5; the others are x 0.075, 0.25, 1 and 2 of it
    assert [v for _, v in out["budgets"]["static"]] == [{}] + [{"server_lr": round(lr0 * 2 * f, 6)}
                                                               for f in (0.075, 0.25, 1, 2)]
    done = T.main(["--preset", "office-v1", "--methods", "static", "--out", str(tmp_path), "--tables-only"])
    assert done["shared"] == {"lr": lr0 * 2} and "--lr " + f"{lr0 * 2:g}" in done["markdown"]


def test_personalised_methods_are_chosen_on_their_devices_own_data(T, tmp_path, capsys):
    """FedBABU's settings score alike on the global test set (its fine-tuning never touches the global model): its
    budget chooses by the devices' own held-out data on the models they use, as its paper scores it; FedProx's by
    the headline. Every planned run keeps the tables' held-out slice; without one an own-data budget is refused."""
    def record(method, name, headline, own):
        for seed in (0, 1):
            d = tmp_path / "tuning" / method / name / method / "domain0.5" / f"seed{seed}"
            d.mkdir(parents=True)
            (d / "summary.json").write_text(json.dumps({"final_acc": headline, "headline_acc": headline,
                                                        "final_own_acc": own}))
    lr0 = T.A.PRESETS["office-v1"].settings()["lr"]
    for name in ("preset", f"lr{lr0 / 4:g}", f"lr{lr0 / 2:g}", f"lr{lr0 * 2:g}", f"lr{lr0 * 4:g}"):
        record("fedavg", name, 0.2, 0.3)
    for name, own in (("preset", 0.40), ("fedbabu-finetune-epochs1", 0.45), ("fedbabu-finetune-epochs10", 0.35)):
        record("fedbabu", name, 0.2167, own)
    for name, head, own in (("preset", 0.25, 0.9), ("mu0.001", 0.24, 0.1), ("mu0.1", 0.26, 0.1)):
        record("fedprox", name, head, own)
    argv = ["--preset", "office-v1", "--methods", "fedbabu,fedprox", "--out", str(tmp_path)]
    # two settings of each not yet run: no choice (one of them might win), so --tuned refuses these methods
    out = T.main(argv + ["--tables-only"])
    assert out["choice"]["fedbabu"]["chosen"] is None and out["choice"]["fedprox"]["chosen"] is None
    for name in ("fedbabu-finetune-epochs2", "fedbabu-finetune-epochs20"):
        record("fedbabu", name, 0.2167, 0.30)
    for name in ("mu0.003", "mu0.03"):
        record("fedprox", name, 0.20, 0.95)
    out = T.main(argv + ["--tables-only"])
    assert out["choice"]["fedbabu"]["chosen"] == "fedbabu-finetune-epochs1"
    assert out["choice"]["fedbabu"]["score"] == "own data" and out["choice"]["fedprox"]["score"] == "test"
    assert out["choice"]["fedprox"]["chosen"] == "mu0.1"
    saved = json.loads((tmp_path / "tuning" / "tuning.json").read_text())
    assert saved["eval_holdout"] == T.TUNING_HOLDOUT and saved["methods"]["fedbabu"]["values"] == {
        "fedbabu_finetune_epochs": 1}
    capsys.readouterr()
    plan = T.main(argv + ["--dry-run"])
    lines = [ln for ln in capsys.readouterr().out.splitlines() if "accuracy.py" in ln]
    assert plan["runs"] == 20 and len(lines) == 10 and all(ln.endswith("--eval-holdout 0.2") for ln in lines)
    with pytest.raises(SystemExit, match="--eval-holdout 0: fedbabu are chosen on their devices' held-out data"):
        T.main(argv + ["--eval-holdout", "0", "--dry-run"])
    assert T.main(["--preset", "office-v1", "--methods", "fedprox", "--out", str(tmp_path), "--eval-holdout", "0",
                   "--dry-run"])["runs"] == 10
