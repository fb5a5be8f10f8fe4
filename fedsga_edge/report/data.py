"""What each plot shows, computed from loaded runs and profiles: plain dicts and lists, no plotting.

Every function tolerates runs that lack the keys it reads (older runs, other strategies): they are
left out, and a function with nothing to show returns an empty list or None.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from fedsga_edge.owndata import fed_evaluations

from .runs import SETTING_KEYS, Run

__all__ = [
    "METHOD_ORDER",
    "acc_by_split",
    "accuracy_curves",
    "brier",
    "bytes_curves",
    "descriptor_entropy",
    "estimator_losses",
    "fleet_timelines",
    "group_runs",
    "latency_curves",
    "reliability",
    "round_acc",
    "round_timeline",
    "seconds_to_target",
    "split_matrix",
    "split_shares",
    "summary_rows",
    "time_to_accuracy_curves",
    "tradeoff_points",
]

METHOD_ORDER = ["fedavg", "fedprox", "static", "random", "resource", "fedsga",
                "fedsga-no-adapt", "fedsga-no-estimator", "fedsga-no-harmonizer"]


def _order(method: str) -> tuple[int, str]:
    return (METHOD_ORDER.index(method), "") if method in METHOD_ORDER else (len(METHOD_ORDER), method)


def _part_order(partition: str) -> tuple[int, str]:
    return (0 if partition == "iid" else 1, partition)


def _num(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    x = float(x)
    return x if math.isfinite(x) else None


# -- grouping -----------------------------------------------------------------------------------
def group_runs(runs: list[Run], by_run: bool = False) -> list[dict[str, Any]]:
    """Runs grouped by (method, partition) and, where the runs given differ in it, their setting.

    ``by_run``: every run is its own group, labelled by its name (``fedsga-edge plot``).
    Returns [{"label", "method", "partition", "runs": [Run, ...]}] in a stable method order.
    """
    if by_run:
        return [{"label": r.name, "method": r.method, "partition": r.partition, "runs": [r]} for r in runs]
    differ = [k for k in SETTING_KEYS if len({repr(r.config.get(k)) for r in runs}) > 1]
    groups: dict[tuple, dict[str, Any]] = {}
    for r in runs:
        setting = tuple((k, r.config.get(k)) for k in differ)
        key = (r.method, r.partition, setting)
        if key not in groups:
            label = " · ".join([r.method] + ([r.partition] if r.partition else [])
                               + [f"{k}={v}" for k, v in setting])
            groups[key] = {"label": label, "method": r.method, "partition": r.partition, "runs": []}
        groups[key]["runs"].append(r)
    out = sorted(groups.values(), key=lambda g: (_order(g["method"]), _part_order(g["partition"]), g["label"]))
    for g in out:
        g["runs"].sort(key=lambda r: (r.seed if r.seed is not None else -1, r.name))
    return out


def _seed_label(r: Run) -> str:
    return f"seed {r.seed}" if r.seed is not None else r.name


def _aggregate(series: list[dict[int, float]]) -> dict[str, list[float]]:
    """Mean / std / min / max over runs at each round any run has a value for."""
    rounds = sorted({t for s in series for t in s})
    out: dict[str, list] = {"rounds": rounds, "mean": [], "std": [], "min": [], "max": [], "n": []}
    for t in rounds:
        vals = np.array([s[t] for s in series if t in s], dtype=float)
        out["mean"].append(float(vals.mean()))
        out["std"].append(float(vals.std(ddof=1)) if len(vals) > 1 else 0.0)
        out["min"].append(float(vals.min()))
        out["max"].append(float(vals.max()))
        out["n"].append(int(len(vals)))
    return out


# -- accuracy -------------------------------------------------------------------------------------
def round_acc(row: dict[str, Any]) -> tuple[float | None, bool]:
    """A round's test accuracy: ``test_acc`` (full test set), else the benchmark's ``test_acc_subset``."""
    acc = _num(row.get("test_acc"))
    if acc is not None:
        return acc, False
    acc = _num(row.get("test_acc_subset"))
    return acc, acc is not None


def accuracy_curves(runs: list[Run], by_run: bool = False) -> list[dict[str, Any]]:
    """Test accuracy per round: per group the mean, std, min and max over its seeds, and each seed's line.

    Returns [{"label", "method", "partition", "rounds", "mean", "std", "min", "max", "n",
    "seeds": [{"label", "rounds", "acc"}], "subset": bool}]; groups with no accuracy are left out.
    ``subset`` is True when some points are the benchmark's test-subset evaluations.
    """
    curves = []
    for g in group_runs(runs, by_run):
        seeds, series, subset = [], [], False
        for r in g["runs"]:
            pts: dict[int, float] = {}
            for row in r.rows:
                acc, sub = round_acc(row)
                if acc is not None and "round" in row:
                    pts[int(row["round"])] = acc
                    subset |= sub
            if pts:
                series.append(pts)
                seeds.append({"label": _seed_label(r), "rounds": sorted(pts), "acc": [pts[t] for t in sorted(pts)]})
        if series:
            curves.append({"label": g["label"], "method": g["method"], "partition": g["partition"],
                           **_aggregate(series), "seeds": seeds, "subset": subset})
    return curves


# -- split depths ---------------------------------------------------------------------------------
def split_shares(rows: list[dict[str, Any]]) -> tuple[list[int], dict[int, list[float]]]:
    """Per round, the share of clients at each split index (0 = whole model on the device)."""
    rows = [r for r in rows if isinstance(r.get("splits"), dict) and "round" in r]
    ks = sorted({int(k) for r in rows for k in r["splits"].values() if k is not None})
    rounds = [int(r["round"]) for r in rows]
    shares: dict[int, list[float]] = {k: [] for k in ks}
    for r in rows:
        counts = Counter(int(k) for k in r["splits"].values() if k is not None)
        total = max(sum(counts.values()), 1)
        for k in ks:
            shares[k].append(counts.get(k, 0) / total)
    return rounds, shares


def split_matrix(run: Run) -> dict[str, Any] | None:
    """Split index per client (rows) and round (columns); NaN where a client sent no update.

    Returns {"label", "clients", "rounds", "k": [[...]], "ks", "shares"} or None without "splits".
    """
    rows = [r for r in run.rows if isinstance(r.get("splits"), dict) and "round" in r]
    if not rows:
        return None
    clients = sorted({c for r in rows for c in r["splits"]})
    rounds = [int(r["round"]) for r in rows]
    mat = np.full((len(clients), len(rounds)), np.nan)
    for j, r in enumerate(rows):
        for i, c in enumerate(clients):
            k = r["splits"].get(c)
            if k is not None:
                mat[i, j] = int(k)
    ks = sorted({int(v) for v in mat[~np.isnan(mat)]})
    return {"label": run.name, "clients": clients, "rounds": rounds, "k": mat.tolist(), "ks": ks,
            "shares": split_shares(rows)}


# -- estimator --------------------------------------------------------------------------------------
def brier(r: list[float], s: list[float]) -> float:
    return float(np.mean((np.asarray(r, dtype=float) - np.asarray(s, dtype=float)) ** 2))


def _pairs(run: Run) -> list[tuple[int, str, float, int]]:
    """(round, client, r, s) for every client record holding both: the estimate that client's split
    came from that round and the calibration label measured in the same round."""
    out = []
    for row in run.rows:
        clients = row.get("clients")
        if not isinstance(clients, dict):
            continue
        for cid, c in clients.items():
            if not isinstance(c, dict):
                continue
            r, s = _num(c.get("r")), _num(c.get("s"))
            if r is not None and s is not None:
                out.append((int(row.get("round", 0)), cid, r, int(s)))
    return out


def reliability(runs: list[Run], bins: int = 10) -> list[dict[str, Any]]:
    """Predicted r against calibration label s, per group: Brier score and equal-width bins on [0, 1].

    Returns [{"label", "method", "r", "s", "brier", "bins": [{"lo", "hi", "mean_r", "freq", "n"}]}];
    groups without a single (r, s) pair are left out.
    """
    out = []
    edges = np.linspace(0.0, 1.0, bins + 1)
    for g in group_runs(runs):
        pairs = [p for run in g["runs"] for p in _pairs(run)]
        if not pairs:
            continue
        r = np.array([p[2] for p in pairs])
        s = np.array([p[3] for p in pairs], dtype=float)
        idx = np.clip(np.digitize(r, edges[1:-1], right=False), 0, bins - 1)
        table = []
        for b in range(bins):
            m = idx == b
            if m.any():
                table.append({"lo": float(edges[b]), "hi": float(edges[b + 1]), "mean_r": float(r[m].mean()),
                              "freq": float(s[m].mean()), "n": int(m.sum())})
        out.append({"label": g["label"], "method": g["method"], "r": r.tolist(), "s": s.tolist(),
                    "brier": brier(r, s), "bins": table})
    return out


def estimator_losses(runs: list[Run]) -> list[dict[str, Any]]:
    """Probe losses at p_1 and p_ref on calibration rounds, per group (mean over clients and seeds).

    Returns [{"label", "method", "rounds", "L1", "Lref", "ratio", "ratio_min", "ratio_max", "beta",
    "points": [(round, L1/Lref), ...]}]; ``beta`` is the labelling margin (s = 1 iff L1 <= (1+beta) Lref).
    """
    out = []
    for g in group_runs(runs):
        per_round: dict[int, list[tuple[float, float]]] = {}
        for run in g["runs"]:
            for row in run.rows:
                for c in (row.get("clients") or {}).values():
                    if not isinstance(c, dict):
                        continue
                    l1, lref = _num(c.get("L1")), _num(c.get("Lref"))
                    if l1 is not None and lref is not None and lref > 0:
                        per_round.setdefault(int(row.get("round", 0)), []).append((l1, lref))
        if not per_round:
            continue
        rounds = sorted(per_round)
        ratios = {t: [a / b for a, b in per_round[t]] for t in rounds}
        betas = {_num((r.config.get("fedsga") or {}).get("beta")) for r in g["runs"]} - {None}
        out.append({
            "label": g["label"], "method": g["method"], "rounds": rounds,
            "L1": [float(np.mean([a for a, _ in per_round[t]])) for t in rounds],
            "Lref": [float(np.mean([b for _, b in per_round[t]])) for t in rounds],
            "ratio": [float(np.mean(ratios[t])) for t in rounds],
            "ratio_min": [float(np.min(ratios[t])) for t in rounds],
            "ratio_max": [float(np.max(ratios[t])) for t in rounds],
            "beta": betas.pop() if len(betas) == 1 else None,
            "points": [(t, x) for t in rounds for x in ratios[t]],
        })
    return out


# -- cost -----------------------------------------------------------------------------------------------
def _final_acc(run: Run) -> float | None:
    if run.summary and _num(run.summary.get("final_acc")) is not None:
        return _num(run.summary["final_acc"])
    for row in reversed(run.rows):  # a run without summary.json (still running, or killed)
        acc, _ = round_acc(row)
        if acc is not None:
            return acc
    return None


def _client_flops(run: Run) -> float | None:
    if run.summary and _num(run.summary.get("client_flops_per_sample")) is not None:
        return _num(run.summary["client_flops_per_sample"])
    vals = [_num(r.get("client_flops_per_sample")) for r in run.rows]
    vals = [v for v in vals if v is not None]
    return float(np.mean(vals)) if vals else None


def tradeoff_points(runs: list[Run]) -> list[dict[str, Any]]:
    """Final accuracy against mean client FLOPs per training sample, one point per group.

    From summary.json (``final_acc``, ``client_flops_per_sample``), else from metrics.jsonl.
    Returns [{"label", "method", "partition", "flops_mean", "flops_std", "acc_mean", "acc_std", "n", "seeds"}].
    """
    out = []
    for g in group_runs(runs):
        pts = [(f, a, _seed_label(r)) for r in g["runs"]
               if (f := _client_flops(r)) is not None and (a := _final_acc(r)) is not None]
        if not pts:
            continue
        f = np.array([p[0] for p in pts])
        a = np.array([p[1] for p in pts])
        out.append({"label": g["label"], "method": g["method"], "partition": g["partition"],
                    "flops_mean": float(f.mean()), "flops_std": float(f.std(ddof=1)) if len(f) > 1 else 0.0,
                    "acc_mean": float(a.mean()), "acc_std": float(a.std(ddof=1)) if len(a) > 1 else 0.0,
                    "n": len(pts), "seeds": [{"label": p[2], "flops": p[0], "acc": p[1]} for p in pts]})
    return out


def bytes_curves(runs: list[Run]) -> list[dict[str, Any]]:
    """Bytes up (clients to server) and down per round, per group: mean/min/max over seeds.

    Returns [{"label", "method", "partition", "up": {rounds, mean, ...}, "down": {...}}].
    """
    out = []
    for g in group_runs(runs):
        entry: dict[str, Any] = {"label": g["label"], "method": g["method"], "partition": g["partition"]}
        for key, name in (("bytes_up", "up"), ("bytes_down", "down")):
            series = []
            for r in g["runs"]:
                pts = {int(row["round"]): v for row in r.rows
                       if "round" in row and (v := _num(row.get(key))) is not None}
                if pts:
                    series.append(pts)
            if series:
                entry[name] = _aggregate(series)
        if "up" in entry or "down" in entry:
            out.append(entry)
    return out


# -- optional keys (newer runs) -----------------------------------------------------------------------
def acc_by_split(runs: list[Run]) -> list[dict[str, Any]]:
    """Test accuracy with each depth's embedding in the last round that has ``test_acc_by_split``.

    Returns [{"label", "method", "ks", "mean", "std", "n"}], empty when no run has the key.
    """
    out = []
    for g in group_runs(runs):
        per_k: dict[int, list[float]] = {}
        for r in g["runs"]:
            row = next((row for row in reversed(r.rows) if isinstance(row.get("test_acc_by_split"), dict)), None)
            if row is None:
                continue
            for k, acc in row["test_acc_by_split"].items():
                if _num(acc) is not None:
                    try:
                        per_k.setdefault(int(k), []).append(float(acc))
                    except ValueError:
                        continue
        if per_k:
            ks = sorted(per_k)
            out.append({"label": g["label"], "method": g["method"], "ks": ks,
                        "mean": [float(np.mean(per_k[k])) for k in ks],
                        "std": [float(np.std(per_k[k], ddof=1)) if len(per_k[k]) > 1 else 0.0 for k in ks],
                        "n": [len(per_k[k]) for k in ks]})
    return out


def descriptor_entropy(runs: list[Run]) -> list[dict[str, Any]]:
    """Mean per-client ``descriptor_entropy`` per round, per group (mean/min/max over seeds)."""
    out = []
    for g in group_runs(runs):
        series = []
        for r in g["runs"]:
            pts = {}
            for row in r.rows:
                vals = [_num(c.get("descriptor_entropy")) for c in (row.get("clients") or {}).values()
                        if isinstance(c, dict)]
                vals = [v for v in vals if v is not None]
                if vals and "round" in row:
                    pts[int(row["round"])] = float(np.mean(vals))
            if pts:
                series.append(pts)
        if series:
            out.append({"label": g["label"], "method": g["method"], "partition": g["partition"], **_aggregate(series)})
    return out


# -- devices ------------------------------------------------------------------------------------------
def latency_curves(profiles: list[tuple[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Latency p50 and p90 against split index: one curve per device, runtime, variant and batch size.

    ``profiles``: (name, ``fedsga-edge profile --json`` report). Returns [{"label", "device",
    "runtime", "variant", "batch", "splits", "p50", "p90", "source"}] sorted by batch then label.
    """
    curves: dict[tuple, dict[str, Any]] = {}
    for name, prof in profiles:
        dev = prof.get("device") or {}
        device = str(dev.get("cpu") or dev.get("machine") or name)
        runtime = str(dev.get("runtime") or "?")
        for row in prof.get("results") or []:
            lat = row.get("latency_ms") or {}
            p50, p90 = _num(lat.get("p50")), _num(lat.get("p90"))
            if p50 is None or row.get("split") is None:
                continue
            variant, batch = str(row.get("variant", "fp32")), int(row.get("batch", 1))
            key = (device, runtime, variant, batch, name)
            label = f"{device} · {runtime}" + ("" if variant == "fp32" else f" · {variant}")
            c = curves.setdefault(key, {"label": label,
                                        "device": device, "runtime": runtime, "variant": variant, "batch": batch,
                                        "source": name, "pts": {}})
            c["pts"][int(row["split"])] = (p50, p90 if p90 is not None else p50)
    out = []
    for c in curves.values():
        splits = sorted(c["pts"])
        c["splits"] = splits
        c["p50"] = [c["pts"][k][0] for k in splits]
        c["p90"] = [c["pts"][k][1] for k in splits]
        del c["pts"]
        out.append(c)
    labels = Counter((c["label"], c["batch"]) for c in out)  # same device+runtime in two files: name the file
    for c in out:
        if labels[(c["label"], c["batch"])] > 1:
            c["label"] += f" ({c['source']})"
    return sorted(out, key=lambda c: (c["batch"], c["label"]))


