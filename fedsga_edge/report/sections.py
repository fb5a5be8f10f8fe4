"""The report's plot sections, in page order: each one's title, caption, data, drawing and empty note.

One entry per plot, so a new plot is one function plus its line in ``plots``; ``build`` only runs them.
"""

from __future__ import annotations

import html
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import data as D
from . import frontier as F
from . import plots as P
from .html import Section, table_html
from .runs import Run

__all__ = ["Inputs", "Plot", "plots"]

NO_RUNS = "no runs given."

Profiles = list[tuple[str, dict[str, Any]]]


@dataclass(frozen=True)
class Inputs:
    """What every section reads: the runs, the device profiles (file stem, report) and the band style."""

    runs: list[Run]
    profs: Profiles
    band: str
    target_acc: float | None = None  # time to accuracy's target (None: the lowest final accuracy compared)


@dataclass(frozen=True)
class Plot:
    """One section to fill: ``compute`` returns its data or (data, note); ``draw`` turns data into a figure.

    ``absent``: the short name of what it shows and what records it, for the page's last line when the runs
    hold nothing for it ("not in these runs: ..."); empty: the section's title."""

    section: Section
    compute: Callable[[], Any]
    draw: Callable[[Any], Any]
    empty_note: str
    absent: str = ""


def plots(i: Inputs) -> list[Plot]:
    """Every plot section of the report, in page order."""
    return [accuracy(i), time_to_accuracy(i), timeline(i), federated(i), splits(i), reliability(i), estimator_losses(i), tradeoff(i), frontier(i),
            wire_bytes(i),
            latency(i), acc_by_split(i), descriptor_entropy(i)]


def _if_runs(i: Inputs, note: str) -> str:
    return note if i.runs else NO_RUNS


def accuracy(i: Inputs) -> Plot:
    band = "±1 std" if i.band == "std" else "the min-max range"
    return Plot(Section("accuracy", "Test accuracy per round",
                        "One line per method and partition: the mean over seeds (bold), each seed (thin) and "
                        + band + " over seeds (band)."),
                lambda: _accuracy_data(i.runs), lambda d: P.plot_accuracy(d, band=i.band),
                _if_runs(i, "no run has <code>test_acc</code> in metrics.jsonl."), "test accuracy")


def _accuracy_data(runs: list[Run]) -> tuple[list[dict[str, Any]], str | None]:
    """The curves, and a note when intermediate rounds are the benchmark's subset evaluations."""
    curves = D.accuracy_curves(runs)
    sub = [c["label"] for c in curves if c["subset"]]
    which = "every run" if len(sub) == len(curves) else ", ".join(html.escape(x) for x in sub)
    note = (f"intermediate rounds of {which} are the benchmark's test-subset evaluations "
            "(<code>test_acc_subset</code>); the last round is the full test set.") if sub else None
    return curves, note


def time_to_accuracy(i: Inputs) -> Plot:
    curves = D.time_to_accuracy_curves(i.runs)
    return Plot(Section("time_to_accuracy", "Time to accuracy on the fleet",
                        "Runs on a fleet (<code>simulate --fleet</code>: virtual seconds; <code>trial --fleet</code>: "
                        "measured seconds): test accuracy against the fleet's cumulative seconds "
                        "(<code>fleet_s</code> summed over the rounds so far), one line per method as in the plot "
                        "above; the table gives the seconds until each method first reached the target.",
                        extra_html=_target_table(curves, i.target_acc)),
                lambda: curves, lambda d: P.plot_accuracy(d, band=i.band, x="seconds"),
                _if_runs(i, "no run has <code>fleet_s</code> in metrics.jsonl (run with <code>--fleet</code>)."),
                "time to accuracy on a fleet (<code>--fleet</code>)")


