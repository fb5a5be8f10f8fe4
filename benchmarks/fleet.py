"""Time to accuracy on a mixed fleet: every split method and FedAvg on a virtual clock.

The paper compares methods in client FLOPs; a deployment asks how many seconds until the model is good on
*its* devices and links. This runs every registered split method (each strategy that trains a prefix on the
device, at its benchmark variants: static at p_1 / p_ref / p_K, random, resource, FedSGA, the split baselines)
plus FedAvg as ``simulate --fleet`` runs (docs/fleet.md: each device's FLOPs over its class's speed, its bytes
over its link, the round deadline on that clock) and prints, per method, the rounds and fleet seconds until the
test accuracy first reached ``--target``, seconds per round (the median over rounds, and the median of the
slowest device), bytes per round, client FLOPs and the final accuracy. With a round deadline (``--deadline``)
FedSGA's deadline-aware variant (``--deadline-aware``, beyond the paper) gets its own row.

    python benchmarks/fleet.py                        # digits, 5 rounds, fleets/mixed-bench.toml, a 5 s deadline
    python benchmarks/fleet.py --target 0.95 --deadline 0       # another target; no deadline (no deadline row)
    python benchmarks/fleet.py --preset cifar         # accuracy.py's cifar regime on the same fleet (CPU-hours)
    python benchmarks/fleet.py --tables-only          # the table again from the runs on disk
    python benchmarks/fleet.py --server-copies per-client --deadline 0 --target 0.5 \
        --methods static-p1,static,static-pK,resource,planner-auto --wire-formats fp32,fp16,int8,int4
                                                      # the planner against every (split, fleet-wide format) pair
    python benchmarks/fleet.py --data npz:PATH --train-subset 2000 --target 0.15   # a CIFAR-10 subset

Runs are planned and run by benchmarks/accuracy.py (``plan``, ``run_one``): ``OUT/<method>/<partition>/seed<s>/``
with config.json, metrics.jsonl and summary.json; a run whose summary.json exists is skipped (a killed benchmark
continues), and one made with other settings is refused rather than mixed in. The seconds to the target come
from the report's ``seconds_to_target`` (``fedsga-edge report --target-acc``). Every figure is on the fleet's
virtual clock, a function of the seed: the host's speed changes how long the benchmark takes, not its table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

HERE = Path(__file__).resolve()
REPO = HERE.parent.parent
DEFAULT_FLEET = REPO / "fleets" / "mixed-bench.toml"


def _accuracy() -> ModuleType:
    """benchmarks/accuracy.py as a module (the one the tests load too, so its Preset is one class)."""
    mod = sys.modules.get("accuracy_bench")
    if mod is None:
        spec = importlib.util.spec_from_file_location("accuracy_bench", HERE.parent / "accuracy.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules["accuracy_bench"] = mod  # its dataclasses look their module up here
        spec.loader.exec_module(mod)
    return mod


acc = _accuracy()

# The deadline-aware variant of FedSGA (coordinator/strategies/fedsga.py): a row only when rounds have a deadline.
DEADLINE_METHOD = "fedsga-deadline"


def split_methods() -> list[str]:
    """FedAvg and every main method whose strategy trains a prefix on the device (not the whole model), in the
    registry's order: the strategy's own assignment decides, so a new split baseline joins with no edit here."""
    from fedsga_edge.config import RunConfig
    from fedsga_edge.coordinator.strategy import all_methods, get_strategy

    cfg, K = RunConfig(), 3
    out = []
    for method, (strategy, spec) in all_methods().items():  # the registry as it is now, not at import
        if spec.group != "main":
            continue
        assigned = get_strategy(strategy)(cfg, K, ["a", "b"], {k: 1 for k in range(K + 1)}).assign(1, ["a", "b"])
        if method == "fedavg" or all(k != 0 for k in assigned.values()):
            out.append(method)
    return out


# Scale per preset: accuracy.py's Preset (data, run options over its BENCH_RUN, evaluations) plus the fleet's
# target accuracy and round deadline (fleet seconds; 0: none).
PRESETS: dict[str, dict[str, Any]] = {
    # Digits (bundled), the 10 devices of fleets/mixed-bench.toml, 5 rounds (FedSGA calibrates in rounds 1 and 5),
    # width 0.125, one local epoch of batches of 16 with momentum 0.5 (static at p_ref: 67 % after round 1, 97 %
    # after round 5; at batch 64 and momentum 0 it was at 12 % after two rounds), every round evaluated on the
    # whole test set (360 images): ~40-50 CPU-seconds a run. The deadline of 5 s sits between the slow classes'
    # predicted rounds at p_1 (5.9 s on the Pi, 7.0 s on the phone: p_1's activations are the largest on their
    # slow uplinks) and at p_ref (4.5 s, 4.4 s): docs/fleet.md, "Deadline-aware splits".
    "small": {"preset": acc.Preset(data="digits", run=dict(width=0.125, clients=10, rounds=5, local_epochs=1,
                                                           batch_size=16, momentum=0.5),
                                   eval_every=1, eval_subset=0, seeds=[0], partitions=["iid"]),
              "target": 0.9, "deadline": 5.0},
    # accuracy.py's cifar regime (25,000 CIFAR-10 images, 14 rounds, width 0.125, momentum 0.5, server rate 0.015)
    # on the same fleet: ~12 CPU-minutes a run, so about 2 CPU-hours for the table. Accuracy between the
    # full evaluations (rounds 10, 12, 14) is on its 2,000-image subset every 2 rounds. No deadline by default: a
    # width-0.125 round's seconds on this fleet have not been measured; give one with --deadline.
    "cifar": {"preset": acc.PRESETS["cifar"], "target": 0.4, "deadline": 0.0, "seeds": [10], "partitions": ["iid"]},
}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="small")
    ap.add_argument("--fleet", type=Path, default=DEFAULT_FLEET,
                    help="Fleet file (docs/fleet.md); its counts must add up to the preset's clients (10).")
    ap.add_argument("--target", type=float, default=None,
                    help="Target test accuracy in (0, 1] (preset: small 0.9, cifar 0.4).")
    ap.add_argument("--deadline", type=float, default=None,
                    help="Round deadline in fleet seconds for every method (--round-timeout); 0 = none. With one, "
                         f"{DEADLINE_METHOD} runs too (preset: small 5, cifar 0).")
    ap.add_argument("--out", type=Path, default=None, help="Output folder (default benchmarks/records/fleet-<preset>).")
    ap.add_argument("--data", default=None, help="Dataset spec or .npz (accuracy.py's --data).")
    ap.add_argument("--data-root", default=None)
    ap.add_argument("--methods", default=None, help="Comma-separated (default: every split method, FedAvg and, "
                                                    f"with a deadline, {DEADLINE_METHOD}).")
    ap.add_argument("--seeds", default=None, help="Comma-separated seeds (preset: small 0, cifar 10).")
    ap.add_argument("--partitions", default=None, help="Comma-separated: iid, dirALPHA (preset: iid).")
    ap.add_argument("--rounds", type=int, default=None, help="Rounds per run (preset: small 5, cifar 14).")
    ap.add_argument("--width", type=float, default=None, help="ResNet width (preset: small 0.125, cifar 0.25).")
    ap.add_argument("--max-batches", type=int, default=None, help="Cap on batches per local epoch (tests).")
    ap.add_argument("--train-subset", type=int, default=None,
                    help="Train on this many samples, stratified (e.g. a CIFAR-10 subset that reaches a target in a "
                         "few rounds; preset: all).")
    ap.add_argument("--server-copies", choices=("shared", "per-client"), default=None,
                    help="The server side (preset: shared); per-client: a copy per device, where the split is a cost "
                         "choice only (the planner's regime, docs/fleet.md, \"Planning splits\").")
    ap.add_argument("--wire-formats", default=None,
                    help="Comma-separated wire formats (e.g. fp32,fp16,int8,int4): every method that does not set its "
                         "own format runs once per format, the whole fleet at it, in .../seed<s>/<format>; the "
                         "planner's reference is then the best (fixed split, format) pair per seed.")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0 = torch's default).")
    ap.add_argument("--tables-only", action="store_true", help="Run nothing: the table from the runs under --out.")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def resolve(args: argparse.Namespace) -> tuple[Any, float, float, dict[str, Any]]:
    """The accuracy.py Preset for this invocation, the target, the deadline and the run flags (simulate's names)."""
    spec = PRESETS[args.preset]
    base = spec["preset"]
    p = acc.Preset(**{k: (type(v)(v) if isinstance(v, (list, dict)) else v) for k, v in vars(base).items()})
    p.seeds = list(spec.get("seeds", p.seeds))
    p.partitions = list(spec.get("partitions", p.partitions))
    p.threads = args.threads
    if args.data is not None:
        p.data = args.data
    if args.seeds is not None:
        p.seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    if args.wire_formats is not None:
        p.wire_formats = acc.parse_wire_formats(args.wire_formats)
    if args.partitions is not None:
        p.partitions = [s.strip() for s in args.partitions.split(",") if s.strip()]
    for part in p.partitions:
        acc.parse_partition(part)
    target = spec["target"] if args.target is None else args.target
    deadline = spec["deadline"] if args.deadline is None else args.deadline
    if not 0 < target <= 1:
        raise SystemExit(f"--target must be an accuracy in (0, 1] (got {target})")
    if deadline < 0:
        raise SystemExit(f"--deadline must be >= 0 seconds (got {deadline})")
    if args.methods is not None:
        p.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = [m for m in p.methods if m not in acc.METHODS]
        if bad:
            raise SystemExit(f"--methods: unknown {bad}; valid: {', '.join(acc.METHODS)}")
        if DEADLINE_METHOD in p.methods and not deadline:
            raise SystemExit(f"--methods {DEADLINE_METHOD} needs a round deadline (--deadline SECONDS)")
    else:
        p.methods = split_methods() + ([DEADLINE_METHOD] if deadline else [])
    for key in ("rounds", "width", "max_batches", "train_subset", "server_copies"):
        if getattr(args, key) is not None:
            p.run[key] = getattr(args, key)
    if not p.seeds or not p.methods or not p.partitions:
        raise SystemExit("need at least one seed, one method and one partition")
    fleet = args.fleet.resolve()
    from fedsga_edge.fleet import FleetError, load_fleet

    try:
        size = load_fleet(fleet).size
    except FleetError as exc:
        raise SystemExit(str(exc)) from None
    clients = p.settings()["clients"]
    if size != clients:
        raise SystemExit(f"--fleet {fleet} has {size} devices; the {args.preset} preset runs {clients}")
    return p, target, deadline, {"fleet": str(fleet), "round_timeout": deadline}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    p, target, deadline, flags = resolve(args)
    out: Path = args.out or acc.records_dir(f"fleet-{args.preset}")
    spec = acc.data_spec(p.data)
    runs = acc.plan(p, spec, args.data_root, **flags)
    command = "python benchmarks/fleet.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    import torch

    threads_before = torch.get_num_threads()
    if p.threads > 0:
        torch.set_num_threads(p.threads)
    try:
        done = _run_all(args, p, out, spec, runs)
    finally:
        torch.set_num_threads(threads_before)
    rows = table_rows(out, runs, target)
    md = markdown(rows, target, deadline, Path(flags["fleet"]))
    paired = paired_planner(out, runs, target)
    md += ("\n" + paired_markdown(paired)) if paired else ""
    cpu_s = sum(r["cpu_s"] or 0.0 for r in rows)
    payload = {"command": command, "preset": args.preset, "target": target, "deadline_s": deadline,
               "fleet": flags["fleet"], "settings": p.settings() | flags, "seeds": p.seeds,
               "partitions": p.partitions, "rows": rows, "paired": paired, "cpu_s": cpu_s, "table": md}
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(payload, indent=2, default=str))
    (out / "tables.md").write_text(md + "\n")
    print(md)
    print(f"\n{done['ran']} runs done, {done['skipped']} skipped (summary.json existed); CPU seconds of all runs "
          f"{cpu_s:.0f}; results in {out / 'results.json'}")
    return payload | {"out": str(out), **done}


