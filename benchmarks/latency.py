"""Latency per split depth: onnxruntime vs torch eager, batch 1 and 32, 1 and 2 threads (issue 4).

Each (runtime, threads) pair is profiled in its own process: the two runtimes' thread pools
interfere when they share one. The floor of each prefix is its forward FLOPs divided by the peak
fp32 matmul FLOP/s this machine reaches with that many threads (torch.mm on 1024 x 1024, best of
40 runs, in its own process too).

    python benchmarks/latency.py --model resnet18_cifar --out runs/latency \
        [--width 1.0] [--int8 --calib-data digits] [--batches 1,32] [--threads 1,2] [--iters 30] \
        [--results benchmarks/RESULTS.md]

With ``--results`` the markdown table replaces the section "## Latency per split depth (issue 4)"
of that file (other sections are left as they are).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

SECTION = "## Latency per split depth (issue 4)"
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


def worker(args: argparse.Namespace) -> None:
    """One (runtime, threads) measurement, written as JSON to args.json."""
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


def markdown(args: argparse.Namespace, manifest: dict, runs: dict, peaks: dict[int, float], command: str) -> str:
    dev = runs[("onnxruntime", _ints(args.threads)[0])]["device"]
    torch_dev = runs[("torch", _ints(args.threads)[0])]["device"]
    m = manifest["model"]
    peak_text = ", ".join(f"{t} thread{'s' if t > 1 else ''}: {peaks[t] / 1e9:.1f} GFLOP/s" for t in sorted(peaks))
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
    """Replaces the section ``heading`` of RESULTS.md (up to the next '## ' heading), or appends it."""
    body = path.read_text() if path.exists() else "# Benchmark results\n"
    start = body.find(heading)
    if start < 0:
        body = body.rstrip("\n") + "\n\n" + text
    else:
        nxt = body.find("\n## ", start + len(heading))
        body = body[:start] + text + ("" if nxt < 0 else "\n" + body[nxt + 1 :])
    path.write_text(body)


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
    ap.add_argument("--worker", choices=("onnxruntime", "torch", "peak"), help=argparse.SUPPRESS)
    ap.add_argument("--worker-threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return

    command = "python benchmarks/latency.py " + " ".join(sys.argv[1:])
    args.load = " / ".join(f"{x:.1f}" for x in os.getloadavg())
    args.out.mkdir(parents=True, exist_ok=True)
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