def _target_table(curves: list[dict[str, Any]], target_acc: float | None) -> str:
    target, rows = D.seconds_to_target(curves, target_acc)
    if not rows:
        return ""

    def num(x: Any, fmt: str) -> str:
        return "—" if x is None else format(x, fmt)

    how = "given" if target_acc is not None else "the lowest final accuracy among the methods"
    head = ["method", f"seconds to {100 * target:.2f} %", "rounds to it", "seeds reaching it", "final acc (%)",
            "seconds in all"]
    body = [[r["label"], num(r["seconds"], ".2f"), num(r["rounds"], ".1f"), f"{r['reached']}/{r['n']}",
             num(100 * r["final_acc"], ".2f"), num(r["total_s"], ".2f")] for r in rows]
    return (f"<p>Target accuracy {100 * target:.2f} % ({how}; <code>--target-acc</code> sets it); seconds and "
            "rounds: the mean over the seeds that reached it.</p>" + table_html(head, body, ["l"] + [""] * 5))


def timeline(i: Inputs) -> Plot:
    return Plot(Section("timeline", "Round timeline per device",
                        "Runs on a fleet, from each round's per-device <code>timing</code>: for the first and the "
                        "last round, one bar per device, its seconds computing, on its link (bytes over rate plus "
                        "delay) and waiting, end to end (each a total over the round: in the round they "
                        "interleave). Waiting is cut where the device was done (tick): before it, waiting for the "
                        "server's replies; after it, for the round's last device, named in the title (the one "
                        "the others waited for). The dashed line is the round's end (<code>fleet_s</code>). One "
                        "run per method and partition (its lowest seed)."),
                lambda: D.fleet_timelines(i.runs), P.plot_timeline,
                _if_runs(i, "no run has per-device <code>timing</code> in metrics.jsonl (run with "
                            "<code>--fleet</code>)."), "fleet timing (<code>--fleet</code>)")


def splits(i: Inputs) -> Plot:
    return Plot(Section("splits", "Split depth per device and round",
                        "For adaptive runs (fedsga, random, resource): the split index k each client trained "
                        "with in each round (0 = whole model on the device; grey = no update that round)."),
                lambda: _split_data(i.runs), P.plot_split_depths, NO_RUNS,
                "split depths (an adaptive <code>--strategy</code>: fedsga, random, resource)")


def _first_seed_per_group(runs: list[Run]) -> tuple[list[Run], int]:
    chosen = [g["runs"][0] for g in D.group_runs(runs)]
    return chosen, len(runs) - len(chosen)


def _split_data(runs: list[Run]) -> tuple[list[dict[str, Any]], str | None]:
    """One heatmap per method and partition (its lowest seed): more would bury the page."""
    adaptive = [r for r in runs if r.adaptive]
    if not adaptive:
        return [], "no adaptive run (strategy fedsga, random or resource) among the runs: every client uses one split."
    shown, hidden = _first_seed_per_group(adaptive)
    mats = [m for r in shown if (m := D.split_matrix(r)) is not None]
    if not mats:
        return [], "the adaptive runs' metrics.jsonl hold no per-client \"splits\"."
    return mats, (f"one run per method and partition is shown (its lowest seed); {hidden} other seed(s) left out."
                  if hidden else None)


def reliability(i: Inputs) -> Plot:
    return Plot(Section("reliability", "Estimator reliability",
                        "Each client's predicted sufficiency r on a calibration round (the estimate its split "
                        "came from, made at the start of the round) against the label s measured in that "
                        "round, binned; the Brier score is mean (r - s)². A calibrated estimator follows the "
                        "diagonal. (Runs written while the device still computed r after the probe's refit "
                        "show the estimator's fit to its own labels, not a prediction.)"),
                lambda: D.reliability(i.runs), P.plot_reliability,
                _if_runs(i, "no client record holds both r and s (no FedSGA run with the estimator on, "
                            "or no calibration round)."), "estimator reliability (<code>--strategy fedsga</code>)")


def estimator_losses(i: Inputs) -> Plot:
    return Plot(Section("estimator_losses", "Probe losses L1 and Lref",
                        "On calibration rounds: the server's loss from the shallowest split p_1 over the loss "
                        "from p_ref (left; s = 1 below 1 + beta) and both losses (right)."),
                lambda: D.estimator_losses(i.runs), P.plot_estimator_losses,
                _if_runs(i, "no client record holds L1 and Lref (no calibration round in these runs)."),
                "probe losses (<code>--strategy fedsga</code>)")


