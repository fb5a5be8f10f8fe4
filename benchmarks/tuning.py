"""The tuning budget: every Table 2 method gets the same chance to be tuned, and the choice is made in one place.

Each method's one or two main options (``BUDGET``), five settings a method (one option at five values, or two at
three each varied one at a time), the preset's value among them, each run on the tuning seeds (0 and 1; never a seed
a table reports, which start at 10) under every partition of the preset, with the devices' held-out slice the tables
keep (``--eval-holdout``, 0.2), so a setting is tuned as it is reported. The setting with the best mean score over
those runs is the method's value for that preset: the headline test accuracy, or for a personalised method
(``SCORE``) the accuracy of the models its devices use on their own held-out data, the figure its paper reports.
docs/method.md, "The tuning budget per method", says why and what has been run.

    python benchmarks/tuning.py --preset office-v1 --jobs 2                 # every method's budget, then the choice
    python benchmarks/tuning.py --preset office-v1 --methods fedmut,fedprox --jobs 2
    python benchmarks/tuning.py --preset cifar-v1 --dry-run                 # the settings and how many runs
    python benchmarks/tuning.py --preset office-v1 --tables-only            # the choice from the records there are
    python benchmarks/tuning.py --preset cifar-v1 --partitions dir0.1       # the choice made on one partition

Every setting is one ``benchmarks/accuracy.py`` invocation (same runs, same records, same refusal of a record made
with other settings) into ``benchmarks/records/<preset>/tuning/<method>/<setting>/``, so a killed sweep continues
where it stopped and ``--tables-only`` shows whatever has finished (a method chooses only once every one of its
settings has all its runs: one not yet run might win). The choice of every method (from all the records there, whichever ``--methods`` ran) is printed and
written to ``tuning/tuning.md`` and ``tuning/tuning.json``, which ``accuracy.py --tuned`` applies to a table's runs.

FedAvg's knob is the devices' rate, which every method shares: its budget runs first, and every other method's
settings (a server rate relative to the devices' included) run at the rate it chose; tuning another method
before FedAvg's budget has finished is refused.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import accuracy as A  # noqa: E402  (the benchmark this drives: its presets, plan, records and headline)

TUNING_SEEDS = [0, 1]
REPORTED_FROM = 10  # the tables report seeds 10 and up
# FedAvg's knob, the devices' rate, is every method's (a rate chosen for one method's devices and not another's
# would be a difference of tuning): its budget runs first, and every other method's settings run at its choice.
SHARED = "fedavg"
# The tables' held-out slice of every device's data: tuning runs keep it too, so each device trains on what it
# trains on in the table, and the personalised methods' own-data figure exists to choose by.
TUNING_HOLDOUT = 0.2
# What a method's budget chooses by (fedsga_edge/report/frontier.py's ``SCORES``): the headline test accuracy, or for
# the personalised methods the devices' own held-out data scored on the models they use (FedBABU after its
# fine-tuning, FedGH each device's body under the server's head, FedAS the aligned body under the device's head), as
# their papers score them; their global model is one no device runs.
SCORE: dict[str, str] = {"fedbabu": "own data", "fedgh": "own data", "fedas": "own data"}


def score_of(method: str) -> str:
    return SCORE.get(method, "test")


@dataclass(frozen=True)
class Knob:
    """One main option of a method: its ``accuracy.py`` flag and the settings tried (the preset's value is
    expected among them; ``values`` may depend on the preset's settings, e.g. a rate relative to the devices')."""

    option: str  # the run option's name, as the preset and accuracy.py's parser spell it (``server_lr``)
    values: tuple[Any, ...] | Callable[[dict[str, Any]], tuple[Any, ...]]

    def settings(self, preset: dict[str, Any]) -> tuple[Any, ...]:
        vals = self.values(preset) if callable(self.values) else self.values
        return tuple(round(v, 6) if isinstance(v, float) else v for v in vals)


def _times_devices_rate(*factors: float) -> Callable[[dict[str, Any]], tuple[float, ...]]:
    """Rates relative to the devices' (FedAvg's chosen one once its budget has run)."""
    return lambda s: tuple(float(s["lr"]) * f for f in factors)


# A split method's server rate: from one shared copy's rate at the ``cifar`` preset (x 0.075) to twice a per-client
# copy at the devices' rate; five settings where it is the method's one knob, three where it shares the budget.
SERVER_RATES_5 = _times_devices_rate(0.075, 0.25, 0.5, 1, 2)
SERVER_RATES_3 = _times_devices_rate(0.075, 0.5, 1)

# Every Table 2 method and its main options, five settings a method (the preset's value among them): one option at
# five values, or two at three values each, varied one at a time (the preset's, then two others of each).
# docs/method.md tables the same, with the reasons.
BUDGET: dict[str, tuple[Knob, ...]] = {
    "fedavg": (Knob("lr", _times_devices_rate(0.25, 0.5, 1, 2, 4)),),  # the devices' rate, then every method's
    "fedprox": (Knob("mu", (0.001, 0.003, 0.01, 0.03, 0.1)),),
    "fedbabu": (Knob("fedbabu_finetune_epochs", (1, 2, 5, 10, 20)),),
    "fedgh": (Knob("fedgh_server_lr", (0.001, 0.003, 0.01, 0.03, 0.1)),),
    "fedas": (Knob("fedas_align_lr", (0.001, 0.01, 0.1)), Knob("fedas_align_epochs", (1, 2, 5))),
    "static": (Knob("server_lr", SERVER_RATES_5),),
    "mergesfl": (Knob("server_lr", SERVER_RATES_5),),
    "fedmut": (Knob("fedmut_alpha", (0.5, 1.0, 2.0, 4.0, 8.0)),),
    "musplitfed": (Knob("musplitfed_tau", (1, 2, 4)), Knob("server_lr", SERVER_RATES_3)),
    "multisfl": (Knob("multisfl_replay", (0.01, 0.05, 0.2)),
                 Knob("multisfl_mix", lambda s: (None, 0.25, 0.5))),  # None: the reference's 1 / (branches + 1)
    "fedsga": (Knob("harmonizer_lr", (0.002, 0.015, 0.05)), Knob("harmonizer_form", ("residual", "mlp"))),
}
MAX_SETTINGS = 5  # every method's: the same number of chances to be lucky on the tuning seeds


def _slug(option: str, value: Any) -> str:
    return option.replace("_", "-") + (f"{value:g}" if isinstance(value, float) else str(value))


def settings(method: str, preset: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A method's budget: ``("preset", {})`` first (the preset's values), then each other value of each knob alone,
    as (folder name, {option: value}). The preset's value of a knob need not be among the three (a preset tuned
    elsewhere); then all three are run and the budget says so by its length."""
    if method not in BUDGET:
        raise SystemExit(f"--methods: {method!r} has no tuning budget; methods with one: {', '.join(BUDGET)}")
    out: list[tuple[str, dict[str, Any]]] = [("preset", {})]
    for knob in BUDGET[method]:
        have = preset.get(knob.option)
        for v in knob.settings(preset):
            if v != have and not (isinstance(v, float) and isinstance(have, (int, float)) and np.isclose(v, have)):
                out.append((_slug(knob.option, v), {knob.option: v}))
    return out


