"""One function per plot: each takes what ``report.data`` computed and returns a matplotlib Figure.

``fedsga-edge plot`` and ``fedsga-edge report`` both draw through these functions. Functions that
can draw into axes the caller made take ``ax``/``axes``; without them they make their own figure.
matplotlib is imported with the Agg backend (files only, no display).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .data import METHOD_ORDER

__all__ = [
    "plot_acc_by_split",
    "plot_accuracy",
    "plot_bytes",
    "plot_descriptor_entropy",
    "plot_estimator_losses",
    "plot_federated",
    "plot_frontier",
    "plot_latency",
    "plot_reliability",
    "plot_split_depths",
    "plot_timeline",
    "plot_tradeoff",
    "save",
]

_LINESTYLES = ["-", "--", ":", "-."]
_MARKERS = ["o", "s", "^", "D", "v", "P"]


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _color(method: str, index: int | None = None) -> str:
    """The same colour for a method in every plot (FedSGA red, as in the paper's figures)."""
    if method == "fedsga":
        return "C3"
    if method in METHOD_ORDER:
        i = METHOD_ORDER.index(method)
        i = i if i < 3 else i + 1  # skip C3
        return f"C{i % 10}"
    i = (index or 0) % 9
    return f"C{i if i < 3 else i + 1}"  # never FedSGA's red


def _distinct_colors(methods: list[str]) -> list[str]:
    """Each method's usual colour where those are all different, else one colour each by position (FedSGA still
    red): a panel with methods outside METHOD_ORDER must not draw two of them alike."""
    usual = [_color(m, i) for i, m in enumerate(methods)]
    if len(set(usual)) == len(usual):
        return usual
    others = iter(f"C{i}" for i in (0, 1, 2, 4, 5, 6, 7, 8, 9, 0, 1, 2, 4, 5, 6, 7, 8, 9))
    return ["C3" if m == "fedsga" else next(others, "0.5") for m in methods]


class _Styler:
    """Colour by method (or by position when groups are single runs), line style by partition."""

    def __init__(self, items: list[dict[str, Any]], by_position: bool = False) -> None:
        self.parts = sorted({str(it.get("partition", "")) for it in items}, key=lambda p: (p != "iid", p))
        # colour by position when two items share method and partition (one line per run, `plot`)
        keys = {(it.get("method"), it.get("partition")) for it in items}
        self.by_position = by_position or len(keys) < len(items)
        self.index = {id(it): i for i, it in enumerate(items)}

    def color(self, it: dict[str, Any]) -> str:
        if self.by_position:
            return f"C{self.index.get(id(it), 0) % 10}"
        return _color(str(it.get("method", "")), self.index.get(id(it)))

    def line(self, it: dict[str, Any]) -> str:
        return _LINESTYLES[self.parts.index(str(it.get("partition", ""))) % len(_LINESTYLES)]

    def marker(self, it: dict[str, Any]) -> str:
        return _MARKERS[self.parts.index(str(it.get("partition", ""))) % len(_MARKERS)]


def _int_xaxis(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def save(fig, path, dpi: int = 110) -> None:
    fig.savefig(path, dpi=dpi)
    _plt().close(fig)


# -- accuracy --------------------------------------------------------------------------------------
def plot_accuracy(curves: list[dict[str, Any]], ax=None, band: str = "minmax", by_position: bool = False,
                  x: str = "rounds"):
    """Test accuracy per round: the mean over seeds as a line, the seeds' spread as a band, each seed thin.

    ``x="seconds"``: against each curve's (and seed's) ``seconds`` instead, the fleet's cumulative wall-clock
    (``report.data.time_to_accuracy_curves``)."""
    plt = _plt()
    fig = ax.figure if ax is not None else plt.figure(figsize=(8, 4.2))
    ax = ax if ax is not None else fig.add_subplot(111)
    st = _Styler(curves, by_position)
    for c in curves:
        color, ls = st.color(c), st.line(c)
        many = len(c["seeds"]) > 1
        if many:
            for s in c["seeds"]:
                ax.plot(s[x], s["acc"], color=color, ls=ls, lw=0.7, alpha=0.35)
            if band == "std":
                lo = np.array(c["mean"]) - np.array(c["std"])
                hi = np.array(c["mean"]) + np.array(c["std"])
            else:
                lo, hi = c["min"], c["max"]
            ax.fill_between(c[x], lo, hi, color=color, alpha=0.15, lw=0)
        label = c["label"] + (f" (mean of {max(c['n'])})" if many else "")
        ax.plot(c[x], c["mean"], color=color, ls=ls, lw=2, marker="o", ms=3.5, label=label)
    ax.set_xlabel("round" if x == "rounds" else "seconds on the fleet (cumulative fleet_s)")
    ax.set_ylabel("test accuracy")
    sub = any(c.get("subset") for c in curves)
    ax.set_title(("test accuracy per round" if x == "rounds" else "time to accuracy") + (" (intermediate rounds: test subset)" if sub else "")
                 + (f"; band: {'±1 std' if band == 'std' else 'min-max'} over seeds"
                    if any(len(c["seeds"]) > 1 for c in curves) else ""), fontsize=9)
    ax.grid(alpha=0.3)
    if x == "rounds":
        _int_xaxis(ax)
    if curves:
        ax.legend(fontsize=7, loc="best", ncol=2 if len(curves) > 6 else 1)
    fig.tight_layout()
    return fig


# -- split depths ---------------------------------------------------------------------------------
def plot_split_depths(matrices: list[dict[str, Any]], axes=None, max_k: int | None = None):
    """Per run, a heatmap of the split index per client (rows) and round (columns); 0 = whole model."""
    plt = _plt()
    from matplotlib.colors import BoundaryNorm, ListedColormap

    n = len(matrices)
    if axes is None:
        heights = [max(1.6, 0.22 * len(m["clients"]) + 1.0) for m in matrices]
        fig, axs = plt.subplots(n, 1, figsize=(8, sum(heights) + 0.4), squeeze=False,
                                gridspec_kw={"height_ratios": heights})
        axes = [a[0] for a in axs]
    else:
        fig = axes[0].figure
    top = max_k if max_k is not None else max([k for m in matrices for k in m["ks"]] + [1])
    base = _plt().get_cmap("viridis")
    cmap = ListedColormap([base(i / max(top, 1)) for i in range(top + 1)]).with_extremes(bad="#dddddd")
    norm = BoundaryNorm(np.arange(-0.5, top + 1.5), cmap.N)
    for ax, m in zip(axes, matrices):
        mat = np.ma.masked_invalid(np.array(m["k"], dtype=float))
        rounds = m["rounds"]
        im = ax.imshow(mat, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm,
                       extent=(rounds[0] - 0.5, rounds[-1] + 0.5, len(m["clients"]) - 0.5, -0.5))
        ax.set_yticks(range(len(m["clients"])))
        ax.set_yticklabels(m["clients"], fontsize=6 if len(m["clients"]) > 12 else 7)
        ax.set_title(f"{m['label']}: split index per client and round", fontsize=9)
        ax.set_xlabel("round", fontsize=8)
        _int_xaxis(ax)
        cb = fig.colorbar(im, ax=ax, ticks=range(top + 1), pad=0.01, fraction=0.04)
        cb.ax.set_yticklabels(["0 whole" if k == 0 else f"k={k}" for k in range(top + 1)], fontsize=7)
    fig.tight_layout()
    return fig


# -- estimator ------------------------------------------------------------------------------------
def plot_reliability(groups: list[dict[str, Any]]):
    """Reliability diagram: observed share of s = 1 against the mean predicted r per bin, and counts."""
    plt = _plt()
    fig, (ax, axh) = plt.subplots(2, 1, figsize=(6.5, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.plot([0, 1], [0, 1], color="0.5", ls=":", lw=1, label="perfect calibration")
    for i, g in enumerate(groups):
        color = _color(g["method"], i) if len({x["method"] for x in groups}) == len(groups) else f"C{i % 10}"
        xs = [b["mean_r"] for b in g["bins"]]
        ys = [b["freq"] for b in g["bins"]]
        ax.plot(xs, ys, marker="o", color=color, label=f"{g['label']}: Brier {g['brier']:.3f}, n={len(g['r'])}")
        width = 1.0 / max(len(g["bins"]), 1) / (len(groups) + 0.5)
        centers = [(b["lo"] + b["hi"]) / 2 + (i - (len(groups) - 1) / 2) * width for b in g["bins"]]
        axh.bar(centers, [b["n"] for b in g["bins"]], width=width, color=color, alpha=0.8)
    ax.set_xlim(-0.02, 1.02)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("observed share of s = 1")
    ax.set_title("estimator reliability: predicted r vs calibration label s", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    axh.set_xlabel("predicted r (bin mean)")
    axh.set_ylabel("pairs")
    axh.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def plot_estimator_losses(groups: list[dict[str, Any]]):
    """L1 / Lref per calibration round (mean, min-max over clients and seeds) and the labelling margin."""
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for i, g in enumerate(groups):
        color = _color(g["method"], i) if len({x["method"] for x in groups}) == len(groups) else f"C{i % 10}"
        ax.fill_between(g["rounds"], g["ratio_min"], g["ratio_max"], color=color, alpha=0.15, lw=0)
        ax.scatter([p[0] for p in g["points"]], [p[1] for p in g["points"]], color=color, s=8, alpha=0.4)
        ax.plot(g["rounds"], g["ratio"], color=color, marker="o", label=g["label"])
        ax2.plot(g["rounds"], g["L1"], color=color, marker="o", label=f"{g['label']}: L1")
        ax2.plot(g["rounds"], g["Lref"], color=color, marker="s", ls="--", label=f"{g['label']}: Lref")
    betas = {g["beta"] for g in groups if g["beta"] is not None}
    if len(betas) == 1:
        beta = betas.pop()
        ax.axhline(1 + beta, color="0.3", ls=":", lw=1, label=f"1 + beta = {1 + beta:g} (s = 1 below)")
    ax.set_title("L1 / Lref on calibration rounds", fontsize=9)
    ax.set_xlabel("round")
    ax.set_ylabel("L1 / Lref")
    ax2.set_title("probe losses (mean over clients)", fontsize=9)
    ax2.set_xlabel("round")
    ax2.set_ylabel("loss")
    for a in (ax, ax2):
        a.grid(alpha=0.3)
        _int_xaxis(a)
        a.legend(fontsize=7)
    fig.tight_layout()
    return fig


# -- cost -----------------------------------------------------------------------------------------
def plot_tradeoff(points: list[dict[str, Any]]):
    """Final accuracy against client MFLOPs per training sample, one point per method (error bars: seeds)."""
    plt = _plt()
    parts = sorted({p["partition"] for p in points}, key=lambda p: (p != "iid", p))
    fig, axes = plt.subplots(1, len(parts), figsize=(5.5 * len(parts), 4.3), squeeze=False)
    for ax, part in zip(axes[0], parts):
        pts = [p for p in points if p["partition"] == part]
        for i, p in enumerate(pts):
            color = _color(p["method"], i)
            ax.errorbar(p["flops_mean"] / 1e6, p["acc_mean"] * 100, xerr=p["flops_std"] / 1e6 or None,
                        yerr=p["acc_std"] * 100 or None, fmt="o", ms=6, capsize=3, color=color,
                        label=f"{p['method']} (n={p['n']})")
            ax.annotate(p["method"], (p["flops_mean"] / 1e6, p["acc_mean"] * 100), textcoords="offset points",
                        xytext=(5, 4), fontsize=7)
        _cost_axes(ax, f"accuracy vs client cost{f': {part}' if part else ''}", "final test accuracy (%)")
    fig.tight_layout()
    return fig


def plot_bytes(curves: list[dict[str, Any]]):
    """Bytes up (activations, updates) and down (weights, gradients) per round, mean over seeds."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    st = _Styler(curves)
    for c in curves:
        for ax, key in zip(axes, ("up", "down")):
            if key not in c:
                continue
            d = c[key]
            if max(d["n"]) > 1:
                ax.fill_between(d["rounds"], np.array(d["min"]) / 1e6, np.array(d["max"]) / 1e6,
                                color=st.color(c), alpha=0.15, lw=0)
            ax.plot(d["rounds"], np.array(d["mean"]) / 1e6, color=st.color(c), ls=st.line(c), marker="o", ms=3,
                    label=c["label"])
    for ax, key in zip(axes, ("up (clients to server)", "down (server to clients)")):
        ax.set_title(f"MB {key} per round", fontsize=9)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        _int_xaxis(ax)
    axes[0].set_ylabel("MB per round")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_latency(curves: list[dict[str, Any]]):
    """Latency p50 per split index, whiskers up to p90; one line per device and runtime, a panel per batch."""
    plt = _plt()
    from matplotlib.ticker import FuncFormatter

    batches = sorted({c["batch"] for c in curves})
    fig, axes = plt.subplots(1, len(batches), figsize=(5.5 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for i, c in enumerate([c for c in curves if c["batch"] == b]):
            p50, p90 = np.array(c["p50"]), np.array(c["p90"])
            ax.errorbar(c["splits"], p50, yerr=[np.zeros_like(p50), np.maximum(p90 - p50, 0)], marker=_MARKERS[i % 6],
                        capsize=3, color=f"C{i % 10}", label=c["label"])
        ax.set_title(f"prefix latency, batch {b} (whisker: p90)", fontsize=9)
        ax.set_xlabel("split index k")
        ax.set_ylabel("latency p50 (ms)")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.1e}"[0] in "25" else ""))
        _int_xaxis(ax)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# -- optional keys --------------------------------------------------------------------------------
def plot_acc_by_split(groups: list[dict[str, Any]]):
    """Final-round test accuracy with each depth's embedding, grouped bars per split index."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 4))
    ks = sorted({k for g in groups for k in g["ks"]})
    width = 0.8 / max(len(groups), 1)
    for i, g in enumerate(groups):
        x = [ks.index(k) + (i - (len(groups) - 1) / 2) * width for k in g["ks"]]
        ax.bar(x, np.array(g["mean"]) * 100, width=width, yerr=np.array(g["std"]) * 100 if max(g["n"]) > 1 else None,
               capsize=2, color=_color(g["method"], i), alpha=0.85 if i % 2 == 0 else 0.6, label=g["label"])
    ax.set_xticks(range(len(ks)))
    ax.set_xticklabels([f"k={k}" for k in ks])
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("final round: test accuracy with the embedding of each split depth", fontsize=9)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_descriptor_entropy(curves: list[dict[str, Any]]):
    """Mean per-client descriptor entropy per round (min-max over seeds)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    st = _Styler(curves)
    for c in curves:
        if max(c["n"]) > 1:
            ax.fill_between(c["rounds"], c["min"], c["max"], color=st.color(c), alpha=0.15, lw=0)
        ax.plot(c["rounds"], c["mean"], color=st.color(c), ls=st.line(c), marker="o", ms=3, label=c["label"])
    ax.set_xlabel("round")
    ax.set_ylabel("descriptor entropy")
    ax.set_title("prompt descriptor entropy (mean over clients)", fontsize=9)
    ax.grid(alpha=0.3)
    _int_xaxis(ax)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_federated(curves: list[dict[str, Any]], max_runs: int = 6):
    """Per run: the devices' federated accuracy of each model (bold), the coordinator's test accuracy of the
    same model (dashed) and each device's own figure (thin): who the model serves badly."""
    plt = _plt()
    shown = curves[:max_runs]
    fig, axes = plt.subplots(len(shown), 1, figsize=(8, 2.9 * len(shown) + 0.3), squeeze=False)
    for ax, c in zip((a[0] for a in axes), shown):
        for j, (cid, pts) in enumerate(c["devices"].items()):
            ax.plot([m for m, _ in pts], [a for _, a in pts], color="0.6", lw=0.8, alpha=0.8,
                    label="each device" if j == 0 else None)
        ax.plot([m for m, _ in c["fed"]], [a for _, a in c["fed"]], color=_color(c["method"]), lw=2, marker="o",
                ms=3, label="federated (devices' held-out data)")
        if c["test"]:
            ax.plot([m for m, _ in c["test"]], [a for _, a in c["test"]], color="k", ls="--", lw=1.2,
                    label="coordinator's test set")
        ax.set_title(c["label"], fontsize=9)
        ax.set_xlabel("model after round")
        ax.set_ylabel("accuracy")
        ax.grid(alpha=0.3)
        _int_xaxis(ax)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


# -- fleets ---------------------------------------------------------------------------------------------
TIMELINE_PARTS = (("compute", "compute", "C0"), ("wire", "wire", "C1"),
                  ("wait_before", "waiting for the server", "0.72"), ("wait_after", "waiting for the last device", "0.88"))


def plot_timeline(timelines: list[dict[str, Any]]):
    """Per run and round (``report.data.fleet_timelines``), one bar per device: its compute, wire and waiting
    seconds end to end (totals over the round, not their order), the waiting cut where the device was done;
    a tick marks when each device was done, the dashed line the round's end (``fleet_s``)."""
    plt = _plt()
    heights = [max(1.5, 0.3 * len(t["devices"]) + 0.9) for t in timelines]
    fig, axes = plt.subplots(len(timelines), 1, figsize=(8, sum(heights) + 0.5), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, t in zip((a[0] for a in axes), timelines):
        devs = t["devices"]
        ys = np.arange(len(devs))
        left = np.zeros(len(devs))
        for key, name, color in TIMELINE_PARTS:
            w = np.array([d[key] for d in devs], dtype=float)
            ax.barh(ys, w, left=left, height=0.6, color=color, edgecolor="white", lw=0.4, label=name)
            left += w
        for y, d in zip(ys, devs):
            if d["done"] is not None:
                ax.plot([d["done"]] * 2, [y - 0.38, y + 0.38], color="k", lw=1.2)
            note = "missed" if d["missed"] else "not done" if d["done"] is None else ""
            if note:
                ax.annotate(note, (left[y], y), xytext=(3, 0), textcoords="offset points", va="center", fontsize=6)
        ax.axvline(t["fleet_s"], color="k", ls="--", lw=0.8)
        ax.set_yticks(ys)
        ax.set_yticklabels([f"{d['device']}" + (f" · {d['class']}" if d["class"] else "")
                            + (f" · k={d['split']}" if d["split"] is not None else "") for d in devs],
                           fontsize=6 if len(devs) > 12 else 7)
        ax.invert_yaxis()
        who = f"; the others waited for {t['last']}" if t["last"] and len(devs) > 1 else ""
        ax.set_title(f"{t['label']}: round {t['round']}, {t['fleet_s']:.2f} s on the fleet{who}", fontsize=9)
        ax.set_xlabel("seconds from round start", fontsize=8)
        ax.grid(alpha=0.3, axis="x")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(TIMELINE_PARTS), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / (sum(heights) + 0.5)))
    return fig


FRONTIER_COLUMNS = 3  # panels per row: six side by side (two partitions x fronts x scores) shrink past reading


def plot_frontier(groups: list[dict[str, Any]]):
    """Accuracy against client MFLOPs per sample, one panel per partition and score (test, own data): the fixed
    cuts (squares) and the envelope through them (the static frontier, dashed past the last vertex), each adaptive
    method a point labelled with its paired distance to the frontier."""
    plt = _plt()
    cols = min(len(groups), FRONTIER_COLUMNS)
    rows = -(-len(groups) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.8 * cols, 4.4 * rows), squeeze=False)
    for ax in axes.flat[len(groups):]:
        ax.set_visible(False)
    for ax, g in zip(axes.flat, groups):
        xs = [f / 1e6 for f, _ in g["envelope"]]
        ys = [a * 100 for _, a in g["envelope"]]
        right = max([c["flops"] for c in g["cuts"]] + [m["flops"] for m in g["methods"]]) / 1e6
        ax.plot(xs, ys, "-", color="0.3", lw=1.5, label="static frontier")
        ax.plot([xs[-1], max(right, xs[-1])], [ys[-1], ys[-1]], "--", color="0.3", lw=1)
        for c in g["cuts"]:
            ax.plot(c["flops"] / 1e6, c["acc"] * 100, "s", color="0.45", ms=6)
            ax.annotate(c["method"], (c["flops"] / 1e6, c["acc"] * 100), textcoords="offset points",
                        xytext=(5, -10), fontsize=7, color="0.3")
        colors = _distinct_colors([m["method"] for m in g["methods"]])
        for m, color in zip(g["methods"], colors):
            d = m["delta"] or {}
            gap = "" if d.get("mean") is None else f" {100 * d['mean']:+.2f}" + (
                f" ± {100 * d['se']:.2f}" if d.get("se") is not None else "")
            ax.plot(m["flops"] / 1e6, m["acc"] * 100, "o", color=color, ms=7,
                    label=f"{m['method']}{gap} (n={m['n']})")
        _cost_axes(ax, f"static frontier: {g['partition'] or 'runs'} (seeds {len(g['seeds'])})",
                   "own-data accuracy (%)" if g.get("score") == "own data" else "accuracy (%)")
    fig.tight_layout()
    return fig


def _cost_axes(ax: Any, title: str, ylabel: str) -> None:
    """An accuracy-against-client-cost panel's title, axes, grid and legend (the cost plot's and the frontier's)."""
    ax.set_title(title, fontsize=9)
    ax.set_xlabel("client MFLOPs / training sample")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