def _run_all(args: argparse.Namespace, p: Any, out: Path, spec: str, runs: list[dict[str, Any]]) -> dict[str, int]:
    """Every planned run not yet finished, with a progress bar (accuracy.py's ``run_one``)."""
    from tqdm import tqdm

    bundle = eval_set = None
    ran = skipped = 0
    bar = tqdm(runs, desc="fleet", unit="run", disable=args.no_progress, mininterval=2, file=sys.stderr)
    for r in bar:
        run_dir = out / r["dir"]
        bar.set_description_str(f"fleet {r['dir']}")
        if (run_dir / "summary.json").exists():
            _check_same(run_dir, r["config"])
            skipped += 1
            continue
        if args.tables_only:
            continue
        if bundle is None:
            from fedsga_edge.data import load_dataset

            acc.ensure_data(spec)
            bundle = load_dataset(spec, args.data_root)
            eval_set = acc.SubsetImages(bundle.test, acc.stratified(bundle.test.labels, p.eval_subset))
        summary = acc.run_one(r["config"], run_dir, bundle, p, eval_set, bar)
        ran += 1
        tqdm.write(f"{r['dir']}: final_acc {summary['final_acc']:.4f}  fleet {summary.get('fleet_s', 0):.1f} s  "
                   f"splits {summary['split_histogram']}  host {summary['wall_s']:.0f} s", file=sys.stderr)
    bar.close()
    return {"ran": ran, "skipped": skipped}


