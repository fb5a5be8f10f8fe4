"""Tests that follow the strategy registry: every registered strategy runs a round in ``simulate`` and
in a field run (coordinator service + device agents), and a throwaway strategy defined here reaches
``simulate --help``, the accuracy benchmark and the report with no other edit."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator

import pytest
import typer
from _bench import load_bench
from _runs import loopback_field_run, tiny_config
from typer.testing import CliRunner

from fedsga_edge.coordinator import strategy as registry
from fedsga_edge.coordinator.strategy import Method, Strategy, list_strategies, register_strategy, unregister_strategy
from fedsga_edge.options import Opt
from fedsga_edge.simulation import run_simulation

WAIT = 240


@pytest.mark.parametrize("name", list_strategies())
def test_every_registered_strategy_runs_a_round_in_simulate(name, digits, tmp_path) -> None:
    summary = run_simulation(tiny_config(name, clients=2, rounds=1, max_batches=2), tmp_path, bundle=digits)
    config = json.loads((tmp_path / "config.json").read_text())
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert summary["rounds"] == 1 and summary["failures"] == 0
    assert sorted(records[0]["splits"]) == ["client-000", "client-001"]  # both devices' updates arrived
    assert config["method"]["name"] in registry.all_methods() and config["method"]["label"]
    _assert_server_work(records[0])
    assert summary["server_steps"] == records[0]["server_steps"]


def _assert_server_work(rec: dict) -> None:
    """Every record has the round's server work; a device trained at a split: the server stepped on it."""
    steps, flops = rec["server_steps"], rec["server_flops"]
    assert isinstance(steps, int) and isinstance(flops, int) and (steps > 0) == (flops > 0)
    assert steps > 0 or all(k == 0 for k in rec["splits"].values())


@pytest.mark.parametrize("name", list_strategies())
def test_every_registered_strategy_runs_a_round_in_the_field_service(name, digits, tmp_path) -> None:
    """The coordinator service and two device agents (real time, loopback transport): all devices finish."""
    cfg = tiny_config(name, clients=2, rounds=1, max_batches=2)
    cfg.round_timeout = 120.0
    with loopback_field_run(cfg, digits, tmp_path) as service:
        service.wait(WAIT)
    (rec,) = service.records
    assert rec["failures"] == {} and sorted(rec["splits"]) == ["client-000", "client-001"]
    _assert_server_work(rec)  # a field run's records count it where simulate's do


# -- a throwaway strategy: one class and its registration, nothing else ----------------------------
class Shallowest(Strategy):
    """Every device at p_1, its update counted once whatever its data size."""

    name = "shallowest-test"
    help = "throwaway test strategy: everyone at p_1, equal weights"
    label = "Shallowest (test)"
    options = (Opt("weight", float, 1.0, "Every device's aggregation weight.", gt=0, finite=True),)

    @classmethod
    def methods(cls) -> dict[str, Method]:
        return {cls.name: Method(cls.label, default=False)}

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: 1 for c in clients}

    def weight(self, num_samples: int) -> float:
        return self.args["weight"]


@pytest.fixture
def throwaway() -> Iterator[type[Strategy]]:
    """The strategy registered for one test; benchmark modules imported meanwhile (their method lists are read
    from the registry at import) are dropped with it, so a later test in this process never sees it."""
    cached = {k for k in sys.modules if k.endswith("_bench")}
    register_strategy(Shallowest)
    try:
        yield Shallowest
    finally:
        unregister_strategy(Shallowest.name)
        for key in [k for k in sys.modules if k.endswith("_bench") and k not in cached]:
            del sys.modules[key]


def test_a_new_strategy_appears_in_help_benchmark_and_report(throwaway, digits, tmp_path) -> None:
    from fedsga_edge.cli import simulate

    app = typer.Typer()
    simulate.register(app)  # the command's options are built from the registry as it is now
    res = CliRunner().invoke(app, ["simulate", "--help"], env={"COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"})
    assert res.exit_code == 0 and "shallowest-test" in res.output and "everyone at p_1" in res.output
    assert "--shallowest-test-weight" in res.output  # its own option, declared in its class

    bench = load_bench("accuracy")
    methods = registry.all_methods()
    assert methods["shallowest-test"] == ("shallowest-test", Shallowest.methods()["shallowest-test"])
    cfg = bench.make_config(bench.PRESETS["cpu"], "shallowest-test", "iid", 3, 1, "digits", None)
    assert cfg.strategy == "shallowest-test" and cfg.seed == 3

    run = tmp_path / "runs" / "shallowest"
    cfg = tiny_config("shallowest-test", clients=2, rounds=1, max_batches=2, strategy_args={"weight": 2.5})
    summary = run_simulation(cfg, run, bundle=digits)
    assert summary["split_histogram"] == {"1": 2}  # the strategy's own assignment reached the devices
    assert json.loads((run / "config.json").read_text())["strategy_args"] == {"weight": 2.5}
    from fedsga_edge.coordinator import create_strategy

    assert create_strategy(cfg, 3, ["a"], {}).weight(100) == 2.5  # the strategy reads its own option
    from fedsga_edge.report import build_report

    report = build_report([run], out=tmp_path / "report")
    html = (tmp_path / "report" / "report.html").read_text()
    assert report is not None and "shallowest-test" in html