def tuning_dir(preset: str, out: Path | None = None) -> Path:
    return (out or A.records_dir(preset)) / "tuning"


def accuracy_argv(preset: str, method: str, values: dict[str, Any], seeds: list[int], folder: Path,
                  passthrough: list[str], shared: dict[str, Any] | None = None) -> list[str]:
    """The ``accuracy.py`` command line of one setting (``shared``: FedAvg's chosen devices' rate, for the others)."""
    argv = ["--preset", preset, "--methods", method, "--seeds", ",".join(map(str, seeds)), "--out", str(folder)]
    for option, v in ((shared or {}) | values).items():
        if v is not None:  # None: the option's own default (MultiSFL's 1 / (branches + 1)), which no flag spells
            argv += ["--" + option.replace("_", "-"), f"{v:g}" if isinstance(v, float) else str(v)]
    return argv + passthrough


@dataclass(frozen=True)
class Sweep:
    """Where and how one invocation's settings run: the preset, tuning seeds, records root, accuracy.py's extra
    flags; a setting's records are read back through accuracy.py's own plan, so a record made with other settings
    (another devices' rate, a changed default) is never counted for it."""

    preset: str
    seeds: list[int]
    root: Path
    passthrough: list[str]
    holdout: float | None = None  # every run's --eval-holdout (None: none)

    def argv(self, method: str, values: dict[str, Any], name: str, shared: dict[str, Any] | None = None) -> list[str]:
        return accuracy_argv(self.preset, method, values, self.seeds, self.root / method / name, self.passthrough,
                             shared)

    def collect(self, method: str, values: dict[str, Any], name: str,
                shared: dict[str, Any] | None = None) -> tuple[dict[str, dict[int, float]], int]:
        """The method's score (``score_of``) of every finished run of one setting, {partition: {seed: accuracy}},
        and how many finished runs there were made with other settings (stale: not counted; the sweep refuses to
        resume over them). A run without the score (no own-data figure) is not counted either."""
        p = A.resolve(A.build_parser().parse_args(self.argv(method, values, name, shared)))
        folder = self.root / method / name
        out: dict[str, dict[int, float]] = {}
        stale = 0
        for r in A.plan(p, A.data_spec(p.data), None):
            f = folder / r["dir"] / "summary.json"
            if not f.exists():
                continue
            if A.record_differs(folder / r["dir"], r["config"]):
                stale += 1
            elif (acc := A.summary_score(json.loads(f.read_text()), score_of(method))) is not None:
                out.setdefault(r["partition"], {})[r["seed"]] = float(acc)
        return out, stale


