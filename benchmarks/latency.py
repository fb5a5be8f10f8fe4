"""Latency per split depth: onnxruntime vs torch eager, batch 1 and 32, 1 and 2 threads.

Each (runtime, threads) pair is profiled in its own process: the two runtimes' thread pools
interfere when they share one. The floor of each prefix is its forward FLOPs divided by the peak
fp32 matmul FLOP/s this machine reaches with that many threads (torch.mm on 1024 x 1024, best of
40 runs, in its own process too).

    python benchmarks/latency.py --model resnet18_cifar --out runs/latency \
        [--width 1.0] [--int8 --calib-data digits] [--batches 1,32] [--threads 1,2] [--iters 30] \
        [--results benchmarks/RESULTS.md]

With ``--results`` the markdown table replaces the section "### Latency per split depth"
of that file (other sections are left as they are).

``--train`` measures one local training step instead, side by side: the torch-free device
step (``PrefixRunner.train_forward`` + ``train_step``: onnxruntime + numpy SGD) against torch eager
(forward + backward + SGD on the same prefix), per width and split, at the same batch and threads::

    python benchmarks/latency.py --train --model resnet18_cifar --widths 0.25,1.0 --batches 32 \
        --threads 1 --rounds 3 --iters 10 --out runs/train_latency

Both runtimes run in processes of their own, alternating ``--rounds`` times (the order flips each
round) so that load from other jobs falls on both; every timed step of every round is pooled and
the table gives p50s and onnx / torch (below 1: the torch-free step is faster).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

SECTION = "### Latency per split depth"
HERE = Path(__file__).resolve()


def _ints(text: str) -> list[int]:
    return [int(s) for s in text.split(",") if s.strip()]


def peak_matmul_flops(threads: int, n: int = 1024, repeats: int = 40) -> float:
    """Best fp32 torch.mm FLOP/s with ``threads`` threads (run in a process of its own).

    Best of many short runs: on a shared machine the best one is the least disturbed.
    """
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    for _ in range(3):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _train_inputs(manifest: dict, entry: dict, batch: int):
    import numpy as np

    rng = np.random.default_rng(0)
    _, c, h, w = manifest["input"]["shape"]
    x = rng.standard_normal((batch, c, h, w), dtype=np.float32)
    prompts = rng.standard_normal(tuple(entry["inputs"]["prompts"]), dtype=np.float32)
    dz = 1e-3 * rng.standard_normal((batch, *entry["activation"]["shape"]), dtype=np.float32)
    return x, prompts, dz


def train_worker(args: argparse.Namespace) -> dict:
    """Timed training steps of every split with train graphs: {split: {batch: {step, fwd, bwd}}} in s."""
    manifest = json.loads((Path(args.artifacts) / "manifest.json").read_text())
    out: dict = {}
    for entry in [p for p in manifest["prefixes"] if p.get("train")]:
        for batch in _ints(args.batches):
            out.setdefault(str(entry["split"]), {})[str(batch)] = _time_train(args, manifest, entry, batch)
    if args.worker == "train-onnxruntime":
        assert "torch" not in sys.modules, "the onnxruntime worker must not import torch"
    return out


def _time_train(args: argparse.Namespace, manifest: dict, entry: dict, batch: int) -> dict[str, list[float]]:
    """onnxruntime: ``train_forward`` then ``train_step`` (what a device runs around one server round
    trip); torch: forward, ``backward(dz)``, SGD step on the prefix's blocks (the prompts get their
    gradient too, as on the device). Same lr, no momentum, BN statistics updated in both."""
    x, prompts, dz = _train_inputs(manifest, entry, batch)
    lr = 1e-3
    if args.worker == "train-onnxruntime":
        from fedsga_edge.device.runtime import PrefixRunner

        runner = PrefixRunner(args.artifacts, entry["split"], threads=args.worker_threads)
        runner.train_sessions()

        def fwd() -> None:
            runner.train_forward(x, prompts)

        def bwd() -> None:
            runner.train_step(x, dz, prompts, lr=lr)

    else:
        import torch

        from fedsga_edge.models import create_model

        torch.set_num_threads(args.worker_threads)
        info = manifest["model"]
        kw = {"num_classes": info["num_classes"], "img_size": info["img_size"], "width": info.get("width")}
        model = create_model(info["arch"], **{k: v for k, v in kw.items() if v is not None}).train()
        depth = entry["depth"]
        opt = torch.optim.SGD([q for j in range(depth) for q in model.blocks[j].parameters()], lr=lr)
        xt, dzt = torch.from_numpy(x), torch.from_numpy(dz)
        pt = torch.from_numpy(prompts).clone().requires_grad_(True)
        held: dict = {}

        def fwd() -> None:
            opt.zero_grad(set_to_none=True)
            pt.grad = None
            held["z"] = model.prefix(xt, depth, pt)

        def bwd() -> None:
            held.pop("z").backward(dzt)
            opt.step()

    times: dict[str, list[float]] = {"step": [], "fwd": [], "bwd": []}
    for i in range(args.warmup + args.iters):
        t0 = time.perf_counter()
        fwd()
        t1 = time.perf_counter()
        bwd()
        t2 = time.perf_counter()
        if i >= args.warmup:
            times["step"].append(t2 - t0)
            times["fwd"].append(t1 - t0)
            times["bwd"].append(t2 - t1)
    return times


def worker(args: argparse.Namespace) -> None:
    """One (runtime, threads) measurement, written as JSON to args.json."""
    if args.worker.startswith("train-"):
        Path(args.json).write_text(json.dumps(train_worker(args)))
        return
    if args.worker == "peak":
        result = {"threads": args.worker_threads, "flops_per_s": peak_matmul_flops(args.worker_threads)}
    else:
        from fedsga_edge.device.profile import profile_artifacts

        variants = ("fp32", "int8") if args.worker == "onnxruntime" else ("fp32",)
        result = profile_artifacts(
            args.artifacts,
            runtime=args.worker,
            batches=_ints(args.batches),
            threads=args.worker_threads,
            warmup=args.warmup,
            iters=args.iters,
            variants=variants,
            train=False,
        )
        if args.worker == "onnxruntime":
            assert "torch" not in sys.modules, "the onnxruntime worker must not import torch"
    Path(args.json).write_text(json.dumps(result))


def _sub(kind: str, threads: int, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"{kind}_t{threads}.json"
    cmd = [
        sys.executable,
        str(HERE),
        "--worker",
        kind,
        "--worker-threads",
        str(threads),
        "--json",
        str(out),
        "--artifacts",
        str(args.artifacts),
        "--batches",
        args.batches,
        "--warmup",
        str(args.warmup),
        "--iters",
        str(args.iters),
    ]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def _fmt_ms(v: float | None) -> str:
    return "-" if v is None else (f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 100 else f"{v:.0f}")


def _p50(runs: dict, runtime: str, variant: str, split: int, batch: int, threads: int) -> float | None:
    for r in runs[(runtime, threads)]["results"]:
        if r["split"] == split and r["batch"] == batch and r["variant"] == variant:
            return r["latency_ms"]["p50"]
    return None


def _contention_note(args: argparse.Namespace, dev: dict, peaks: dict[int, float]) -> list[str]:
    """Says so when the machine was oversubscribed: then more threads measure slower, not faster."""
    load = float(args.load.split(" / ")[0])
    cores = dev.get("affinity_cores") or dev["cores_logical"]
    worse = len(peaks) > 1 and peaks[max(peaks)] < peaks[min(peaks)]
    if load < cores and not worse:
        return []
    return [
        f"**Oversubscribed run**: load average {load:.1f} on {cores} cores"
        + (f", and {max(peaks)} threads reached a lower matmul peak than {min(peaks)}" if worse else "")
        + ". Other jobs held the cores, so the multi-thread rows show contention (OpenMP / thread-pool spin-waits),"
        " not scaling; single-thread rows are the more reliable ones. Rerun on an idle device for thread scaling.",
        "",
    ]


def _peak_text(peaks: dict[int, float]) -> str:
    """The machine's measured matmul peak per thread count, for the tables' header line."""
    return ", ".join(f"{t} thread{'s' if t > 1 else ''}: {peaks[t] / 1e9:.1f} GFLOP/s" for t in sorted(peaks))


def markdown(args: argparse.Namespace, manifest: dict, runs: dict, peaks: dict[int, float], command: str) -> str:
    dev = runs[("onnxruntime", _ints(args.threads)[0])]["device"]
    torch_dev = runs[("torch", _ints(args.threads)[0])]["device"]
    m = manifest["model"]
    peak_text = _peak_text(peaks)
    lines = [
        SECTION,
        "",
        f"Command: `{command}`",
        "",
        (
            f"Machine: {dev['cpu']}, {dev['cores_logical']} logical cores ({dev.get('affinity_cores', '?')} usable), "
            f"{dev['os']}; onnxruntime {dev['onnxruntime']} (CPUExecutionProvider), torch {torch_dev['torch']} eager. "
            f"Load average at start: {args.load}. Shared machine: other jobs ran at the same time, so treat "
            f"differences under ~15% as noise."
        ),
        "",
        (
            f"Model: {m['arch']} width {m['width']} at {m['img_size']} px, m = {m['prompts_m']} prompts; random "
            f"weights (latency does not depend on the values). p50 of {args.iters} runs after {args.warmup} warm-up "
            f"runs, in ms per batch. Floor = FLOPs / peak fp32 matmul FLOP/s with the same threads ({peak_text}). "
            "ORT eff. = floor / ORT fp32 time (above 100% means the peak measurement itself was disturbed by other jobs)."
        ),
        "",
        *_contention_note(args, dev, peaks),
        (
            "| k | depth | FLOPs/sample | z bytes/sample fp32 | batch | threads | ORT fp32 | ORT int8 | torch eager | "
            "ORT vs torch | int8 vs fp32 | floor | ORT eff. |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in manifest["prefixes"]:
        for batch in _ints(args.batches):
            for threads in _ints(args.threads):
                key = (p["split"], batch, threads)
                ort32, ort8 = _p50(runs, "onnxruntime", "fp32", *key), _p50(runs, "onnxruntime", "int8", *key)
                eager = _p50(runs, "torch", "fp32", *key)
                floor = 1e3 * p["flops_per_sample"] * batch / peaks[threads]
                lines.append(
                    f"| {p['split']} | {p['depth']} | {p['flops_per_sample'] / 1e6:.1f}M | "
                    f"{p['activation']['bytes_per_sample']['fp32']:,} | {batch} | {threads} | {_fmt_ms(ort32)} | "
                    f"{_fmt_ms(ort8)} | {_fmt_ms(eager)} | "
                    f"{'-' if not (ort32 and eager) else f'{eager / ort32:.2f}x'} | "
                    f"{'-' if not (ort32 and ort8) else f'{ort32 / ort8:.2f}x'} | {_fmt_ms(floor)} | "
                    f"{'-' if not ort32 else f'{100 * floor / ort32:.0f}%'} |"
                )
    return "\n".join(lines) + "\n"


def write_section(path: Path, text: str, heading: str = SECTION) -> None:
    """Replaces the section ``heading`` of RESULTS.md (up to the next heading of its level or above), or appends it."""
    body = path.read_text() if path.exists() else "# Results\n"
    start = body.find(heading)
    if start < 0:
        body = body.rstrip("\n") + "\n\n" + text
    else:
        level = len(heading) - len(heading.lstrip("#"))
        nxt = re.search(r"\n#{1,%d} " % level, body[start + len(heading):])
        body = body[:start] + text + ("" if nxt is None else body[start + len(heading) + nxt.start():])
    path.write_text(body)


def _export(args: argparse.Namespace, out: Path, width: float | None, train: bool = False) -> Path:
    cmd = [sys.executable, "-m", "fedsga_edge.cli.main", "export", "--model", args.model, "--out", str(out)]
    if width is not None:
        cmd += ["--width", str(width)]
    if args.img_size is not None:
        cmd += ["--img-size", str(args.img_size)]
    if train:
        cmd += ["--train"]
    elif args.int8:
        cmd += ["--int8", "--calib-data", args.calib_data]
    subprocess.run(cmd, check=True)
    return out


def _median_ms(values: list[float]) -> float:
    v = sorted(values)
    n = len(v)
    return 1e3 * (v[n // 2] if n % 2 else 0.5 * (v[n // 2 - 1] + v[n // 2]))


def train_main(args: argparse.Namespace, command: str) -> None:
    """--train: per width, alternate onnxruntime / torch worker processes, pool their step times."""
    widths: list[float | None] = [float(w) for w in args.widths.split(",")] if args.widths else [args.width]
    if args.artifacts is not None and len(widths) > 1:
        raise SystemExit("--artifacts serves one width: drop --widths or --artifacts")
    threads = _ints(args.threads)
    peaks = {t: _sub("peak", t, args, args.out)["flops_per_s"] for t in threads}
    rows = []
    raw: dict = {}
    for width in widths:
        art = args.artifacts or _export(args, args.out / f"artifacts_w{width}", width, train=True)
        args.artifacts = art
        manifest = json.loads((Path(art) / "manifest.json").read_text())
        width = manifest["model"].get("width", width)
        for t in threads:
            pooled: dict[str, dict] = {"train-onnxruntime": {}, "train-torch": {}}
            for r in range(args.rounds):
                order = ["train-onnxruntime", "train-torch"][:: 1 if r % 2 == 0 else -1]
                for kind in order:
                    print(f"[latency --train] width {width}, {t} thread(s), round {r + 1}: {kind}", flush=True)
                    got = _sub(kind, t, args, args.out)
                    for split, per_batch in got.items():
                        for batch, times in per_batch.items():
                            slot = pooled[kind].setdefault((int(split), int(batch)), {"step": [], "fwd": [], "bwd": []})
                            for key in slot:
                                slot[key] += times[key]
            raw[f"w{width}_t{t}"] = {k: {f"{s}/{b}": v for (s, b), v in d.items()} for k, d in pooled.items()}
            for p in manifest["prefixes"]:
                for batch in _ints(args.batches):
                    o = pooled["train-onnxruntime"].get((p["split"], batch))
                    tt = pooled["train-torch"].get((p["split"], batch))
                    if not o or not tt:
                        continue
                    floor = 1e3 * (p.get("flops_train_per_sample") or 0) * batch / peaks[t]
                    rows.append(
                        (
                            width,
                            p,
                            batch,
                            t,
                            *(_median_ms(d[k]) for d, k in ((tt, "step"), (o, "step"), (o, "fwd"), (o, "bwd"))),
                            floor,
                        )
                    )
        args.artifacts = None if args.widths else args.artifacts
    text = train_markdown(args, rows, peaks, command)
    (args.out / "train_latency.md").write_text(text)
    (args.out / "train_latency.json").write_text(json.dumps({"peaks": peaks, "raw_s": raw, "host": platform.node()}))
    print(text)
    if args.results:
        write_section(args.results, text, TRAIN_SECTION)


TRAIN_SECTION = "### Torch-free training step vs torch"


def train_markdown(args: argparse.Namespace, rows: list, peaks: dict[int, float], command: str) -> str:
    import onnxruntime
    import torch
    from fedsga_edge.device.profile import device_info

    dev = device_info("onnxruntime", 1)
    peak_text = _peak_text(peaks)
    lines = [
        TRAIN_SECTION,
        "",
        f"Command: `{command}`",
        "",
        (
            f"Machine: {dev['cpu']}, {dev['cores_logical']} logical cores ({dev.get('affinity_cores', '?')} usable); onnxruntime "
            f"{onnxruntime.__version__} (CPUExecutionProvider) + numpy SGD, torch {torch.__version__} eager. "
            f"Load average at start: {args.load}. One step = `PrefixRunner.train_forward` + `train_step` (ONNX) or "
            "forward + `backward(dz)` + `SGD.step` (torch), BN statistics updated in both. p50 over "
            f"{args.rounds} alternating rounds x {args.iters} steps (after {args.warmup} warm-up steps per round), "
            f"in ms per batch. Floor = training FLOPs / peak fp32 matmul FLOP/s ({peak_text}); eff. = floor / time."
        ),
        "",
        "| width | k | depth | batch | threads | torch step | ONNX step | ONNX / torch | ONNX fwd | ONNX bwd+SGD | floor | torch eff. | ONNX eff. |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for width, p, batch, t, torch_ms, onnx_ms, fwd_ms, bwd_ms, floor in rows:
        lines.append(
            f"| {width} | {p['split']} | {p['depth']} | {batch} | {t} | {_fmt_ms(torch_ms)} | {_fmt_ms(onnx_ms)} | "
            f"**{onnx_ms / torch_ms:.2f}** | {_fmt_ms(fwd_ms)} | {_fmt_ms(bwd_ms)} | {_fmt_ms(floor) if floor else '-'} | "
            f"{f'{100 * floor / torch_ms:.0f}%' if floor else '-'} | {f'{100 * floor / onnx_ms:.0f}%' if floor else '-'} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="resnet18_cifar")
    ap.add_argument("--width", type=float, default=None)
    ap.add_argument("--img-size", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path("runs/latency"))
    ap.add_argument("--artifacts", type=Path, default=None, help="Use this export instead of making one.")
    ap.add_argument("--int8", action="store_true")
    ap.add_argument("--calib-data", default="digits")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--results", type=Path, default=None)
    ap.add_argument("--train", action="store_true", help="Time one training step, torch-free ONNX vs torch.")
    ap.add_argument("--widths", default=None, help="--train: comma-separated widths, one export each.")
    ap.add_argument("--rounds", type=int, default=3, help="--train: alternating worker rounds per runtime.")
    ap.add_argument(
        "--worker", choices=("onnxruntime", "torch", "peak", "train-onnxruntime", "train-torch"), help=argparse.SUPPRESS
    )
    ap.add_argument("--worker-threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    command = "python benchmarks/latency.py " + " ".join(sys.argv[1:])
    args.load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    args.out.mkdir(parents=True, exist_ok=True)
    if args.train:
        train_main(args, command)
        return
    if args.artifacts is None:
        args.artifacts = args.out / "artifacts"
        cmd = [
            sys.executable,
            "-m",
            "fedsga_edge.cli.main",
            "export",
            "--model",
            args.model,
            "--out",
            str(args.artifacts),
        ]
        if args.width is not None:
            cmd += ["--width", str(args.width)]
        if args.img_size is not None:
            cmd += ["--img-size", str(args.img_size)]
        if args.int8:
            cmd += ["--int8", "--calib-data", args.calib_data]
        subprocess.run(cmd, check=True)
    manifest = json.loads((args.artifacts / "manifest.json").read_text())
    peaks = {t: _sub("peak", t, args, args.out)["flops_per_s"] for t in _ints(args.threads)}
    runs = {}
    for runtime in ("onnxruntime", "torch"):
        for threads in _ints(args.threads):
            print(f"[latency] {runtime}, {threads} thread(s)...", flush=True)
            runs[(runtime, threads)] = _sub(runtime, threads, args, args.out)
    text = markdown(args, manifest, runs, peaks, command)
    (args.out / "latency.md").write_text(text)
    (args.out / "latency.json").write_text(
        json.dumps({"peaks": peaks, "runs": {f"{r}_t{t}": v for (r, t), v in runs.items()}, "host": platform.node()})
    )
    print(text)
    if args.results:
        write_section(args.results, text)


if __name__ == "__main__":
    main()
