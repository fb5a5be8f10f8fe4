"""``build_report``: load runs and profiles, compute every plot's data, write the PNGs and report.html."""

from __future__ import annotations

import datetime as _dt
import html
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import data as D
from . import plots as P
from .html import Section, markdown_to_html, render_page, table_html
from .runs import Benchmark, Run, RunError, discover, load_profile
from .sections import Inputs, Plot, Profiles, plots

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


def _mb(x: float | None) -> str:
    return "—" if x is None else f"{x / 1e6:.2f} MB"


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{100 * x:.2f} %"


def _run_line(o: dict[str, Any]) -> str:
    """One run in a sentence: what ran, on how many devices for how many rounds, and what came of it."""
    who = " · ".join(html.escape(str(x)) for x in (o["method"] if o["method"] != o["run"] else None,
                                                     o["partition"] or None,
                                                     None if o["seed"] is None else f"seed {o['seed']}") if x)
    n, rounds = len(o["devices"]), o["rounds"]
    missed = {d: k for d, k in o["devices"].items() if k < rounds}
    taking = ("every device in every round" if not missed else
              "; ".join(f"{html.escape(d)} in {k} of {rounds}" for d, k in missed.items()))
    parts = [f"{rounds} round{'s' * (rounds != 1)}" + (f" with {n} device{'s' * (n != 1)} ({taking})" if n else "")]
    if o["final_acc"] is not None:
        parts.append(f"test accuracy {_pct(o['final_acc'])} after the last round (best {_pct(o['best_acc'])})")
    if o["fed_acc"] is not None:  # with the model it scored: the final one's, or an earlier model's, said so
        m = o.get("fed_model_round")
        model = "the final model" if m == rounds else "the initial model" if m == 0 else f"the model after round {m}"
        parts.append(f"federated accuracy {_pct(o['fed_acc'])} of {model} on the devices' own held-out data")
    if o["bytes_up"] is not None or o["bytes_down"] is not None:
        parts.append(f"{_mb(o['bytes_up'])} up and {_mb(o['bytes_down'])} down")
    if o["wall_s"] is not None:
        parts.append(f"{o['wall_s']:.1f} s")
    line = f"<b>{html.escape(o['run'])}</b>: " + (f"{who}: " if who else "") + ", ".join(parts) + "."
    if o["device_seconds"]:
        cells = "; ".join(f"{html.escape(d)} {t['compute']:.2f} / {t['wire']:.2f} / {t['wait']:.2f}"
                          for d, t in o["device_seconds"].items())
        line += f"<br>Seconds per round, mean (compute / wire / waiting): {cells}."
    return f"<li>{line}</li>"


def _group_line(label: str, rows: list[dict[str, Any]]) -> str:
    """A method and partition over its seeds, for pages of many runs."""
    def span(key: str, fmt: Any) -> str:
        vals = [r[key] for r in rows if r[key] is not None]
        if not vals:
            return "—"
        lo, hi, mean = min(vals), max(vals), sum(vals) / len(vals)
        return fmt(mean) + (f" ({fmt(lo)} to {fmt(hi)})" if hi > lo else "")

    devices = sorted({len(r["devices"]) for r in rows})
    rounds = sorted({r["rounds"] for r in rows})
    return (f"<li><b>{html.escape(label)}</b>: {len(rows)} run(s), {'/'.join(map(str, rounds))} rounds, "
            f"{'/'.join(map(str, devices))} devices, final test accuracy {span('final_acc', _pct)}, "
            f"{span('bytes_up', _mb)} up per run.</li>")


def _summary_html(runs: list[Run], profs: Profiles, max_lines: int = 8) -> str:
    """The page's opening: what the runs did, one line per run (per method and partition when there are
    many), and the profiles given."""
    items = []
    over = D.run_overview(runs)
    if len(over) <= max_lines:
        items += [_run_line(o) for o in over]
    else:
        by_group: dict[str, list[dict[str, Any]]] = {}
        for o in over:
            by_group.setdefault(f"{o['method']} · {o['partition']}" if o["partition"] else o["method"], []).append(o)
        items += [_group_line(label, rows) for label, rows in by_group.items()]
    if profs:
        items.append(f"<li>{len(profs)} device profile(s): {', '.join(html.escape(n) for n, _ in profs)}.</li>")
    return '<h2 id="summary">What these runs did</h2><ul class="summary">' + "".join(items) + "</ul>"


def _load(inputs: Sequence[Path], profiles: Sequence[Path]) -> tuple[list[Run], list[Benchmark], list[str], Profiles]:
    """Runs, benchmark tables, loader notes and profiles; RunError when there is nothing to report on."""
    runs, benches, notes = discover([Path(p) for p in inputs]) if inputs else ([], [], [])
    profs = [(Path(p).stem, load_profile(Path(p))) for p in profiles]
    if not runs and not profs:
        raise RunError("no runs and no profiles to report on")
    return runs, benches, notes, profs


def _plot_section(plot: Plot, out: Path, errors: list[str]) -> Section:
    """Fill one section: its data, and its PNG or a note why not; a failure becomes a note, not a lost report."""
    sec = plot.section
    try:
        data = plot.compute()
        note = None
        if isinstance(data, tuple):  # (data, note)
            data, note = data
        sec.data = data
        if not data:
            sec.note = note or plot.empty_note
            sec.absent = plot.absent or html.escape(sec.title[:1].lower() + sec.title[1:])
            return sec
        P.save(plot.draw(data), out / f"{sec.key}.png")
        sec.png = out / f"{sec.key}.png"
        sec.note = note
    except Exception as exc:  # noqa: BLE001 - one odd run must not cost the whole report
        errors.append(f"{sec.key}: {type(exc).__name__}: {exc}")
        sec.note = f"this plot failed: {html.escape(type(exc).__name__)}: {html.escape(str(exc))}"
    return sec


def _tail_html(runs: list[Run], benches: list[Benchmark], notes: list[str], errors: list[str]) -> str:
    """What follows the plots: the runs table, each benchmark's tables, and the notes and plot errors."""
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
    return "\n".join(tail)


def _meta(inputs: Sequence[Path], runs: list[Run], profs: Profiles, command: str | None) -> list[str]:
    """The page's header lines: what it was built from, when, and by which command."""
    return [f"{len(runs)} run(s) from {', '.join(html.escape(str(p)) for p in inputs) or '—'}"
            + (f"; {len(profs)} profile(s)" if profs else ""),
            f"written {_dt.datetime.now().isoformat(timespec='seconds')}"
            + (f" by <code>{html.escape(command)}</code>" if command else "")]


def build_report(inputs: Sequence[Path], profiles: Sequence[Path] = (), out: Path = Path("report"),
                 band: str = "minmax", command: str | None = None, target_acc: float | None = None) -> Report:
    """Write ``out/report.html`` (self-contained) and one PNG per plot; returns what was written.

    ``target_acc``: the time-to-accuracy table's target (None: the lowest final accuracy among the methods).
    Raises RunError when an input holds no run, or a profile is not a profile report.
    """
    runs, benches, notes, profs = _load(inputs, profiles)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    sections = [_plot_section(p, out, errors) for p in plots(Inputs(runs, profs, band, target_acc))]
    page = render_page("fedsga-edge report", _meta(inputs, runs, profs, command), sections,
                       _tail_html(runs, benches, notes, errors), head_html=_summary_html(runs, profs))
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
