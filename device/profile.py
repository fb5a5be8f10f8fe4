"""What each split depth costs on this device: latency, throughput, memory, FLOPs, wire bytes.

Pure functions that return data (the CLI formats it). The onnxruntime path imports no torch; the
torch path (eager, same model rebuilt from the manifest with random weights: latency does not
depend on the values) imports it inside the functions that need it.

Memory: ``rss_peak_mb`` is the largest resident set size of this process sampled every
millisecond while the split's session is created and run (the process total, including what
was loaded before); ``rss_delta_mb`` is that peak minus the RSS just before the session was
created, i.e. what this split added. Sampling can miss a spike shorter than a millisecond.
"""

from __future__ import annotations

import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .runtime import ArtifactError, PrefixRunner, load_manifest

__all__ = ["RUNTIMES", "device_info", "latency_stats", "peak_rss_during", "profile_artifacts", "time_calls"]

RUNTIMES = ("onnxruntime", "torch")


def _cpu_model() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    # x86: "model name"; Raspberry Pi / Jetson (arm64): "Model" or "Hardware", else the CPU part.
    for key in ("model name", "Model", "Hardware", "cpu model", "CPU part"):
        if fields.get(key):
            return fields[key]
    return platform.processor() or platform.machine()


def device_info(runtime: str, threads: int | None) -> dict[str, Any]:
    import psutil

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "machine": platform.machine(),
        "cores_logical": psutil.cpu_count(logical=True) or os.cpu_count(),
        "cores_physical": psutil.cpu_count(logical=False),
        "memory_gb": round(psutil.virtual_memory().total / 2**30, 2),
        "os": platform.platform(),
        "python": platform.python_version(),
        "runtime": runtime,
        "threads": threads,
    }
    try:
        info["affinity_cores"] = len(os.sched_getaffinity(0))
    except AttributeError:  # not on macOS
        pass
    if runtime == "onnxruntime":
        import onnxruntime as ort

        info["onnxruntime"] = ort.__version__
        info["execution_provider"] = "CPUExecutionProvider"
        info["providers_available"] = ort.get_available_providers()
    else:
        import torch

        info["torch"] = torch.__version__
        info["execution_provider"] = "torch eager (CPU)"
        info["torch_threads"] = torch.get_num_threads()
    return info


def latency_stats(seconds: Sequence[float], batch: int) -> dict[str, float]:
    """min / mean / p50 / p90 / p99 / max in ms, coefficient of variation, samples per second."""
    t = np.asarray(seconds, dtype=np.float64) * 1e3
    mean = float(t.mean())
    return {
        "min": float(t.min()),
        "mean": mean,
        "p50": float(np.percentile(t, 50)),
        "p90": float(np.percentile(t, 90)),
        "p99": float(np.percentile(t, 99)),
        "max": float(t.max()),
        "cv": float(t.std() / mean) if mean > 0 else 0.0,
        "n": int(t.size),
        "throughput_sps": 1e3 * batch / mean if mean > 0 else 0.0,
    }


def time_calls(fn: Callable[[], Any], *, warmup: int, iters: int | None, duration: float | None) -> list[float]:
    """Runs ``fn`` ``warmup`` times untimed, then ``iters`` times (or for ``duration`` s, >= 3 runs)."""
    for _ in range(warmup):
        fn()
    times: list[float] = []
    end = time.perf_counter() + duration if duration else None
    while True:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if end is not None:
            if time.perf_counter() >= end and len(times) >= 3:
                return times
        elif len(times) >= max(1, iters or 1):
            return times


class peak_rss_during:
    """Samples this process's RSS every ``interval`` s; ``.peak`` and ``.before`` in bytes."""

    def __init__(self, interval: float = 0.001) -> None:
        import psutil

        self._proc = psutil.Process()
        self._interval = interval
        self._stop = threading.Event()
        self.before = self.peak = 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self._stop.wait(self._interval)

    def __enter__(self) -> peak_rss_during:
        self.before = self.peak = self._proc.memory_info().rss
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss)


