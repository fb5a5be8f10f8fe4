"""One declaration per option: a declared option reaches the CLI, the config, the checks and the benchmark."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import typer
import typer.main
from _bench import load_bench
from typer.testing import CliRunner

from fedsga_edge import config as config_mod
from fedsga_edge.cli import runflags
from fedsga_edge.config import FedSGAConfig, RunConfig, TrainConfig, run_options
from fedsga_edge.options import Opt, check, class_options, opt, override, resolve_args
from fedsga_edge.runbuild import validate_config


def _app() -> typer.Typer:
    """A fresh root command: registering rebuilds the run options from the declarations as they are now."""
    from fedsga_edge.cli import field_cmd, simulate

    app = typer.Typer()
    simulate.register(app)
    field_cmd.register(app)
    return app


def _help(app: typer.Typer, command: str = "simulate") -> str:
    """The help text as one line of words: rich wraps a long help (--strategy lists every registered strategy)
    inside its box at any width, so a phrase may straddle lines."""
    res = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "400", "NO_COLOR": "1", "TERM": "dumb"})
    assert res.exit_code == 0, res.output
    return " ".join(res.output.replace("│", " ").split())


def _params(app: typer.Typer, command: str, args: list[str]) -> dict:
    """The run options' values the command resolves (every layer applied), without running it."""
    params = typer.main.get_command(app).commands[command].make_context(command, list(args)).params
    return {k: v for k, v in params.items() if k in runflags.run_flags()}


# -- a throwaway run option: declaration plus use, nothing else ------------------------------------------------

@pytest.fixture
def throwaway(monkeypatch):
    """RunConfig with one more declared field, installed where the config module and the CLI look it up."""
    extended = dataclasses.make_dataclass(
        "RunConfig", [("throwaway_depth", int, opt(3, "A throwaway option for this test.", ge=1, le=9))],
        bases=(RunConfig,))
    monkeypatch.setattr(config_mod, "RunConfig", extended)
    monkeypatch.setattr(runflags, "RunConfig", extended)
    return extended


def test_a_declared_option_is_a_flag_reaches_the_config_and_is_range_checked(throwaway, tmp_path, monkeypatch) -> None:
    app = _app()
    assert "--throwaway-depth" in _help(app) and "A throwaway option for this test." in _help(app)
    cfg = runflags.run_config(**_params(app, "simulate", ["--throwaway-depth", "5"]))
    assert isinstance(cfg, throwaway) and cfg.throwaway_depth == 5
    assert json.loads(json.dumps(cfg.to_dict()))["throwaway_depth"] == 5  # config.json carries it
    assert runflags.run_config().throwaway_depth == 3  # its declared default
    # the field commands take it too, from the environment and TOML layers as well
    monkeypatch.setenv("FEDSGA_EDGE_THROWAWAY_DEPTH", "7")
    assert _params(app, "coordinator", ["--broker", "mqtt://127.0.0.1:1", "--run-dir", str(tmp_path)])[
        "throwaway_depth"] == 7
    monkeypatch.delenv("FEDSGA_EDGE_THROWAWAY_DEPTH")
    # range-checked, the message naming the flag: in the config and on the command line
    bad = runflags.run_config(throwaway_depth=0)
    assert "--throwaway-depth must lie in [1, 9]" in bad.problems()
    with pytest.raises(ValueError, match=r"--throwaway-depth must lie in \[1, 9\]"):
        validate_config(bad)
    res = CliRunner().invoke(app, ["simulate", "--throwaway-depth", "12", "--quiet", "--out", str(tmp_path)],
                             env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "--throwaway-depth must lie in [1, 9]" in res.output
    assert not (tmp_path / "config.json").exists()  # refused before any work


def test_a_declared_option_is_a_benchmark_override(throwaway) -> None:
    bench = load_bench("accuracy")
    preset = bench.resolve(bench.build_parser().parse_args(["--preset", "smoke", "--throwaway-depth", "4"]))
    runs = bench.plan(preset, "npz:/data/x.npz", "/data")
    assert {r["config"].throwaway_depth for r in runs} == {4}
    assert {(r["config"].dataset, r["config"].data_root) for r in runs} == {("npz:/data/x.npz", "/data")}
    plain = bench.resolve(bench.build_parser().parse_args(["--preset", "smoke"]))
    assert {r["config"].throwaway_depth for r in bench.plan(plain, "digits", None)} == {3}


# -- a strategy's own option ----------------------------------------------------------------------------------

@pytest.fixture
def windowed(monkeypatch):
    """A throwaway strategy with one option, registered for this test only."""
    from fedsga_edge.coordinator import strategy as registry

    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))  # undone after the test
    base = registry.get_strategy("static")

    @registry.register_strategy
    class Windowed(base):  # type: ignore[misc, valid-type]
        name = "test-windowed"
        help = "a throwaway strategy with its own option"
        options = (Opt("window", int, 4, "Rounds in the window (a cited default would go here).", ge=1),)

    return Windowed