# -- table ------------------------------------------------------------------------------------------------
def summary_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """One row per run: method, partition, seed, final accuracy, client FLOPs/sample, bytes, wall time, splits."""
    rows = []
    for g in group_runs(runs):
        for r in g["runs"]:
            s = r.summary or {}
            up = _num(s.get("bytes_up"))
            down = _num(s.get("bytes_down"))
            if up is None:
                vals = [_num(row.get("bytes_up")) for row in r.rows]
                up = float(sum(v for v in vals if v is not None)) if any(v is not None for v in vals) else None
            if down is None:
                vals = [_num(row.get("bytes_down")) for row in r.rows]
                down = float(sum(v for v in vals if v is not None)) if any(v is not None for v in vals) else None
            wall = _num(s.get("wall_s"))
            if wall is None:
                vals = [_num(row.get("round_s")) for row in r.rows]
                wall = float(sum(v for v in vals if v is not None)) if any(v is not None for v in vals) else None
            hist = s.get("split_histogram")
            if not isinstance(hist, dict):
                hist = dict(sorted(Counter(str(k) for row in r.rows
                                           for k in (row.get("splits") or {}).values()).items()))
            rows.append({
                "run": r.name, "method": r.method, "partition": r.partition, "seed": r.seed,
                "rounds": len(r.rows), "final_acc": _final_acc(r), "client_flops_per_sample": _client_flops(r),
                "bytes_up": up, "bytes_down": down, "wall_s": wall, "split_histogram": hist,
                "complete": r.summary is not None,
            })
    return rows


