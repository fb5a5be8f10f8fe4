"""``build_report``: load runs and profiles, compute every plot's data, write the PNGs and report.html."""

from __future__ import annotations

import datetime as _dt
import html
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import data as D
from . import plots as P
from .html import Section, markdown_to_html, render_page, table_html
from .runs import Benchmark, Run, RunError, discover, load_profile

__all__ = ["Report", "build_report", "plot_runs"]


@dataclass
class Report:
    html: Path
    pngs: list[Path]
    sections: list[Section]
    runs: list[Run]
    benchmarks: list[Benchmark]
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # plots that failed on unexpected data (the rest is there)

    def section(self, key: str) -> Section:
        return next(s for s in self.sections if s.key == key)


def _first_seed_per_group(runs: list[Run]) -> tuple[list[Run], int]:
    chosen = [g["runs"][0] for g in D.group_runs(runs)]
    return chosen, len(runs) - len(chosen)


def _split_data(runs: list[Run]) -> tuple[list[dict[str, Any]], str | None]:
    adaptive = [r for r in runs if r.adaptive]
    if not adaptive:
        return [], "no adaptive run (strategy fedsga, random or resource) among the runs: every client uses one split."
    shown, hidden = _first_seed_per_group(adaptive)
    mats = [m for r in shown if (m := D.split_matrix(r)) is not None]
    if not mats:
        return [], "the adaptive runs' metrics.jsonl hold no per-client \"splits\"."
    return mats, (f"one run per method and partition is shown (its lowest seed); {hidden} other seed(s) left out."
                  if hidden else None)


def _fmt(x: Any, scale: float = 1.0, digits: int = 2, suffix: str = "") -> str:
    if x is None:
        return "—"
    return f"{x * scale:.{digits}f}{suffix}"


def _summary_table(rows: list[dict[str, Any]]) -> str:
    head = ["run", "method", "partition", "seed", "rounds", "final acc (%)", "client MFLOPs/sample",
            "MB up", "MB down", "wall (s)", "split histogram (k: client-rounds)"]
    body = []
    for r in rows:
        hist = ", ".join(f"{k}: {v}" for k, v in r["split_histogram"].items()) or "—"
        body.append([
            html.escape(r["run"]) + ("" if r["complete"] else " <i>(no summary.json)</i>"),
            html.escape(r["method"]), html.escape(r["partition"] or "—"),
            "—" if r["seed"] is None else str(r["seed"]), str(r["rounds"]),
            _fmt(r["final_acc"], 100), _fmt(r["client_flops_per_sample"], 1e-6),
            _fmt(r["bytes_up"], 1e-6, 1), _fmt(r["bytes_down"], 1e-6, 1), _fmt(r["wall_s"], 1, 1),
            html.escape(hist),
        ])
    return table_html(head, body, ["l", "l", "l"] + [""] * 7 + ["l"], raw=True)


def _profiles_table(profiles: list[tuple[str, dict[str, Any]]]) -> str:
    head = ["file", "device", "machine", "cores", "runtime", "provider", "model", "rows"]
    body = []
    for name, p in profiles:
        d, m = p.get("device") or {}, p.get("model") or {}
        model = " ".join(str(x) for x in (m.get("arch"), f"width {m['width']}" if m.get("width") else None) if x)
        body.append([name, str(d.get("cpu", "?")), str(d.get("machine", "?")), str(d.get("cores_logical", "?")),
                     str(d.get("runtime", "?")), str(d.get("execution_provider", "")), model,
                     str(len(p.get("results", [])))])
    return table_html(head, body, ["l"] * 7 + [""])