def tradeoff(i: Inputs) -> Plot:
    return Plot(Section("tradeoff", "Accuracy against client cost",
                        "Final test accuracy against the mean client FLOPs per training sample (forward and "
                        "backward of the client's prefix), one point per method; error bars span the "
                        "seeds (±1 std)."),
                lambda: D.tradeoff_points(i.runs), P.plot_tradeoff,
                _if_runs(i, "no run has a final accuracy and client FLOPs/sample."), "accuracy against client cost")


def frontier(i: Inputs) -> Plot:
    groups = F.frontier_groups(i.runs)
    return Plot(Section("frontier", "Adaptive splits against the static frontier",
                        "Runs at two or more fixed cuts (<code>--strategy static</code>, e.g. the benchmark's static-p1, "
                        "static and static-pK) beside adaptive ones: the line is the best accuracy any fixed cut or mix "
                        "of cuts reaches at no more client FLOPs (the upper envelope of the cuts' seed means; a "
                        "dominated cut does not shape it), and each adaptive method's legend entry, like the table, "
                        "gives its distance to that frontier at its own client FLOPs, paired by seed (each seed's "
                        "frontier from its own cuts), mean ± standard error in points. Accuracy: the benchmark's "
                        "headline where recorded, else the final round's; where the runs scored the devices' "
                        "held-out data (<code>--eval-holdout</code>), a second panel per partition draws the frontier on that "
                        "(\"own data\"): the final model, each device scoring the model it runs.",
                        extra_html=_frontier_table(groups)),
                lambda: groups, P.plot_frontier,
                _if_runs(i, "no partition has runs at two fixed cuts and an adaptive run with summary.json."),
                "the static frontier (static at two or more splits and an adaptive strategy)")


def _frontier_table(groups: list[dict[str, Any]]) -> str:
    if not groups:
        return ""
    head = ["partition", "method", "client MFLOPs/sample", "accuracy (%)", "Δ frontier (points)", "above it", "seeds"]
    body = []
    for g in groups:
        for c in g["cuts"]:
            body.append([g["partition"], c["method"], f"{c['flops'] / 1e6:.2f}", f"{100 * c['acc']:.2f}", "fixed cut",
                         "", str(c["n"])])
        for m in g["methods"]:
            d = m["delta"] or {}
            gap = "—" if d.get("mean") is None else f"{100 * d['mean']:+.2f}" + (
                f" ± {100 * d['se']:.2f}" if d.get("se") is not None else "")
            body.append([g["partition"], m["method"], f"{m['flops'] / 1e6:.2f}", f"{100 * m['acc']:.2f}", gap,
                         f"{d.get('wins', 0)}/{d.get('n', 0)}", str(m["n"])])
    return table_html(head, body, ["l", "l"] + [""] * 5)


def wire_bytes(i: Inputs) -> Plot:
    return Plot(Section("bytes", "Bytes on the wire per round",
                        "Bytes sent up (activations, updates) and down (weights, gradients) per round, mean over "
                        "seeds with the min-max band."),
                lambda: D.bytes_curves(i.runs), P.plot_bytes,
                _if_runs(i, "no run has <code>bytes_up</code>/<code>bytes_down</code>."), "bytes on the wire")


def latency(i: Inputs) -> Plot:
    return Plot(Section("latency", "Latency per split depth on devices",
                        "From <code>fedsga-edge profile --json</code> reports: the prefix's p50 latency per "
                        "split index, the whisker reaching p90; one line per device and runtime, a panel per "
                        "batch size.", extra_html=_profiles_table(i.profs) if i.profs else ""),
                lambda: D.latency_curves(i.profs), P.plot_latency,
                "no profile given (<code>--profile P.json</code>, written by "
                "<code>fedsga-edge profile --json</code>)."
                if not i.profs else "the profiles hold no latency rows.",
                "latency per split depth (<code>--profile</code> from <code>fedsga-edge profile --json</code>)")