def has_all_runs(by_part: dict[str, dict[int, float]], partitions: list[str], seeds: list[int]) -> bool:
    """Whether a setting has its score on every (partition, tuning seed)."""
    return all(len(by_part.get(p, {})) == len(seeds) for p in partitions)


def choose(table: dict[str, dict[str, dict[int, float]]], partitions: list[str], seeds: list[int]) -> str | None:
    """The setting with the best mean score over every (partition, tuning seed); only settings with all their
    runs take part (a half-run setting is never chosen over a finished one); ties go to the preset's value."""
    full = {name: [acc for p in partitions for acc in by_part.get(p, {}).values()] for name, by_part in table.items()
            if has_all_runs(by_part, partitions, seeds)}
    if not full:
        return None
    best = max(np.mean(v) for v in full.values())
    ties = [n for n, v in full.items() if np.isclose(np.mean(v), best)]
    return "preset" if "preset" in ties else ties[0]


def shared_choice(sweep: Sweep, preset_values: dict[str, Any], partitions: list[str]) -> dict[str, Any] | None:
    """The devices' rate FedAvg's budget chose, as run options ({} where the preset's value won); None while that
    budget has unfinished runs (no other method can be tuned yet: its settings run at this rate)."""
    budget = settings(SHARED, preset_values)
    table = {name: sweep.collect(SHARED, vals, name)[0] for name, vals in budget}
    if not all(has_all_runs(runs, partitions, sweep.seeds) for runs in table.values()):
        return None  # a rate not yet run might win: every other method's settings would be run at the wrong one
    return dict(budget)[choose(table, partitions, sweep.seeds)]