def _check_same(run_dir: Path, cfg: Any) -> None:
    """A finished run is reused only when it was made with this plan's settings (the fleet, the deadline...):
    accuracy.py's comparison of config.json with the plan."""
    differ = acc.record_differs(run_dir, cfg)
    if differ:
        raise SystemExit(f"{run_dir} was run with other settings ({'; '.join(differ)}); remove it or pick "
                         "another --out")


# -- the table ---------------------------------------------------------------------------------------
def table_rows(out: Path, runs: list[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """One row per (method, partition) over its seeds' finished runs: time to ``target`` (the report's
    ``seconds_to_target`` over its ``time_to_accuracy_curves``), seconds per round, bytes, FLOPs, accuracy."""
    from fedsga_edge.report.data import seconds_to_target, time_to_accuracy_curves
    from fedsga_edge.report.runs import load_run

    groups: dict[tuple[str, str | None, str], list[Any]] = {}
    for r in runs:
        run_dir = out / r["dir"]
        if not (run_dir / "summary.json").exists():
            continue
        run = load_run(run_dir)
        run.method, run.partition = r["method"], r["partition"]  # the plan's names (config.json may lack them)
        groups.setdefault((r["method"], r.get("swept"), r["partition"]), []).append(run)
    rows = []
    for (method, fmt, part), group in groups.items():
        _, hits = seconds_to_target(time_to_accuracy_curves(group), target)
        hit = hits[0] if hits else {"reached": 0, "n": len(group), "seconds": None, "rounds": None}
        records = [row for run in group for row in run.rows if isinstance(row.get("round"), int)]
        summaries = [run.summary or {} for run in group]
        slow = slowest_device(records)
        rows.append({
            "method": method, "wire_format": fmt, "partition": part, "seeds": len(group),
            "label": acc.LABELS.get(method, method) + (f", {fmt} (whole fleet)" if fmt else ""),
            "reached": hit["reached"], "seconds_to_target": hit["seconds"], "rounds_to_target": hit["rounds"],
            "round_s_median": _median([row["fleet_s"] for row in records if "fleet_s" in row]),
            "slowest_device": slow["device"], "slowest_class": slow["class"], "slowest_s_median": slow["median_s"],
            "bytes_per_round": _mean([row["bytes_up"] + row["bytes_down"] for row in records]),
            "client_flops_per_sample": _mean([s.get("client_flops_per_sample") for s in summaries]),
            "final_acc": _mean([s.get("final_acc") for s in summaries]),
            "fleet_s": _mean([s.get("fleet_s") for s in summaries]),
            "left_out": sum(len(row.get("failures") or {}) for row in records),
            "device_rounds": sum(len(row.get("timing") or {}) for row in records),
            "split_histogram": _histogram(summaries),
            "cpu_s": _sum([s.get("cpu_s") for s in summaries]),
        })
    return rows


# the planner's rows (with --wire-format auto: its own per-device formats) against the fixed splits and resource
PLANNERS, FIXED_SPLITS, RESOURCE = ("planner", "planner-auto"), ("static-p1", "static", "static-pK"), "resource"
SPLITFED = "static"  # static at p_ref: SplitFed, whose accuracy the planner's is compared with (at fp32)


def per_seed(out: Path, runs: list[dict[str, Any]], target: float) -> dict[tuple, dict[str, Any]]:
    """Each finished run, keyed (method, swept format or None, partition, seed): its fleet seconds and round at
    ``target`` (None when not reached), its accuracy per evaluated round and its final accuracy."""
    from fedsga_edge.report.data import time_to_accuracy_curves
    from fedsga_edge.report.runs import load_run

    found = {}
    for r in runs:
        if not (out / r["dir"] / "summary.json").exists():
            continue
        run = load_run(out / r["dir"])
        curve = time_to_accuracy_curves([run])[0]["seeds"][0]
        i = next((i for i, a in enumerate(curve["acc"]) if a >= target - 1e-12), None)
        found[(r["method"], r.get("swept"), r["partition"], r["seed"])] = {
            "seconds": None if i is None else curve["seconds"][i], "round": None if i is None else curve["rounds"][i],
            "acc": dict(zip(curve["rounds"], curve["acc"])), "final_acc": (run.summary or {}).get("final_acc")}
    return found


def _fastest(found: dict[tuple, dict[str, Any]], methods: tuple[str, ...], part: str, seed: int
             ) -> tuple[float | None, str | None]:
    """The least seconds to target among ``methods`` at every format run for (part, seed), and which pair it was."""
    hits = [(v["seconds"], m + (f" {f}" if f else "")) for (m, f, pt, sd), v in found.items()
            if m in methods and pt == part and sd == seed and v["seconds"] is not None]
    return min(hits) if hits else (None, None)


def paired_planner(out: Path, runs: list[dict[str, Any]], target: float) -> list[dict[str, Any]]:
    """Per planner method, partition and seed where it ran: its fleet seconds to ``target`` over the best fixed
    split's (that seed's fastest (split, fleet-wide format) pair among static at p_1, p_ref, p_K at every format
    run) and over ``resource``'s (at its fastest format), the same seed's runs (None where a run is missing or
    did not reach the target); and its accuracy at the round it reached the target and at the end beside SplitFed's
    (static at p_ref, fp32) at the same rounds."""
    found = per_seed(out, runs, target)
    rows = []
    for (method, fmt, part, seed), mine in sorted(found.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][3])):
        if method not in PLANNERS or fmt not in (None, "fp32"):
            continue
        planned = mine["seconds"]
        best, best_pair = _fastest(found, FIXED_SPLITS, part, seed)
        res, res_pair = _fastest(found, (RESOURCE,), part, seed)
        sf = found.get((SPLITFED, None, part, seed)) or found.get((SPLITFED, "fp32", part, seed)) or {}
        rows.append({"method": method, "partition": part, "seed": seed, "planner_s": planned,
                     "best_fixed_s": best, "best_fixed": best_pair, "resource_s": res, "resource": res_pair,
                     "vs_best_fixed": planned / best if planned and best else None,
                     "vs_resource": planned / res if planned and res else None,
                     "target_round": mine["round"], "acc_at_target": mine["acc"].get(mine["round"]),
                     "splitfed_acc_at_target": (sf.get("acc") or {}).get(mine["round"]),
                     "final_acc": mine["final_acc"], "splitfed_final_acc": sf.get("final_acc")})
    return rows