def _device_rounds(run: Run) -> dict[str, int]:
    """Each device that trained in the run and in how many rounds (its entries in the rounds' ``splits``)."""
    seen: Counter[str] = Counter()
    for row in run.rows:
        if isinstance(row.get("splits"), dict):
            seen.update(str(c) for c in row["splits"])
    return dict(sorted(seen.items()))


def _device_seconds(run: Run) -> dict[str, dict[str, float]]:
    """Per device, its mean compute, wire and waiting seconds per round over the rounds that recorded them."""
    sums: dict[str, list[float]] = {}
    for row in _timed_rounds(run):
        for d in round_timeline(row):
            s = sums.setdefault(d["device"], [0.0, 0.0, 0.0, 0])
            s[0] += d["compute"]
            s[1] += d["wire"]
            s[2] += d["wait_before"] + d["wait_after"]
            s[3] += 1
    return {d: {"compute": c / n, "wire": w / n, "wait": t / n} for d, (c, w, t, n) in sums.items()}


def run_overview(runs: list[Run]) -> list[dict[str, Any]]:
    """What each run did, for the report's opening: its ``summary_rows`` row plus the devices (each with
    the rounds it trained in), the best and the last federated accuracy and, where the rounds recorded
    per-device ``timing``, each device's mean seconds per round."""
    ordered = [r for g in group_runs(runs) for r in g["runs"]]  # summary_rows' order
    out = []
    for r, row in zip(ordered, summary_rows(runs)):
        accs = [a for a in (round_acc(x)[0] for x in r.rows) if a is not None]
        fed = [f for f in _fed_evaluations(r) if _num(f.get("fed_acc")) is not None]
        out.append(row | {"devices": _device_rounds(r), "best_acc": max(accs) if accs else None,
                          "fed_acc": _num(fed[-1]["fed_acc"]) if fed else None,
                          "fed_model_round": fed[-1]["fed_model_round"] if fed else None,
                          "device_seconds": _device_seconds(r)})
    return out


