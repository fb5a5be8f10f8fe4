"""``fedsga-edge report``: the data behind each plot, the page, and (integration) what a browser shows."""

from __future__ import annotations

import base64
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedsga_edge.cli.main import app
from fedsga_edge.report import build_report, discover
from fedsga_edge.report import data as D
from fedsga_edge.report.html import markdown_to_html

PNG = b"\x89PNG\r\n\x1a\n"
CLIENTS = ["client-000", "client-001", "client-002"]


def write_run(path: Path, strategy: str, seed: int, accs: list[float], *, partition: str = "iid", alpha: float = 0.1,
              fedsga: dict | None = None, splits: list[dict] | None = None, clients: list[dict] | None = None,
              extra: list[dict] | None = None, summary: bool = True, flops: float = 1e8,
              rounds: int | None = None, split: int = 2) -> Path:
    """A run folder as `simulate` writes it: config.json, metrics.jsonl and summary.json."""
    path.mkdir(parents=True)
    config = {"dataset": "digits", "partition": partition, "alpha": alpha, "clients": len(CLIENTS),
              "rounds": rounds or len(accs), "model": "resnet18_cifar", "width": 0.25, "strategy": strategy,
              "split": split, "seed": seed, "candidate_depths": [2, 3, 4],
              "fedsga": {"beta": 0.05, "adapt": True, "estimator": True, "harmonizer": True} | (fedsga or {})}
    rows = []
    for t, acc in enumerate(accs, 1):
        row = {"round": t, "test_acc": acc, "test_loss": 1.0 - acc, "train_loss": 2.0 / t,
               "splits": (splits[t - 1] if splits else {c: 2 for c in CLIENTS}),
               "bytes_up": 1_000_000 * t + seed, "bytes_down": 2_000_000 + seed, "client_flops_per_sample": flops,
               "client_params": 1e4, "failures": {}, "round_s": 1.5, "wall_s": 1.5}
        if clients:
            row["clients"] = clients[t - 1]
        if extra:
            row |= extra[t - 1]
        rows.append(row)
    (path / "config.json").write_text(json.dumps(config))
    (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    if summary:
        (path / "summary.json").write_text(json.dumps({
            "strategy": strategy, "rounds": len(accs), "final_acc": accs[-1], "client_flops_per_sample": flops,
            "bytes_up": sum(r["bytes_up"] for r in rows), "bytes_down": sum(r["bytes_down"] for r in rows),
            "wall_s": 1.5 * len(accs), "split_histogram": {"2": 3 * len(accs)}}))
    return path


def fedsga_clients(rs: list[list[float]], cal: dict[int, list[int]]) -> list[dict]:
    """Per round, per client r (and r_prev = last round's r); L1/Lref/s on the rounds in ``cal``."""
    out = []
    prev = [0.0] * len(CLIENTS)
    for t, r_round in enumerate(rs, 1):
        rec = {}
        for i, c in enumerate(CLIENTS):
            rec[c] = {"a": 0.1, "delta": 0.2, "q": 0.01, "r": r_round[i], "r_prev": prev[i]}
            if t in cal:
                s = cal[t][i]
                rec[c] |= {"L1": 1.0 if s else 1.5, "Lref": 1.2, "s": s}
        prev = list(r_round)
        out.append(rec)
    return out


def bench_tree(root: Path) -> Path:
    """benchmarks/accuracy.py's layout: OUT/<method>/<partition>/seed<s>/, 2 methods x 2 seeds, and tables."""
    write_run(root / "static/iid/seed0", "static", 0, [0.2, 0.4, 0.6], flops=1.0e8)
    write_run(root / "static/iid/seed1", "static", 1, [0.3, 0.5, 0.7], flops=1.0e8)
    splits = [{"client-000": 1, "client-001": 3, "client-002": 2}, {"client-000": 1, "client-001": 2},
              {"client-000": 0, "client-001": 1, "client-002": 3}]
    rs = [[0.9, 0.2, 0.6], [0.95, 0.5], [0.99, 0.8, 0.1]]
    rs = [r + [0.5] * (3 - len(r)) for r in rs]
    write_run(root / "fedsga/iid/seed0", "fedsga", 0, [0.1, 0.5, 0.8], splits=splits,
              clients=fedsga_clients(rs, {1: [1, 0, 1], 3: [1, 1, 0]}), flops=0.6e8)
    write_run(root / "fedsga/iid/seed1", "fedsga", 1, [0.3, 0.6, 0.9], splits=splits,
              clients=fedsga_clients(rs, {1: [1, 0, 0], 3: [1, 1, 0]}), flops=0.8e8)
    (root / "tables.md").write_text("### Table 2: accuracy\n\n| method | IID |\n|---|---:|\n"
                                    "| **FedSGA** | 85.0 ± 5.0 |\n"
                                    "| Static at p_ref (SplitFed) | 65.0 ± 7.1 |\n")
    (root / "results.json").write_text(json.dumps({"preset": "test", "command": "python benchmarks/accuracy.py",
                                                   "runs": []}))
    return root


def test_folder_of_runs_gives_grouped_mean_lines(tmp_path) -> None:
    root = bench_tree(tmp_path / "bench")
    runs, benches, notes = discover([root])
    assert len(runs) == 4 and [b.path for b in benches] == [root] and notes == []
    assert {(r.method, r.partition, r.seed) for r in runs} == {
        ("static", "iid", 0), ("static", "iid", 1), ("fedsga", "iid", 0), ("fedsga", "iid", 1)}
    curves = {c["label"]: c for c in D.accuracy_curves(runs)}
    assert list(curves) == ["static · iid", "fedsga · iid"]  # method order, one line per method
    st, fs = curves["static · iid"], curves["fedsga · iid"]
    assert st["rounds"] == [1, 2, 3]
    assert st["mean"] == pytest.approx([0.25, 0.45, 0.65])
    assert st["min"] == pytest.approx([0.2, 0.4, 0.6]) and st["max"] == pytest.approx([0.3, 0.5, 0.7])
    assert st["std"] == pytest.approx([np.std([0.2, 0.3], ddof=1)] * 3)
    assert fs["mean"] == pytest.approx([0.2, 0.55, 0.85]) and fs["n"] == [2, 2, 2]
    assert [s["label"] for s in fs["seeds"]] == ["seed 0", "seed 1"]
    # the `plot` alias keeps one line per run
    assert len(D.accuracy_curves(runs, by_run=True)) == 4


def test_mean_over_seeds_uses_the_seeds_that_have_a_round(tmp_path) -> None:
    write_run(tmp_path / "a/seed0", "static", 0, [0.2, 0.4, 0.6])
    write_run(tmp_path / "a/seed1", "static", 1, [0.4, 0.6], rounds=3, summary=False)  # stopped a round early
    write_run(tmp_path / "a/longer", "static", 2, [0.1] * 5)  # another experiment: a group of its own
    c, other = D.accuracy_curves(discover([tmp_path / "a"])[0])
    assert c["label"] == "static · iid · rounds=3" and other["label"] == "static · iid · rounds=5"
    assert c["rounds"] == [1, 2, 3] and c["n"] == [2, 2, 1]
    assert c["mean"] == pytest.approx([0.3, 0.5, 0.6])


def test_benchmark_subset_accuracy_fills_intermediate_rounds(tmp_path) -> None:
    run = write_run(tmp_path / "r", "static", 0, [0.5, 0.7])
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    rows[0]["test_acc_subset"] = rows[0].pop("test_acc")
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (c,) = D.accuracy_curves(discover([run])[0])
    assert c["mean"] == pytest.approx([0.5, 0.7]) and c["subset"] is True


def test_method_names_follow_the_benchmark(tmp_path) -> None:
    write_run(tmp_path / "x", "fedsga", 0, [0.5], fedsga={"harmonizer": False}, partition="dirichlet", alpha=0.1)
    write_run(tmp_path / "y", "fedsga", 0, [0.5], fedsga={"adapt": False, "estimator": False})
    write_run(tmp_path / "z", "fedsga", 0, [0.5], fedsga={"estimator": False}, split=3)
    write_run(tmp_path / "w", "fedsga", 0, [0.5], split=3)  # --split means nothing while the estimator decides
    runs = {r.path.name: r for r in discover([tmp_path])[0]}
    assert (runs["x"].method, runs["x"].partition) == ("fedsga-no-harmonizer", "dir0.1")
    assert runs["y"].method == "fedsga-no-adapt-no-estimator"
    assert runs["z"].method == "fedsga-no-estimator-pK" and runs["w"].method == "fedsga"


def test_split_matrix_per_client_and_round(tmp_path) -> None:
    root = bench_tree(tmp_path / "bench")
    run = next(r for r in discover([root])[0] if r.method == "fedsga" and r.seed == 0)
    m = D.split_matrix(run)
    assert m["clients"] == CLIENTS and m["rounds"] == [1, 2, 3] and m["ks"] == [0, 1, 2, 3]
    k = np.array(m["k"], dtype=float)
    assert k[:, 0].tolist() == [1, 3, 2] and k[:, 2].tolist() == [0, 1, 3]
    assert k[0, 1] == 1 and k[1, 1] == 2 and math.isnan(k[2, 1])  # client-002 sent no update in round 2


def test_reliability_pairs_s_with_the_r_of_the_same_round(tmp_path) -> None:
    root = bench_tree(tmp_path / "bench")
    runs = discover([root])[0]
    (rel,) = D.reliability(runs)  # only fedsga runs have (r, s)
    assert rel["label"] == "fedsga · iid"
    # calibration rounds 1 and 3 of two seeds: r of that round (not r_prev, not the next round's r)
    r = [0.9, 0.2, 0.6, 0.99, 0.8, 0.1] * 2
    s = [1, 0, 1, 1, 1, 0] + [1, 0, 0, 1, 1, 0]
    assert sorted(rel["r"]) == pytest.approx(sorted(r))
    assert rel["brier"] == pytest.approx(np.mean((np.array(r) - np.array(s)) ** 2))
    assert sum(b["n"] for b in rel["bins"]) == 12
    top = next(b for b in rel["bins"] if b["lo"] == pytest.approx(0.9))
    assert top["n"] == 4 and top["freq"] == 1.0 and top["mean_r"] == pytest.approx((0.9 + 0.99) / 2)
    (loss,) = D.estimator_losses(runs)
    assert loss["rounds"] == [1, 3] and loss["beta"] == 0.05
    assert loss["ratio"][0] == pytest.approx(np.mean([1 / 1.2, 1.5 / 1.2, 1 / 1.2, 1 / 1.2, 1.5 / 1.2, 1.5 / 1.2]))


def test_tradeoff_and_bytes_over_seeds(tmp_path) -> None:
    runs = discover([bench_tree(tmp_path / "bench")])[0]
    pts = {p["method"]: p for p in D.tradeoff_points(runs)}
    assert pts["fedsga"]["flops_mean"] == pytest.approx(0.7e8) and pts["fedsga"]["acc_mean"] == pytest.approx(0.85)
    assert pts["fedsga"]["acc_std"] == pytest.approx(np.std([0.8, 0.9], ddof=1)) and pts["static"]["n"] == 2
    b = {c["method"]: c for c in D.bytes_curves(runs)}
    assert b["static"]["up"]["mean"] == pytest.approx([1e6 + 0.5, 2e6 + 0.5, 3e6 + 0.5])
    assert b["static"]["down"]["min"] == [2e6] * 3 and b["static"]["down"]["max"] == [2e6 + 1] * 3


def profile_report(cpu: str, runtime: str, scale: float) -> dict:
    rows = [{"split": k, "depth": k + 1, "variant": "fp32", "batch": b,
             "latency_ms": {"p50": scale * k * b, "p90": scale * k * b * 1.3, "p99": 1.0, "cv": 0.1}}
            for k in (1, 2, 3) for b in (1, 32)]
    return {"device": {"cpu": cpu, "machine": "aarch64", "runtime": runtime, "cores_logical": 4},
            "model": {"arch": "resnet18_cifar", "width": 0.25}, "results": rows}


def test_latency_curves_per_device_and_runtime(tmp_path) -> None:
    curves = D.latency_curves([("pi", profile_report("Raspberry Pi 5", "onnxruntime", 2.0)),
                               ("pi_t", profile_report("Raspberry Pi 5", "torch", 3.0))])
    assert len(curves) == 4  # 2 device/runtime lines x 2 batch sizes
    c = next(c for c in curves if c["runtime"] == "torch" and c["batch"] == 32)
    assert c["splits"] == [1, 2, 3] and c["p50"] == pytest.approx([96, 192, 288])
    assert c["p90"][0] == pytest.approx(124.8)


def _pngs_in_html(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_report_command_writes_a_self_contained_page(tmp_path) -> None:
    import matplotlib.image as mpimg

    root = bench_tree(tmp_path / "bench")
    prof = tmp_path / "pi.json"
    prof.write_text(json.dumps(profile_report("Raspberry Pi 5", "onnxruntime", 2.0)))
    out = tmp_path / "report"
    res = CliRunner().invoke(app, ["report", str(root), "--profile", str(prof), "--out", str(out)])
    assert res.exit_code == 0, res.output
    page = (out / "report.html").read_text()
    pngs = sorted(out.glob("*.png"))
    names = {p.stem for p in pngs}
    assert {"accuracy", "splits", "reliability", "estimator_losses", "tradeoff", "bytes", "latency"} <= names
    for p in pngs:
        img = mpimg.imread(p)  # decodes
        assert img.ndim == 3 and img.shape[0] > 100 and img.shape[1] > 100 and float(img[..., :3].std()) > 0.02
    embedded = _pngs_in_html(page)
    assert sorted(embedded) == sorted(p.read_bytes() for p in pngs)  # every PNG inlined, nothing else
    assert "<img" in page and 'src="http' not in page and "<link" not in page  # nothing fetched
    assert "<td>85.0 ± 5.0</td>" in page and "<b>FedSGA</b>" in page  # tables.md rendered as a table
    assert page.count("<tr>") >= 4 + 2 + 1  # runs table + benchmark table + profile table
    assert "test_acc_by_split" in page  # the optional plots say why they are missing


def test_old_runs_without_optional_keys_do_not_crash(tmp_path) -> None:
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"round": 1, "test_acc": 0.3}\n{"round": 2, "test_acc": 0.5}\n{"round": 3, "te')
    rep = build_report([old], [], tmp_path / "out")
    assert rep.errors == []
    assert [p.stem for p in rep.pngs] == ["accuracy"]
    for key in ("splits", "reliability", "estimator_losses", "tradeoff", "bytes", "latency", "acc_by_split",
                "descriptor_entropy"):
        assert rep.section(key).png is None and rep.section(key).note
    page = rep.html.read_text()
    # nothing to show: no box each, one line at the page's end naming them, each item's reason as its tooltip
    line = re.search(r'<p class="absent" id="absent">not in these runs: (.*)\.</p>\n</body>', page)
    assert line and page.count('class="note"') == 0, page[-3000:]
    for key in ("splits", "reliability", "estimator_losses", "tradeoff", "bytes", "latency", "acc_by_split",
                "descriptor_entropy", "timeline", "federated"):
        assert f'<span id="{key}"' in line.group(1) and f'<h2 id="{key}"' not in page and f'href="#{key}"' not in page
    assert "latency per split depth (<code>--profile</code>" in line.group(1) and 'title="no profile given' in page
    assert '<h2 id="accuracy"' in page
    assert "<b>old</b>: 2 rounds, test accuracy 50.00 % after the last round (best 50.00 %)." in page  # no devices


def test_new_optional_keys_are_plotted(tmp_path) -> None:
    extra = [{"test_acc_by_split": {"1": 0.5, "2": 0.6}},
             {"test_acc_by_split": {"1": 0.7, "2": 0.8, "3": 0.9}}]
    clients = [{c: {"r": 0.5, "r_prev": 0.0, "descriptor_entropy": 1.0 + i} for i, c in enumerate(CLIENTS)},
               {c: {"r": 0.5, "r_prev": 0.5, "descriptor_entropy": 0.5} for c in CLIENTS}]
    write_run(tmp_path / "runs/a", "fedsga", 0, [0.4, 0.6], clients=clients, extra=extra)
    write_run(tmp_path / "runs/b", "fedsga", 1, [0.4, 0.6], clients=clients,
              extra=[{}, {"test_acc_by_split": {"1": 0.5, "2": 0.6, "3": 0.7}}])
    runs = discover([tmp_path / "runs"])[0]
    (acc,) = D.acc_by_split(runs)
    assert acc["ks"] == [1, 2, 3] and acc["mean"] == pytest.approx([0.6, 0.7, 0.8])
    (ent,) = D.descriptor_entropy(runs)
    assert ent["mean"] == pytest.approx([2.0, 0.5])
    rep = build_report([tmp_path / "runs"], [], tmp_path / "out")
    assert rep.errors == [] and rep.section("acc_by_split").png and rep.section("descriptor_entropy").png
    assert rep.section("reliability").png is None  # r without s: no calibration pair


def test_the_page_opens_with_what_each_run_did(tmp_path) -> None:
    """The summary before the first plot: rounds, devices (and who missed a round), accuracy, federated accuracy,
    bytes and, where recorded, each device's seconds per round; many runs: one line per method and partition."""
    splits = [{c: 2 for c in CLIENTS}, {"client-000": 2, "client-001": 2}]
    timing = {c: {"compute_s": 1.0 + i, "wire_s": 0.5, "wait_s": 0.25, "done_s": 2.0, "split": 2}
              for i, c in enumerate(CLIENTS)}
    write_run(tmp_path / "a", "static", 0, [0.5, 0.75], splits=splits,
              extra=[{"fleet_s": 3.0, "timing": timing, "fed_acc": 0.6, "fed_model_round": 0},
                     {"fleet_s": 3.0, "timing": timing, "fed_acc": 0.7, "fed_model_round": 1}])
    page = build_report([tmp_path / "a"], [], tmp_path / "out").html.read_text()
    start = page.index('<h2 id="summary">')
    assert start < page.index("<nav>") < page.index('<h2 id="accuracy">')
    summary = page[start:page.index("<nav>")]
    assert "static · iid · seed 0: 2 rounds with 3 devices (client-002 in 1 of 2)" in summary, summary
    assert "test accuracy 75.00 % after the last round (best 75.00 %)" in summary
    # the last own-data figure is round 2's: of the model after round 1, said so (no final evaluation here)
    assert "federated accuracy 70.00 % of the model after round 1 on the devices' own held-out data" in summary
    assert "3.00 MB up and 4.00 MB down, 3.0 s." in summary  # bytes_up 1e6 + 2e6, bytes_down 2 x 2e6, wall 2 x 1.5
    assert "client-000 1.00 / 0.50 / 0.25; client-001 2.00 / 0.50 / 0.25; client-002 3.00 / 0.50 / 0.25" in summary

    for seed in range(9):
        write_run(tmp_path / "many" / f"seed{seed}", "static", seed, [0.5, 0.6 + 0.01 * seed])
    page = build_report([tmp_path / "many"], [], tmp_path / "out2").html.read_text()
    summary = page[page.index('<h2 id="summary">'):page.index("<nav>")]
    assert summary.count("<li>") == 1 and "9 run(s), 2 rounds, 3 devices" in summary, summary
    assert "final test accuracy 64.00 % (60.00 % to 68.00 %)" in summary


def test_own_data_figures_are_set_beside_the_test_figure_of_the_model_they_scored(tmp_path) -> None:
    """Round t's own-data figure is the model after round t-1; the final evaluation (``fed_final``) the model
    after the last round: the curves, the device table and the opening pair each with that model's test figure."""
    by = {"client-000": {"acc": 0.9, "loss": 0.3, "count": 10}, "client-001": {"acc": 0.7, "loss": 0.9, "count": 10}}
    final = {"fed_acc": 0.8, "fed_model_round": 2, "fed_by_device": by, "failures": {}}
    write_run(tmp_path / "a", "static", 0, [0.5, 0.75],
              extra=[{"fed_acc": 0.1, "fed_model_round": 0}, {"fed_acc": 0.45, "fed_model_round": 1,
                                                              "fed_final": final}])
    runs = discover([tmp_path / "a"])[0]
    (curve,) = D.federated_curves(runs)
    assert curve["fed"] == [(0, 0.1), (1, 0.45), (2, 0.8)] and curve["test"] == [(1, 0.5), (2, 0.75)]
    rows = D.federated_device_rows(runs)
    assert [(r["device"], r["model_round"], r["acc"], r["test_acc"]) for r in rows] == [
        ("client-001", 2, 0.7, 0.75), ("client-000", 2, 0.9, 0.75)]
    page = build_report([tmp_path / "a"], [], tmp_path / "out").html.read_text()
    assert "federated accuracy 80.00 % of the final model on the devices' own held-out data" in page


def test_markdown_tables_to_html() -> None:
    out = markdown_to_html("## T\n\nsome *text*\n\n| a | b `x` |\n|:---|---:|\n| 1 \\| 2 | **3** |\n\n- item")
    assert "<h4>T</h4>" in out and "<i>text</i>" in out and "<li>item</li>" in out
    assert '<th class="l">a</th><th>b <code>x</code></th>' in out and '<td class="l">1 | 2</td><td><b>3</b></td>' in out
    assert "<script>" not in markdown_to_html("| <script> |\n|---|\n| x |")


def test_report_names_a_folder_without_runs(tmp_path) -> None:
    (tmp_path / "empty").mkdir()
    res = CliRunner().invoke(app, ["report", str(tmp_path / "empty"), "--out", str(tmp_path / "o")])
    assert res.exit_code == 2 and "no metrics.jsonl" in res.output
    res = CliRunner().invoke(app, ["report", str(tmp_path / "empty"), "--profile", str(tmp_path / "nope.json"),
                                   "--out", str(tmp_path / "o")])
    assert res.exit_code == 2


@pytest.mark.slow
def test_report_on_a_real_simulation(tmp_path) -> None:
    """A real (tiny) FedSGA run: the report reads what simulate writes today."""
    run = tmp_path / "run"
    args = ["simulate", "--dataset", "digits", "--clients", "3", "--rounds", "2", "--model", "resnet18_cifar",
            "--width", "0.25", "--strategy", "fedsga", "--seed", "0", "--local-epochs", "1", "--max-batches", "2",
            "--device", "cpu", "--out", str(run)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    rep = build_report([run], [], tmp_path / "out")
    assert rep.errors == []
    assert {"accuracy", "splits", "reliability", "estimator_losses", "tradeoff", "bytes"} <= {p.stem for p in rep.pngs}
    (rel,) = rep.section("reliability").data
    assert len(rel["r"]) == 3  # round 1 calibrates every client
    (m,) = rep.section("splits").data
    assert m["rounds"] == [1, 2] and len(m["clients"]) == 3
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    if any("test_acc_by_split" in r for r in rows):  # newer engines: plotted when present
        assert rep.section("acc_by_split").png is not None
    if any("descriptor_entropy" in c for r in rows for c in r.get("clients", {}).values()):
        assert rep.section("descriptor_entropy").png is not None