@pytest.mark.parametrize("name, bad, message", [
    ("static", dict(split=7), "--split must be in 1..3"),
    ("musplitfed", dict(split=0), "--split must be in 1..3"),
    ("mergesfl", dict(server_copies="per_client"), "MergeSFL merges into the one shared server copy"),
    ("mix", dict(strategy_args={"cuts": "1,7"}), "--mix-cuts: cut 7 is outside 1..3"),
    ("phased", dict(strategy_args={"cuts": "ref:5,7"}), "--phased-cuts: cut 7 is outside 1..3"),
])
def test_a_config_the_strategy_cannot_run_is_refused_before_the_cost_table(name, bad, message, digits, tmp_path,
                                                                           monkeypatch) -> None:
    """``Strategy.check_config`` runs once the model is built and before its cost table (seconds at width 1.0):
    a bad --split is an error at once, not after the slow part."""
    import fedsga_edge.models as models

    def measured(*a, **k):
        raise AssertionError("the cost table was measured before the config was checked")

    monkeypatch.setattr(models, "CostTable", measured)
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        run_simulation(tiny_config(name, clients=2, rounds=1, **bad), tmp_path, bundle=digits)


# -- options a strategy declares it never reads --------------------------------------------------------
# Two settings of the server side that differ in every option (server_bn_context needs the shared copy)
_SERVER_A = {"server_copies": "per_client", "server_bn": "round", "server_lr": 0.7, "server_bn_context": 0,
             "server_steps": 2}
_SERVER_B = {"server_copies": "shared", "server_bn": "ema", "server_lr": None, "server_bn_context": 2,
             "server_steps": 1}


def _ignoring() -> list[str]:
    return [n for n in list_strategies() if registry.get_strategy(n).ignores_options]


def test_whole_model_strategies_declare_the_server_side_unread() -> None:
    assert {"fedavg", "fedprox", "fedbabu", "fedgh", "fedas", "fedmut"} <= set(_ignoring())
    assert not {"static", "fedsga", "random", "mergesfl"} & set(_ignoring())


@pytest.mark.parametrize("name", _ignoring())
def test_an_ignored_option_changes_nothing_the_run_trains(name: str, digits) -> None:
    """The declaration lets the benchmark table a record made under other values of these options as the
    plan's run (benchmarks/accuracy.py, record_differs); so the ignored options, each set two ways, must leave
    the run bit-identical: its losses, accuracies and final weights."""
    import torch

    from fedsga_edge.simulation import Simulation

    def run(server: dict[str, object]) -> tuple[list[tuple[object, ...]], dict[str, torch.Tensor]]:
        kw = {k: v for k, v in server.items() if k in ignored}
        sim = Simulation(tiny_config(name, clients=2, rounds=2, max_batches=1, eval_every=2, **kw), digits)
        recs = [(r["train_loss"], r.get("test_acc"), r.get("test_loss")) for r in sim.rounds()]
        return recs, {k: v.clone() for k, v in sim.model.state_dict().items()}

    ignored = registry.get_strategy(name).ignores_options
    assert set(ignored) <= set(_SERVER_A), f"{name}: give the test two values of {ignored}"
    (recs_a, state_a), (recs_b, state_b) = run(_SERVER_A), run(_SERVER_B)
    assert recs_a == recs_b, name
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a), name


def test_a_read_option_is_caught_by_the_same_check(digits) -> None:
    """The check above can fail: static reads the server side, and its losses move with it."""
    from fedsga_edge.simulation import Simulation

    def losses(server: dict[str, object]) -> list[float]:
        cfg = tiny_config("static", clients=2, rounds=2, max_batches=1, **server)
        return [r["train_loss"] for r in Simulation(cfg, digits).rounds()]

    assert losses(_SERVER_A) != losses(_SERVER_B)