def _fed_evaluations(run: Run) -> list[dict[str, Any]]:
    """The run's own-data evaluations (fedsga_edge/owndata.py: each round's and the final one), those whose
    model round is an integer: a figure is only ever set beside the test figure of the same model."""
    return [f for f in fed_evaluations([row for row in run.rows if isinstance(row, dict)])
            if isinstance(f["fed_model_round"], int) and not isinstance(f["fed_model_round"], bool)]


# -- federated evaluation ----------------------------------------------------------------------------------
def federated_curves(runs: list[Run]) -> list[dict[str, Any]]:
    """Per run with a federated figure: its ``fed_acc`` per model (x: ``fed_model_round``, the round after
    which the model was aggregated; 0 = the initial model; the final evaluation's at the last round), the
    coordinator's ``test_acc`` of the same run (x: its round, the model after it) and each device's accuracy
    (``fed_by_device``)."""
    out = []
    for r in runs:
        fed: dict[int, float] = {}
        devices: dict[str, dict[int, float]] = {}
        for row in _fed_evaluations(r):
            acc, m = _num(row.get("fed_acc")), row["fed_model_round"]
            if acc is None:
                continue
            fed[m] = acc
            by = row.get("fed_by_device")
            for cid, d in (by.items() if isinstance(by, dict) else []):
                a = _num(d.get("acc")) if isinstance(d, dict) else None
                if a is not None:
                    devices.setdefault(str(cid), {})[m] = a
        if not fed:
            continue
        test = {int(row["round"]): a for row in r.rows
                if isinstance(row.get("round"), int) and (a := _num(row.get("test_acc"))) is not None}
        out.append({"label": r.name, "method": r.method, "fed": sorted(fed.items()), "test": sorted(test.items()),
                    "devices": {c: sorted(v.items()) for c, v in sorted(devices.items())}})
    return out