def test_a_strategy_declares_its_option_in_its_own_class(windowed, tmp_path) -> None:
    app = _app()
    text = _help(app)
    assert "test-windowed: a throwaway strategy with its own option" in text  # --strategy lists the registry
    assert "--test-windowed-window" in text and "Rounds in the window" in text
    assert "--test-windowed-window" in _help(app, "device")
    cfg = runflags.run_config(**_params(app, "simulate", ["--strategy", "test-windowed", "--test-windowed-window", "6"]))
    assert cfg.strategy_args == {"window": 6}
    validate_config(cfg)
    assert runflags.run_config(strategy="test-windowed").strategy_args == {"window": 4}  # its default, recorded
    assert runflags.run_config(strategy="static").strategy_args == {}  # not another strategy's
    with pytest.raises(typer.BadParameter, match="--test-windowed-window applies to --strategy test-windowed only"):
        runflags.run_config(strategy="static", test_windowed_window=6)
    # FedSGA's own group of run options likewise: not silently ignored under another strategy
    for flag, value in (("deadline_aware", True), ("rho", 0.5), ("no_harmonizer", True)):
        with pytest.raises(typer.BadParameter, match=f"--{flag.replace('_', '-')} applies to --strategy fedsga only"):
            runflags.run_config(strategy="test-windowed", **{flag: value})
        assert runflags.run_config(strategy="fedsga", **{flag: value})
    assert runflags.run_config(strategy="static", rho=0.1).strategy == "static"  # its default value is no choice
    for strategy, flag, value, owner in (("fedavg", "mu", 0.3, "fedprox"), ("static", "speed_sigma", 1.0, "resource")):
        with pytest.raises(typer.BadParameter, match=f"--{flag.replace('_', '-')} applies to --strategy {owner} only"):
            runflags.run_config(strategy=strategy, **{flag: value})
        assert runflags.run_config(strategy=owner, **{flag: value})
    with pytest.raises(ValueError, match="--test-windowed-window must be >= 1"):
        validate_config(dataclasses.replace(cfg, strategy_args={"window": 0}))
    with pytest.raises(ValueError, match="unknown strategy argument 'windw'"):
        validate_config(dataclasses.replace(cfg, strategy_args={"windw": 2}))
    res = CliRunner().invoke(app, ["simulate", "--strategy", "test-windowed", "--test-windowed-window", "0", "--quiet",
                                   "--out", str(tmp_path)], env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "--test-windowed-window must be >= 1" in res.output
    assert resolve_args(class_options(windowed), {}) == {"window": 4}  # what the strategy reads from cfg.strategy_args


# -- the declarations themselves ------------------------------------------------------------------------------

def test_every_flag_keeps_its_spelling_and_maps_to_its_field() -> None:
    by_param = {o.param: o for o in run_options() if o.cli}
    assert by_param["mu"].key == "prox_mu" and by_param["no_adapt"].key == "fedsga.adapt"
    assert by_param["model_arg"].key == "model_args" and by_param["augment"].flags == "--augment/--no-augment"
    assert "proto_dim" not in by_param and not any(o.key == "train.mu" and o.cli for o in run_options())
    cfg = runflags.run_config(strategy="fedsga", no_adapt=True, server_copies="per-client", schedule="round-robin",
                              model_arg=["depth=2", "act=relu"], data_root=None, lr=0.05)
    assert (cfg.fedsga.adapt, cfg.server_copies, cfg.schedule) == (False, "per_client", "round_robin")
    assert runflags.run_config(strategy="fedprox", mu=0.3).prox_mu == 0.3
    assert cfg.model_args == {"depth": 2, "act": "relu"} and cfg.train.lr == 0.05 and cfg.data_root is None
    with pytest.raises(typer.BadParameter, match="--model-arg 'depth' is not KEY=VALUE"):
        runflags.run_config(model_arg=["depth"])
    # the command-line defaults are the config's: an empty command line is the default config
    assert runflags.run_config() == RunConfig()


@pytest.mark.parametrize(("cfg", "message"), [
    (TrainConfig(lr=math.nan), "--lr must be a finite number in (0, 100]"),
    (TrainConfig(batch_size=1), "--batch-size must lie in [2, 8192] (BatchNorm needs two samples)"),
    (TrainConfig(momentum=1.0), "--momentum must lie in [0, 1)"),
    (TrainConfig(max_batches=-1), "--max-batches must lie in [0, 1000000] (0 = all)"),
    (FedSGAConfig(tau_m=0.0), "--tau-a and --tau-m must be finite numbers in (0, 100]"),
    (FedSGAConfig(mu_proto=1.5), "--mu-proto must lie in [0, 1]"),
    (FedSGAConfig(proto_dim=0), "--proto-dim must lie in [1, 4096]"),
    (FedSGAConfig(prompts=10**6), "--prompts must lie in [0, 256]"),  # a coordinator's setting has an upper bound
    (RunConfig(schedule="round-robin"), "--schedule must be one of round-robin, random, sequential (got 'round-robin')"),
    (RunConfig(server_bn_context=True), "--server-bn-context must be an integer >= 0 (got True)"),
    (RunConfig(partition="dirichlet", alpha=0.0), "--alpha must be > 0"),
    (RunConfig(round_timeout=-1.0), "--round-timeout must be >= 0 (0 = no deadline)"),
])
def test_range_messages_name_the_flag(cfg, message) -> None:
    assert message in cfg.problems()
    assert dataclasses.replace(cfg).problems() == cfg.problems()


def test_in_range_values_pass_and_rules_apply_only_where_they_hold() -> None:
    assert RunConfig().problems() == [] and RunConfig(partition="iid", alpha=0.0).problems() == []
    assert RunConfig(server_lr=None).problems() == [] and RunConfig(server_lr=0.0).problems() != []
    o = Opt("k", float, 1.0, ge=0, finite=True)
    assert check(o, 0.0) is None and check(o, math.inf) is not None and "got 'x'" in check(o, "x")


def test_override_replaces_dotted_keys_without_touching_the_original() -> None:
    cfg = RunConfig()
    new = override(cfg, {"fedsga.adapt": False, "train.lr": 0.5, "clients": 3})
    assert (new.fedsga.adapt, new.train.lr, new.clients) == (False, 0.5, 3)
    assert (cfg.fedsga.adapt, cfg.train.lr, cfg.clients) == (True, 0.1, 20)


def test_the_field_commands_build_their_config_from_the_run_flags_when_run(tmp_path) -> None:
    """Not only parsed: run for real, a device gets as far as its broker (typer hands the command more
    keyword arguments than the run options, e.g. ``config_file``; they must not reach the config)."""
    toml = tmp_path / "device.toml"
    toml.write_text("rounds = 2\n")
    res = CliRunner().invoke(_app(), ["device", "--broker", "mqtt://127.0.0.1:1", "--index", "0", "--state-dir",
                                      str(tmp_path / "s"), "--config-file", str(toml), "--strategy", "fedsga",
                                      "--no-adapt"],
                             env={"COLUMNS": "300"})
    assert res.exit_code == 2 and "cannot use broker" in res.output, res.output