def _plot_section(sec: Section, out: Path, compute: Callable[[], Any], draw: Callable[[Any], Any],
                  empty_note: str, errors: list[str]) -> Section:
    try:
        data = compute()
        note = None
        if isinstance(data, tuple):  # (data, note)
            data, note = data
        sec.data = data
        if not data:
            sec.note = note or empty_note
            return sec
        P.save(draw(data), out / f"{sec.key}.png")
        sec.png = out / f"{sec.key}.png"
        sec.note = note
    except Exception as exc:  # noqa: BLE001 - one odd run must not cost the whole report
        errors.append(f"{sec.key}: {type(exc).__name__}: {exc}")
        sec.note = f"this plot failed: {html.escape(type(exc).__name__)}: {html.escape(str(exc))}"
    return sec


def build_report(inputs: Sequence[Path], profiles: Sequence[Path] = (), out: Path = Path("report"),
                 band: str = "minmax", command: str | None = None) -> Report:
    """Write ``out/report.html`` (self-contained) and one PNG per plot; returns what was written.

    Raises RunError when an input holds no run, or a profile is not a profile report.
    """
    runs, benches, notes = discover([Path(p) for p in inputs]) if inputs else ([], [], [])
    profs = [(Path(p).stem, load_profile(Path(p))) for p in profiles]
    if not runs and not profs:
        raise RunError("no runs and no profiles to report on")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    no_runs = "no runs given."

    def accuracy():
        curves = D.accuracy_curves(runs)
        sub = [c["label"] for c in curves if c["subset"]]
        which = "every run" if len(sub) == len(curves) else ", ".join(html.escape(x) for x in sub)
        note = (f"intermediate rounds of {which} are the benchmark's test-subset evaluations "
                "(<code>test_acc_subset</code>); the last round is the full test set.") if sub else None
        return curves, note

    sections = [
        _plot_section(Section("accuracy", "Test accuracy per round",
                              "One line per method and partition: the mean over seeds (bold), each seed (thin) and "
                              + ("±1 std" if band == "std" else "the min-max range") + " over seeds (band)."),
                      out, accuracy, lambda d: P.plot_accuracy(d, band=band),
                      "no run has <code>test_acc</code> in metrics.jsonl." if runs else no_runs, errors),
        _plot_section(Section("splits", "Split depth per device and round",
                              "For adaptive runs (fedsga, random, resource): the split index k each client trained "
                              "with in each round (0 = whole model on the device; grey = no update that round)."),
                      out, lambda: _split_data(runs), P.plot_split_depths, no_runs, errors),
        _plot_section(Section("reliability", "Estimator reliability",
                              "Each client's predicted sufficiency r on a calibration round (the estimate its split "
                              "came from, made at the start of the round) against the label s measured in that "
                              "round, binned; the Brier score is mean (r - s)². A calibrated estimator follows the "
                              "diagonal. (Runs written while the device still computed r after the probe's refit "
                              "show the estimator's fit to its own labels, not a prediction.)"),
                      out, lambda: D.reliability(runs), P.plot_reliability,
                      "no client record holds both r and s (no FedSGA run with the estimator on, "
                      "or no calibration round)."
                      if runs else no_runs, errors),
        _plot_section(Section("estimator_losses", "Probe losses L1 and Lref",
                              "On calibration rounds: the server's loss from the shallowest split p_1 over the loss "
                              "from p_ref (left; s = 1 below 1 + beta) and both losses (right)."),
                      out, lambda: D.estimator_losses(runs), P.plot_estimator_losses,
                      "no client record holds L1 and Lref (no calibration round in these runs)." if runs else no_runs,
                      errors),
        _plot_section(Section("tradeoff", "Accuracy against client cost",
                              "Final test accuracy against the mean client FLOPs per training sample (forward and "
                              "backward of the client's prefix), one point per method; error bars span the "
                              "seeds (±1 std)."),
                      out, lambda: D.tradeoff_points(runs), P.plot_tradeoff,
                      "no run has a final accuracy and client FLOPs/sample." if runs else no_runs, errors),
        _plot_section(Section("bytes", "Bytes on the wire per round",
                              "Bytes sent up (activations, updates) and down (weights, gradients) per round, mean over "
                              "seeds with the min-max band."),
                      out, lambda: D.bytes_curves(runs), P.plot_bytes,
                      "no run has <code>bytes_up</code>/<code>bytes_down</code>." if runs else no_runs, errors),
        _plot_section(Section("latency", "Latency per split depth on devices",
                              "From <code>fedsga-edge profile --json</code> reports: the prefix's p50 latency per "
                              "split index, the whisker reaching p90; one line per device and runtime, a panel per "
                              "batch size.", extra_html=_profiles_table(profs) if profs else ""),
                      out, lambda: D.latency_curves(profs), P.plot_latency,
                      "no profile given (<code>--profile P.json</code>, written by "
                      "<code>fedsga-edge profile --json</code>)."
                      if not profs else "the profiles hold no latency rows.", errors),
        _plot_section(Section("acc_by_split", "Accuracy per depth embedding",
                              "Final-round test accuracy with the embedding of each split depth "
                              "(<code>test_acc_by_split</code>), mean over seeds."),
                      out, lambda: D.acc_by_split(runs), P.plot_acc_by_split,
                      "these runs' metrics.jsonl hold no <code>test_acc_by_split</code> (written by newer versions)."
                      if runs else no_runs, errors),
        _plot_section(Section("descriptor_entropy", "Descriptor entropy",
                              "Per round, the clients' mean <code>descriptor_entropy</code>, mean over seeds."),
                      out, lambda: D.descriptor_entropy(runs), P.plot_descriptor_entropy,
                      "these runs' client records hold no <code>descriptor_entropy</code> (written by newer versions)."
                      if runs else no_runs, errors),
    ]

    tail = ['<h2 id="runs">Runs</h2>']
    if runs:
        tail.append("<p>One row per run. Bytes and wall time are the run's totals; the split histogram counts "
                    "client-rounds at each split index.</p>")
        tail.append(_summary_table(D.summary_rows(runs)))
    else:
        tail.append('<p class="note">no runs given.</p>')
    for b in benches:
        tail.append(f"<h2>Benchmark tables: {html.escape(str(b.path))}</h2>")
        if b.command:
            tail.append(f"<p class=\"meta\">command: <code>{html.escape(b.command)}</code></p>")
        tail.append(markdown_to_html(b.tables_markdown) if b.tables_markdown
                    else '<p class="note">results.json holds no tables.</p>')
    if notes or errors:
        tail.append("<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in notes + errors) + "</ul>")

    meta = [f"{len(runs)} run(s) from {', '.join(html.escape(str(p)) for p in inputs) or '—'}"
            + (f"; {len(profs)} profile(s)" if profs else ""),
            f"written {_dt.datetime.now().isoformat(timespec='seconds')}"
            + (f" by <code>{html.escape(command)}</code>" if command else "")]
    page = render_page("fedsga-edge report", meta, sections, "\n".join(tail))
    path = out / "report.html"
    path.write_text(page, encoding="utf-8")
    return Report(html=path, pngs=[s.png for s in sections if s.png is not None], sections=sections, runs=runs,
                  benchmarks=benches, notes=notes, errors=errors)


def plot_runs(paths: Sequence[Path], out: Path, group: bool = False) -> Path:
    """``fedsga-edge plot``: the report's accuracy plot and split-depth heatmaps in one PNG.

    Each path is a run folder (or a folder of runs); without ``group`` every run is its own line.
    """
    runs, _, _ = discover([Path(p) for p in paths])
    curves = D.accuracy_curves(runs, by_run=not group)
    mats = [m for r in runs if (m := D.split_matrix(r)) is not None]
    plt = P._plt()
    heights = [3.2] + [max(1.4, 0.22 * len(m["clients"]) + 1.0) for m in mats]
    fig, axes = plt.subplots(len(heights), 1, figsize=(8, sum(heights) + 0.4), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    P.plot_accuracy(curves, ax=axes[0][0], by_position=not group)
    if mats:
        P.plot_split_depths(mats, axes=[a[0] for a in axes[1:]])
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    P.save(fig, out)
    return out