def federated_device_rows(runs: list[Run]) -> list[dict[str, Any]]:
    """Each device's federated accuracy on the last model the devices evaluated (the final model's where the run
    had the final evaluation), per run (worst first), beside the test figure of that model: who
    the model serves badly."""
    rows = []
    for r in runs:
        last = next((row for row in reversed(_fed_evaluations(r)) if isinstance(row.get("fed_by_device"), dict)),
                    None)
        if last is None:
            continue
        test = next((_num(row.get("test_acc")) for row in r.rows if row.get("round") == last.get("fed_model_round")
                     and _num(row.get("test_acc")) is not None), None)
        devs = [(str(c), d) for c, d in last["fed_by_device"].items()
                if isinstance(d, dict) and _num(d.get("acc")) is not None]
        for cid, d in sorted(devs, key=lambda cd: (_num(cd[1].get("acc")), cd[0])):
            rows.append({"run": r.name, "model_round": last.get("fed_model_round"), "device": cid,
                         "acc": _num(d.get("acc")), "loss": _num(d.get("loss")), "count": d.get("count"),
                         "fed_acc": _num(last.get("fed_acc")), "test_acc": test,
                         # FedBABU: the same device's figure after fine-tuning a copy of the head, and its mean
                         "acc_finetuned": _num(d.get("acc_finetuned")),
                         "fed_acc_finetuned": _num(last.get("fed_acc_finetuned"))})
    return rows