def report(sweep: Sweep, methods: list[str], partitions: list[str],
           budgets: dict[str, list[tuple[str, dict[str, Any]]]],
           shared: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
    """The tuning table (markdown) and the choice per method (JSON-ready)."""
    preset, seeds = sweep.preset, sweep.seeds
    labels = [A.partition_label(p) for p in partitions]
    rate = ("" if shared is None else "; every method but FedAvg at the devices' rate FedAvg's budget chose ("
            + (", ".join(f"--{k.replace('_', '-')} {v}" for k, v in shared.items()) or "the preset's") + ")")
    holdout = "" if sweep.holdout is None else f", every run with --eval-holdout {sweep.holdout:g}"
    lines = [f"**Tuning at `{preset}`** — each method's score (%) on tuning seeds {','.join(map(str, seeds))}, "
             "mean ± std over the seeds, per partition (test: the headline on the full test set; own data: the "
             "devices' held-out slices on the models they use); mean: over every partition and seed; chosen: the "
             f"best mean, once every setting has all its runs (ties: the preset's value){rate}{holdout}", "",
             "| Method | setting | score | " + " | ".join(labels) + " | mean | runs | chosen |",
             "|---|---|---|" + "---:|" * len(labels) + "---:|---:|---|"]
    choice: dict[str, Any] = {}
    for m in methods:
        at = {} if m == SHARED else shared
        found = {name: sweep.collect(m, vals, name, at) for name, vals in budgets[m]}
        table = {name: runs for name, (runs, _) in found.items()}
        # no choice while a setting has runs to go: the one not yet run might win (``shared_choice``'s rule), and
        # ``accuracy.py --tuned`` refuses a method without a choice by name
        finished = all(has_all_runs(runs, partitions, seeds) for runs in table.values())
        pick = choose(table, partitions, seeds) if finished else None
        values = dict(budgets[m])
        choice[m] = {"chosen": pick, "values": values.get(pick) if pick else None, "score": score_of(m),
                     "settings": {n: {p: table[n].get(p, {}) for p in partitions} for n in table}}
        for name, vals in budgets[m]:
            by_part = table[name]
            cells = [A._ms(list(by_part.get(p, {}).values())) if by_part.get(p) else "—" for p in partitions]
            every = [a for p in partitions for a in by_part.get(p, {}).values()]
            what = "preset's values" if not vals else ", ".join(
                f"{'--' + k.replace('_', '-')} {'default' if v is None else v}" for k, v in vals.items())
            mean = f"{100 * np.mean(every):.2f}" if every else "—"
            stale = found[name][1]
            lines.append(f"| {A.LABELS.get(m, m)} | {what} | {score_of(m)} | " + " | ".join(cells)
                         + f" | {mean} | {len(every)}/{len(seeds) * len(partitions)}"
                         + (f" ({stale} made with other settings)" if stale else "") + " | "
                         + ("**chosen**" if name == pick else "") + " |")
    return "\n".join(lines) + "\n", choice


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(A.PRESETS), required=True)
    ap.add_argument("--methods", default=None, help=f"Comma-separated (default: all): {','.join(BUDGET)}.")
    ap.add_argument("--seeds", default=",".join(map(str, TUNING_SEEDS)),
                    help="Tuning seeds (default 0,1); a seed the preset reports is refused.")
    ap.add_argument("--out", type=Path, default=None, help="Records root (default: benchmarks/records/<preset>); "
                                                           "the settings go under OUT/tuning/.")
    ap.add_argument("--jobs", type=int, default=1, help="Runs at a time (accuracy.py's --jobs).")
    ap.add_argument("--dry-run", action="store_true", help="Print the settings and the number of runs, run nothing.")
    ap.add_argument("--tables-only", action="store_true", help="Run nothing: the choice from the finished runs.")
    ap.add_argument("--data", default=None, help="accuracy.py's --data (e.g. npz:PATH), passed to every run.")
    ap.add_argument("--partitions", default=None,
                    help="Comma-separated, a subset of the preset's (default: all of them): the partitions the choice "
                         "is made on; tuning.json records them, and the choice holds for every column of the table.")
    ap.add_argument("--eval-holdout", type=float, default=TUNING_HOLDOUT,
                    help=f"Every run's held-out slice of each device's data (default {TUNING_HOLDOUT:g}, the tables'); "
                         f"0: none, refused for a method chosen on own data ({', '.join(SCORE)}).")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    p = A.PRESETS[args.preset]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()] if args.methods else list(BUDGET)
    seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if not seeds:
        raise SystemExit("--seeds: give at least one tuning seed")
    if reported := sorted(s for s in seeds if s in p.seeds or s >= REPORTED_FROM):
        raise SystemExit(f"--seeds {reported}: reported seeds (the {args.preset} preset's, or {REPORTED_FROM} and up); "
                         "a value tuned on some seeds is judged on others")
    # before any run: a typo found only after FedAvg's runs would cost hours
    if unknown := [m for m in methods if m not in BUDGET]:
        raise SystemExit(f"--methods: {', '.join(map(repr, unknown))} have no tuning budget; methods with one: "
                         f"{', '.join(BUDGET)}")
    methods.sort(key=lambda m: m != SHARED)  # the devices' rate first: the others' settings run at its choice
    preset_values = p.settings()
    root = tuning_dir(args.preset, args.out)
    partitions = list(p.partitions)
    if args.partitions is not None:
        asked = [x.strip() for x in args.partitions.split(",") if x.strip()]
        if not asked or any(x not in partitions for x in asked):
            raise SystemExit(f"--partitions {args.partitions!r}: the {args.preset} preset's are "
                             f"{','.join(partitions)}; tune on some of them (a choice made on a partition the tables "
                             "do not report would be judged nowhere)")
        partitions = [x for x in partitions if x in asked]
    run = not (args.dry_run or args.tables_only)
    if not 0 <= args.eval_holdout < 1:
        raise SystemExit(f"--eval-holdout {args.eval_holdout:g}: a share of each device's data in [0, 1)")
    if not args.eval_holdout and (own := [m for m in methods if score_of(m) == "own data"]):
        raise SystemExit(f"--eval-holdout 0: {', '.join(own)} are chosen on their devices' held-out data, which a run "
                         "without a held-out slice does not have; leave them out or keep a slice")
    holdout = args.eval_holdout or None
    passthrough = ((["--data", args.data] if args.data else []) + (["--eval-holdout", f"{holdout:g}"] if holdout else [])
                   + (["--partitions", ",".join(partitions)] if partitions != list(p.partitions) else []))
    sweep = Sweep(args.preset, seeds, root, passthrough, holdout)
    print(f"tuning at {args.preset}: {len(methods)} methods (seeds {seeds}, partitions {partitions}) into {root}")
    budgets: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    shared: dict[str, Any] | None = None
    for m in methods:
        if m != SHARED and shared is None:
            shared = shared_choice(sweep, preset_values, partitions)
            if shared is None and run:
                raise SystemExit(f"--methods {m}: FedAvg's budget has unfinished runs, and every other method is tuned "
                                 f"at the devices' rate it chooses: python benchmarks/tuning.py --preset {args.preset} "
                                 f"--methods {SHARED}")
            if shared is None:
                print("  (FedAvg's budget is unfinished: the others below at the preset's devices' rate)")
        at = {} if m == SHARED else (shared or {})
        budgets[m] = settings(m, preset_values | at)
        for name, vals in budgets[m]:
            a = sweep.argv(m, vals, name, at)
            print(f"  {m:<11} {name:<24} python benchmarks/accuracy.py {' '.join(a)}")
            if run:
                A.main(a + ["--jobs", str(args.jobs), "--no-progress"])
    n_runs = sum(len(b) for b in budgets.values()) * len(seeds) * len(partitions)
    print(f"{n_runs} runs in the budget")
    if args.dry_run:
        return {"runs": n_runs, "budgets": budgets}
    # the choice of every method from the records (not only this invocation's): tuning.json is what
    # ``accuracy.py --tuned`` applies, so one file holds the whole preset's choice
    shared = shared_choice(sweep, preset_values, partitions)
    budgets = {m: settings(m, preset_values | ({} if m == SHARED else shared or {})) for m in BUDGET}
    md, choice = report(sweep, list(BUDGET), partitions, budgets, shared)
    root.mkdir(parents=True, exist_ok=True)
    (root / "tuning.md").write_text(md)
    (root / "tuning.json").write_text(json.dumps({"preset": args.preset, "seeds": seeds, "partitions": partitions,
                                                  "eval_holdout": holdout, "shared": shared, "methods": choice},
                                                 indent=1, default=str))
    print(md)
    return {"runs": n_runs, "choice": choice, "shared": shared, "markdown": md}


if __name__ == "__main__":
    main()