def _profiles_table(profiles: Profiles) -> str:
    """Which device, runtime and model each profile measured, so latency lines can be told apart."""
    head = ["file", "device", "machine", "cores", "runtime", "provider", "model", "rows"]
    body = []
    for name, p in profiles:
        d, m = p.get("device") or {}, p.get("model") or {}
        model = " ".join(str(x) for x in (m.get("arch"), f"width {m['width']}" if m.get("width") else None) if x)
        body.append([name, str(d.get("cpu", "?")), str(d.get("machine", "?")), str(d.get("cores_logical", "?")),
                     str(d.get("runtime", "?")), str(d.get("execution_provider", "")), model,
                     str(len(p.get("results", [])))])
    return table_html(head, body, ["l"] * 7 + [""])


def acc_by_split(i: Inputs) -> Plot:
    return Plot(Section("acc_by_split", "Accuracy per depth embedding",
                        "Final-round test accuracy with the embedding of each split depth "
                        "(<code>test_acc_by_split</code>), mean over seeds."),
                lambda: D.acc_by_split(i.runs), P.plot_acc_by_split,
                _if_runs(i, "these runs' metrics.jsonl hold no <code>test_acc_by_split</code> "
                            "(written by newer versions)."),
                "accuracy per depth embedding (<code>test_acc_by_split</code>)")


def descriptor_entropy(i: Inputs) -> Plot:
    return Plot(Section("descriptor_entropy", "Descriptor entropy",
                        "Per round, the clients' mean <code>descriptor_entropy</code>, mean over seeds."),
                lambda: D.descriptor_entropy(i.runs), P.plot_descriptor_entropy,
                _if_runs(i, "these runs' client records hold no <code>descriptor_entropy</code> "
                            "(written by newer versions)."), "descriptor entropy (<code>--strategy fedsga</code>)")


def federated(i: Inputs) -> Plot:
    return Plot(Section("federated", "Federated accuracy on the devices' own data",
                        "Runs with <code>--eval-holdout</code>: each device evaluates the global model on a "
                        "held-out slice of its own data (<code>fed_acc</code>, weighted by each device's count) "
                        "beside the coordinator's test accuracy of the same model, when it has a test set: a "
                        "round's figure is of the model it started from (<code>fed_model_round</code>), the final "
                        "evaluation's of the model the run ended with (<code>fed_final</code>); thin "
                        "lines are the devices, the table their last figures, worst first (FedBABU runs add each "
                        "device's figure after fine-tuning a copy of the head on its own data, "
                        "<code>fed_acc_finetuned</code>).",
                        extra_html=_federated_table(i.runs)),
                lambda: D.federated_curves(i.runs), P.plot_federated,
                _if_runs(i, "no run has <code>fed_acc</code> in metrics.jsonl (run with <code>--eval-holdout</code>)."),
                "federated accuracy (<code>--eval-holdout</code>)")


def _federated_table(runs: list[Run]) -> str:
    rows = D.federated_device_rows(runs)
    if not rows:
        return ""

    def pct(x: Any) -> str:
        return "—" if x is None else f"{100 * x:.2f}"

    head = ["run", "model after round", "device", "accuracy (%)", "loss", "samples", "federated (%)", "test (%)"]
    body = [[r["run"], str(r["model_round"]), r["device"], pct(r["acc"]),
             "—" if r["loss"] is None else f"{r['loss']:.3f}", str(r["count"]), pct(r["fed_acc"]), pct(r["test_acc"])]
            for r in rows]
    if any(r.get("acc_finetuned") is not None for r in rows):  # FedBABU runs: the fine-tuned heads' figures too
        head += ["fine-tuned (%)", "federated fine-tuned (%)"]
        for line, r in zip(body, rows):
            line += [pct(r.get("acc_finetuned")), pct(r.get("fed_acc_finetuned"))]
    return table_html(head, body, ["l", "", "l"] + [""] * (len(head) - 3))