# -- fleets: per-device timing and time to accuracy ------------------------------------------------------
def _timed_rounds(run: Run) -> list[dict[str, Any]]:
    return [row for row in run.rows if isinstance(row.get("timing"), dict) and row["timing"]
            and _round_end(row) is not None and isinstance(row.get("round"), int)]


def _round_end(row: dict[str, Any]) -> float | None:
    """A timed round's seconds: ``fleet_s`` on a fleet, ``round_s`` in a plain field run (the same figure)."""
    end = _num(row.get("fleet_s"))
    return _num(row.get("round_s")) if end is None else end


def round_timeline(row: dict[str, Any]) -> list[dict[str, Any]]:
    """One round's devices from its ``timing``: each device's compute, wire and waiting seconds, the waiting cut
    at its ``done_s`` into waiting before it was done (for the server's replies, for a merged step) and waiting
    after it (for the round's last device), in the device order of ``timing``.

    Returns [{"device", "class", "split", "compute", "wire", "wait_before", "wait_after", "done", "missed"}];
    ``done`` None: the device never finished (the deadline took it) or missed the round.
    """
    end = _round_end(row) or 0.0
    out = []
    for cid, t in row["timing"].items():
        if not isinstance(t, dict):
            continue
        compute, wire = _num(t.get("compute_s")) or 0.0, _num(t.get("wire_s")) or 0.0
        wait = _num(t.get("wait_s")) or 0.0
        done = _num(t.get("done_s"))
        if done is not None:
            after = max(0.0, min(wait, end - done))
            before = max(0.0, wait - after)
        else:
            before, after = wait, 0.0
        split = t.get("split")
        out.append({"device": str(cid), "class": t.get("class"), "split": split if isinstance(split, int) else None,
                    "compute": compute, "wire": wire, "wait_before": before, "wait_after": after, "done": done,
                    "missed": bool(t.get("missed"))})
    return out


