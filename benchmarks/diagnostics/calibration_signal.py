"""Do FedSGA's calibration labels say anything about devices, and does the observation predict them?

Gamma (the sufficiency estimator) can only send devices to different splits if, within a calibration round, the
label s = 1[L1 <= (1 + beta) Lref] differs between devices and the observation o = [a, delta, q] (with r_prev)
ranks the devices the way the labels do. Only the pairs Gamma is fitted on count (a device's first observation,
the same point for every device, is left out as the method leaves it out). For each FedSGA run under OUT
(``<method>/<partition>/seed<s>/metrics.jsonl``, as benchmarks/accuracy.py writes them; per-device ``s``, ``a``,
``delta``, ``q``, ``r_prev`` and ``r`` are in each record's ``clients``), per calibration round: how many
devices were labelled, the share labelled 1, each input's AUC for s among that round's devices (the chance that
a device labelled 1 has the larger value; 0.5: no ranking; Gamma is built increasing in a and r_prev, decreasing
in delta and q, so its assumption is AUC > 0.5 for a and r_prev, < 0.5 for delta and q), and the spread of r
over devices in the rounds that estimate uses. Beside Gamma's inputs, one it does not have: ``m_prev``, the
device's own margin at its previous calibration, log(Lref / L1) (higher: the shallow path did relatively
better), which asks whether a device's label is a property of the device that persists from one calibration to
the next. Then the same pooled over all runs' calibration rounds, each round's labels and inputs taken relative
to that round (so a round's base rate and the features' drift over rounds do not count as device signal).

    python benchmarks/diagnostics/calibration_signal.py benchmarks/records/office-v1/fedsga
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

INPUTS = ("a", "delta", "q", "r_prev")
COLUMNS = (*INPUTS, "m_prev")  # m_prev: not an input of Gamma's (module doc)


def auc(x: np.ndarray, s: np.ndarray) -> float | None:
    """P(x of a random s=1 device > x of a random s=0 device), ties half; None without both labels."""
    pos, neg = x[s == 1], x[s == 0]
    if not len(pos) or not len(neg):
        return None
    gt = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(gt / (len(pos) * len(neg)))


def calibration_rounds(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per calibration round (a record whose devices carry a label ``s``): its labels and inputs, and the
    r each device got in the rounds up to the next calibration."""
    out: list[dict[str, Any]] = []
    margin: dict[str, float] = {}  # each device's log(Lref / L1) at its last calibration, first ones included
    for rec in rows:
        # the pairs Gamma is fitted on: a device's first observation (delta = 0 and r_prev = 0) is the same
        # point for every device and is not stored (fedsga_edge/method/estimator.py ``informative``)
        labelled = {c: v for c, v in rec.get("clients", {}).items() if v.get("s") is not None
                    and not (float(v.get("delta") or 0.0) == 0.0 and float(v.get("r_prev") or 0.0) == 0.0)}
        if labelled:
            out.append({"round": rec["round"], "s": np.array([float(v["s"]) for v in labelled.values()]),
                        **{k: np.array([float(v.get(k) or 0.0) for v in labelled.values()]) for k in INPUTS},
                        "m_prev": np.array([margin.get(c, 0.0) for c in labelled]), "r_after": []})
        elif out:
            rs = [v["r"] for v in rec.get("clients", {}).values() if v.get("r") is not None]
            if rs:
                out[-1]["r_after"].append((min(rs), max(rs)))
        for c, v in rec.get("clients", {}).items():
            if v.get("s") is not None and v.get("L1") and v.get("Lref"):
                margin[c] = float(np.log(float(v["Lref"]) / float(v["L1"])))
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    args = ap.parse_args(argv)
    print("| run | round | devices | s = 1 share | AUC a | AUC delta | AUC q | AUC r_prev | AUC m_prev (not Gamma's) | "
          "r spread over devices after (max - min, mean) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    pooled: dict[str, list[float]] = {k: [] for k in ("s", *COLUMNS)}
    rounds = mixed = 0
    spreads: list[float] = []
    for path in sorted(args.out.glob("**/seed*/metrics.jsonl")):  # OUT, or one method's folder in it
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        for cal in calibration_rounds(rows):
            spread = [hi - lo for lo, hi in cal["r_after"]]
            spreads += spread
            rounds += 1
            mixed += bool(0 < cal["s"].mean() < 1)
            print(f"| {path.parent.relative_to(args.out)} | {cal['round']} | {len(cal['s'])} | {cal['s'].mean():.2f} | "
                  + " | ".join(_fmt(auc(cal[k], cal["s"])) for k in COLUMNS)
                  + (f" | {np.mean(spread):.2f} |" if spread else " | - |"))
            if 0 < cal["s"].mean() < 1:  # a round whose labels tell devices apart: its values about its means
                pooled["s"].extend(cal["s"])
                for k in COLUMNS:
                    pooled[k].extend(cal[k] - cal[k].mean())
    s = np.array(pooled["s"])
    print(f"\n{rounds} calibration rounds, {mixed} with both labels; pooled over those, each input relative to its "
          f"round's mean ({len(s)} device-rounds, s = 1 share {s.mean() if len(s) else float('nan'):.2f}): "
          + ", ".join(f"AUC {k} {_fmt(auc(np.array(pooled[k]), s))}" for k in COLUMNS)
          + f"; one r for every device (spread < 0.01) in {sum(x < 0.01 for x in spreads)} of the {len(spreads)} "
          f"rounds after a calibration")


if __name__ == "__main__":
    main()