def _inputs(manifest: dict[str, Any], entry: dict[str, Any], batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    _, c, h, w = manifest["input"]["shape"]
    x = rng.standard_normal((batch, c, h, w), dtype=np.float32)
    prompts = rng.standard_normal(tuple(entry["inputs"]["prompts"]), dtype=np.float32)
    dz = rng.standard_normal((batch, *entry["activation"]["shape"]), dtype=np.float32)
    return x, prompts, dz


def _profile_onnx(art: Path, manifest, entry, variant, batch, threads, warmup, iters, duration, train) -> dict:
    x, prompts, dz = _inputs(manifest, entry, batch)
    with peak_rss_during() as mem:
        runner = PrefixRunner(art, entry["split"], variant=variant, threads=threads)
        t = time.perf_counter()
        runner.session()
        create = time.perf_counter() - t
        times = time_calls(lambda: runner.forward(x, prompts), warmup=warmup, iters=iters, duration=duration)
    out: dict[str, Any] = {
        "session_create_s": create,
        "latency_ms": latency_stats(times, batch),
        "rss_peak_mb": mem.peak / 2**20,
        "rss_delta_mb": (mem.peak - mem.before) / 2**20,
    }
    if train and runner.trainable and variant == "fp32":
        t = time.perf_counter()
        runner.train_sessions()
        out["train_session_create_s"] = time.perf_counter() - t

        def step() -> None:
            runner.train_forward(x, prompts, update_stats=False)
            runner.train_step(x, dz, prompts, lr=0.0)

        n = max(3, (iters or 20) // 5)
        ttimes = time_calls(step, warmup=min(warmup, 2), iters=n, duration=duration / 5 if duration else None)
        out["train_step_ms"] = latency_stats(ttimes, batch)
    return out


def _profile_torch(manifest, entry, batch, threads, warmup, iters, duration, train) -> dict:
    import torch

    from fedsga_edge.models import create_model

    if threads:
        torch.set_num_threads(threads)
    info = manifest["model"]
    x, prompts, dz = (torch.from_numpy(a) for a in _inputs(manifest, entry, batch))
    depth = entry["depth"]
    with peak_rss_during() as mem:
        t = time.perf_counter()
        kw = {"num_classes": info["num_classes"], "img_size": info["img_size"]}
        if info.get("width") is not None:
            kw["width"] = info["width"]
        model = create_model(info["arch"], **kw).eval()
        create = time.perf_counter() - t

        def fwd() -> None:
            with torch.inference_mode():
                model.prefix(x, depth, prompts)

        times = time_calls(fwd, warmup=warmup, iters=iters, duration=duration)
    out: dict[str, Any] = {
        "session_create_s": create,
        "latency_ms": latency_stats(times, batch),
        "rss_peak_mb": mem.peak / 2**20,
        "rss_delta_mb": (mem.peak - mem.before) / 2**20,
    }
    if train:
        model.train()
        params = [p for b in model.blocks[:depth] for p in b.parameters()]
        opt = torch.optim.SGD(params, lr=0.0)
        p = prompts.clone().requires_grad_(True)

        def step() -> None:
            opt.zero_grad(set_to_none=True)
            z = model.prefix(x, depth, p)
            z.backward(dz)
            opt.step()

        n = max(3, (iters or 20) // 5)
        ttimes = time_calls(step, warmup=min(warmup, 2), iters=n, duration=duration / 5 if duration else None)
        out["train_step_ms"] = latency_stats(ttimes, batch)
    return out


def profile_artifacts(
    artifacts: str | Path,
    *,
    runtime: str = "onnxruntime",
    batches: Sequence[int] = (1,),
    threads: int | None = None,
    warmup: int = 10,
    iters: int | None = 100,
    duration: float | None = None,
    variants: Sequence[str] = ("fp32",),
    splits: Sequence[int] | None = None,
    train: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Profiles every (split, variant, batch) of an export; returns {device, model, results}."""
    if runtime not in RUNTIMES:
        raise ArtifactError(f"runtime {runtime!r}: choose one of {RUNTIMES}")
    if runtime == "torch":
        variants = ("fp32",)  # torch runs the model itself, not the exported files
    art = Path(artifacts)
    manifest = load_manifest(art)
    entries = [p for p in manifest["prefixes"] if splits is None or p["split"] in splits]
    if not entries:
        raise ArtifactError(f"none of splits {list(splits or [])} in {art}")
    results = []
    for entry in entries:
        for variant in variants:
            if variant != "fp32" and not entry.get(variant):
                continue
            for batch in batches:
                if progress:
                    progress(f"split {entry['split']} {variant} batch {batch}")
                if runtime == "onnxruntime":
                    r = _profile_onnx(art, manifest, entry, variant, batch, threads, warmup, iters, duration, train)
                else:
                    r = _profile_torch(manifest, entry, batch, threads, warmup, iters, duration, train)
                act = entry["activation"]["bytes_per_sample"]
                results.append(
                    {
                        "split": entry["split"],
                        "depth": entry["depth"],
                        "variant": variant,
                        "batch": batch,
                        "threads": threads,
                        "file": entry["file"] if variant == "fp32" else entry[variant]["file"],
                        **r,
                        "params": entry["params"],
                        "flops_per_sample": entry["flops_per_sample"],
                        "flops_train_per_sample": entry.get("flops_train_per_sample"),
                        "macs_onnx": entry.get("macs_onnx"),
                        "activation_shape": entry["activation"]["shape"],
                        "activation_bytes_per_sample": act,
                    }
                )
    return {
        "device": device_info(runtime, threads),
        "artifacts": str(art),
        "model": manifest["model"],
        "settings": {"warmup": warmup, "iters": iters, "duration": duration, "batches": list(batches)},
        "results": results,
    }