def fleet_timelines(runs: list[Run], max_runs: int = 4) -> list[dict[str, Any]]:
    """Per run with per-device ``timing`` (one run per method and partition: its lowest seed; at most
    ``max_runs``), its first and last timed rounds, each with its devices (``round_timeline``).

    Returns [{"label", "method", "run", "round", "fleet_s", "last", "devices"}]; ``last``: the device done last
    (the one the others waited for), None when no device finished.
    """
    out = []
    shown = [g["runs"][0] for g in group_runs([r for r in runs if _timed_rounds(r)])][:max_runs]
    for r in shown:
        rows = _timed_rounds(r)
        for row in ([rows[0], rows[-1]] if len(rows) > 1 else rows):
            devices = round_timeline(row)
            done = [d for d in devices if d["done"] is not None]
            out.append({"label": f"{r.method} · {r.name}" if r.name != r.method else r.method, "method": r.method,
                        "run": r.name, "round": int(row["round"]), "fleet_s": float(_round_end(row) or 0.0),
                        "last": max(done, key=lambda d: d["done"])["device"] if done else None,
                        "devices": devices})
    return out


def time_to_accuracy_curves(runs: list[Run]) -> list[dict[str, Any]]:
    """Test accuracy against the fleet's cumulative seconds (``fleet_s`` summed over the rounds so far), per
    group; runs without ``fleet_s`` are left out. Shaped as ``accuracy_curves`` with ``seconds`` beside
    ``rounds``: per seed the cumulative seconds at each of its rounds with an accuracy, per group the mean over
    its seeds (at the rounds every seed has, so the mean line's seconds are comparable)."""
    curves = []
    for g in group_runs([r for r in runs if _timed_rounds(r)]):
        seeds, series, times, subset = [], [], [], False
        for r in g["runs"]:
            clock, pts, secs = 0.0, {}, {}
            for row in r.rows:
                if not isinstance(row.get("round"), int):
                    continue
                clock += _num(row.get("fleet_s")) or 0.0
                acc, sub = round_acc(row)
                if acc is not None:
                    pts[row["round"]], secs[row["round"]] = acc, clock
                    subset |= sub
            if pts:
                series.append(pts)
                times.append(secs)
                rounds = sorted(pts)
                seeds.append({"label": _seed_label(r), "rounds": rounds, "acc": [pts[t] for t in rounds],
                              "seconds": [secs[t] for t in rounds]})
        if not series:
            continue
        common = set.intersection(*(set(s) for s in series))
        agg = _aggregate([{t: v for t, v in s.items() if t in common} for s in series])
        agg["seconds"] = [float(np.mean([s[t] for s in times])) for t in agg["rounds"]]
        curves.append({"label": g["label"], "method": g["method"], "partition": g["partition"], **agg,
                       "seeds": seeds, "subset": subset})
    return curves


def seconds_to_target(curves: list[dict[str, Any]], target: float | None = None) -> tuple[float | None,
                                                                                        list[dict[str, Any]]]:
    """Per time-to-accuracy curve, the fleet seconds (and rounds) until each seed first reached ``target``
    (default: the lowest final mean accuracy among the curves, which every method reaches).

    Returns (target, [{"label", "method", "seconds", "rounds", "reached", "n", "final_acc", "total_s"}]);
    ``seconds``/``rounds``: the mean over the seeds that reached it (None when none did).
    """
    if not curves:
        return None, []
    if target is None:
        target = min(c["mean"][-1] for c in curves)
    rows = []
    for c in curves:
        hits = []
        for s in c["seeds"]:
            i = next((i for i, a in enumerate(s["acc"]) if a >= target - 1e-12), None)
            if i is not None:
                hits.append((s["seconds"][i], s["rounds"][i]))
        rows.append({"label": c["label"], "method": c["method"], "reached": len(hits), "n": len(c["seeds"]),
                     "seconds": float(np.mean([h[0] for h in hits])) if hits else None,
                     "rounds": float(np.mean([h[1] for h in hits])) if hits else None,
                     "final_acc": c["mean"][-1], "total_s": c["seconds"][-1]})
    return target, rows