def paired_markdown(rows: list[dict[str, Any]]) -> str:
    """The planner's paired ratios, one line per seed and their geometric mean, then its accuracy beside
    SplitFed's (empty without planner runs)."""
    if not rows:
        return ""
    out = ["**The planner against the best fixed split and `resource`** (fleet seconds to target, paired by seed; "
           "the best fixed split is that seed's fastest (split, wire format) pair among the runs, `resource` at its "
           "fastest format; accuracy (%) at the round the planner reached the target and at the end, beside "
           "SplitFed's (static p_ref, fp32) at the same rounds)", "",
           "| method | partition | seed | planner s | best fixed split s (pair) | resource s (format) "
           "| planner / best fixed | planner / resource | target round | acc there: planner / SplitFed "
           "| final acc: planner / SplitFed |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def pct(a: float | None, b: float | None) -> str:
        return f"{_cell(None if a is None else 100 * a, '.1f')} / {_cell(None if b is None else 100 * b, '.1f')}"

    for r in rows:
        out.append(f"| {r['method']} | {r['partition']} | {r['seed']} | {_cell(r['planner_s'], '.1f')} "
                   f"| {_cell(r['best_fixed_s'], '.1f')} ({r['best_fixed'] or '—'}) "
                   f"| {_cell(r['resource_s'], '.1f')} ({r['resource'] or '—'}) | {_cell(r['vs_best_fixed'], '.2f')} "
                   f"| {_cell(r['vs_resource'], '.2f')} | {r['target_round'] or '—'} "
                   f"| {pct(r['acc_at_target'], r['splitfed_acc_at_target'])} "
                   f"| {pct(r['final_acc'], r['splitfed_final_acc'])} |")
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        for key in ("vs_best_fixed", "vs_resource"):
            vals = [r[key] for r in mine if r[key] is not None]
            if vals:
                out.append(f"\n{method} {key.replace('_', ' ')}: geometric mean "
                           f"{float(np.exp(np.mean(np.log(vals)))):.2f} over {len(vals)} seed(s)")
        diffs = [100 * (r["final_acc"] - r["splitfed_final_acc"]) for r in mine
                 if r["final_acc"] is not None and r["splitfed_final_acc"] is not None]
        sf = [100 * r["splitfed_final_acc"] for r in mine if r["splitfed_final_acc"] is not None]
        if diffs:
            out.append(f"\n{method} final accuracy minus SplitFed's, paired: {np.mean(diffs):+.1f} points (seeds "
                       f"{', '.join(f'{d:+.1f}' for d in diffs)}); SplitFed's own spread over these seeds "
                       f"{min(sf):.1f}-{max(sf):.1f} %")
    return "\n".join(out) + "\n"


def slowest_device(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The device whose median round seconds (its own compute and wire, no waiting; rounds it took part in) is
    the largest: the fleet's straggler under this method."""
    per: dict[str, list[float]] = {}
    cls: dict[str, Any] = {}
    for row in records:
        for cid, t in (row.get("timing") or {}).items():
            if isinstance(t, dict) and not t.get("missed"):
                per.setdefault(cid, []).append(float(t.get("compute_s", 0.0)) + float(t.get("wire_s", 0.0)))
                cls[cid] = t.get("class")
    if not per:
        return {"device": None, "class": None, "median_s": None}
    cid = max(sorted(per), key=lambda c: float(np.median(per[c])))
    return {"device": cid, "class": cls[cid], "median_s": float(np.median(per[cid]))}


def _median(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def _mean(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(np.mean(vals)) if vals else None


def _sum(values: list[Any]) -> float | None:
    vals = [v for v in values if v is not None]
    return float(sum(vals)) if vals else None


def _histogram(summaries: list[dict[str, Any]]) -> dict[str, int]:
    hist: dict[str, int] = {}
    for s in summaries:
        for k, v in (s.get("split_histogram") or {}).items():
            hist[k] = hist.get(k, 0) + int(v)
    return dict(sorted(hist.items()))


def _cell(value: float | None, fmt: str) -> str:
    return "—" if value is None else format(value, fmt)


def markdown(rows: list[dict[str, Any]], target: float, deadline: float, fleet: Path) -> str:
    """The time-to-accuracy table, one per partition."""
    out: list[str] = []
    for part in dict.fromkeys(r["partition"] for r in rows):
        out.append(f"**Time to {100 * target:g} % test accuracy on {fleet.name}** ({acc.partition_label(part)}; "
                   f"{'round deadline ' + format(deadline, 'g') + ' s' if deadline else 'no round deadline'}; fleet "
                   "seconds on the virtual clock; means over seeds, time to target over the seeds that reached it)")
        out.append("")
        out.append("| Method | rounds to target | fleet s to target | s/round (median) | slowest device: s/round "
                   "(median) | MB/round | client MFLOPs/sample | final acc (%) | device-rounds left out | splits "
                   "(k: device-rounds) |")
        out.append("|---|---:|---:|---:|---|---:|---:|---:|---:|---|")
        for r in (r for r in rows if r["partition"] == part):
            if r["reached"]:
                partial = f" ({r['reached']}/{r['seeds']} seeds)" if r["reached"] < r["seeds"] else ""
                rounds, secs = f"{r['rounds_to_target']:g}{partial}", f"{r['seconds_to_target']:.1f}{partial}"
            else:
                rounds = secs = "not reached"
            slow = (f"{r['slowest_s_median']:.2f} ({r['slowest_device']}, {r['slowest_class']})"
                    if r["slowest_s_median"] is not None else "—")
            mb = None if r["bytes_per_round"] is None else r["bytes_per_round"] / 1e6
            mflops = None if r["client_flops_per_sample"] is None else r["client_flops_per_sample"] / 1e6
            final = None if r["final_acc"] is None else 100 * r["final_acc"]
            splits = " ".join(f"{'full' if k == '0' else k}:{v}" for k, v in r["split_histogram"].items())
            out.append(f"| {r['label']} | {rounds} | {secs} | {_cell(r['round_s_median'], '.2f')} | {slow} "
                       f"| {_cell(mb, '.2f')} | {_cell(mflops, '.2f')} | {_cell(final, '.2f')} "
                       f"| {r['left_out']} of {r['device_rounds']} | {splits} |")
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    main()
