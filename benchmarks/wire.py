"""What the wire costs: every figure a ratio of two things measured side by side in one run.

1. codec: ``wire.encode`` + ``wire.decode`` of an ``activation`` message vs a memcpy of the same bytes
   (raw fp32, and the codec's lossy fp16 / int8 tensor encodings).
2. MQTT: activation throughput through the project's ``MqttTransport`` + ``Peer`` (one-way sends,
   pipelined; chunked under the default 256 KiB ``max_packet`` and unchunked; and lockstep
   request/reply as the device does it) vs raw paho-mqtt QoS 1 publishes of the same sizes, on the
   embedded broker and on Mosquitto; plus a slow subscriber on each broker (held back or dropped).
3. bytes per sample per split of the activation (and the gradient back) for the fp32 (raw), fp16
   and int8 tensor encodings of the wire codec (docs/protocol.md, "Messages").
4. trial round time vs simulate round time on a tiny config (digits, 3 clients, 2 rounds, width
   0.25, ``--max-batches 2``), the trial on each broker.
5. what each ``--wire-format`` (fp32, fp16, int8, int4) costs in accuracy and saves in bytes: one short
   ``simulate`` per format and strategy (digits, 4 clients, 3 rounds, width 0.25, seed 0; static at
   split 2 and FedSGA), side by side. simulate is deterministic for a seed, so the accuracy
   difference to fp32 is the encoding's alone.
6. the formats on real tensors: resnet18_cifar width 0.25 after a short warm-up on
   CIFAR-10, the activation z and its gradient dz of consecutive batches at each split: the encoded
   message's bytes against fp32's, the reconstruction error, and what error feedback (the sender keeps
   the residual it could not send and adds it to its next message) does to the parameter gradient
   summed over those batches, the quantity SGD actually uses.
7. ``--int4-rounding``: whether int4's nearest-level rounding is biased on a model late in training (IID
   batches and a two-class device's), against stochastic and Hadamard-rotated rounding of the same bytes.

    python benchmarks/wire.py [--json runs/wire.json] [--mib 48] [--reps 3] [--skip-runs]
        [--brokers embedded,mosquitto] [--skip-accuracy | --accuracy-only | --tensors-only]
        [--accuracy-strategies static,fedsga] [--tensor-batches 8]
    python benchmarks/wire.py --int4-rounding [--late-steps 1500] [--tensor-batches 16]

Brokers are started here on free 127.0.0.1 ports (``fedsga_edge.broker.launch``); a broker
that is not installed is skipped with a note. Nothing leaves 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

MiB = 1024 * 1024
SIZES = (64 * 1024, MiB, 4 * MiB)
RUN = "bench"
WIRE_FORMATS = ("fp32", "fp16", "int8", "int4")  # --wire-format (fedsga_edge/runbuild.py)
CODECS = ("raw", "fp16", "int8", "int4")  # the codec's tensor_format for each of them
CIFAR_NPZ = Path.home() / ".cache" / "fedsga-edge" / "cifar10.npz"  # benchmarks/accuracy.py's DEFAULT_NPZ
ACCURACY = ["--dataset", "digits", "--clients", "4", "--rounds", "3", "--model", "resnet18_cifar", "--width", "0.25",
            "--seed", "0"]
ACCURACY_STRATEGIES = {"static": ["--strategy", "static", "--split", "2"], "fedsga": ["--strategy", "fedsga"]}
TINY = ["--dataset", "digits", "--clients", "3", "--rounds", "2", "--model", "resnet18_cifar", "--width", "0.25",
        "--seed", "0", "--local-epochs", "1", "--max-batches", "2", "--batch-size", "32", "--strategy", "fedsga"]


def _label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // 1024} KiB"


def _activation(z: np.ndarray, batch: int = 32) -> Any:
    from fedsga_edge.wire import Message

    y = np.zeros(batch, dtype=np.int64)
    return Message(kind="activation", run=RUN, round=1, seq=1, sender="client-000", body={"z": z, "y": y, "split": 1})


# ------------------------------------------------------------------ 1. codec vs memcpy


def _timed(fn: Callable[[], Any], reps: int) -> float:
    """Median seconds of ``fn`` over ``reps`` calls (after one warm-up)."""
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_codec(reps: int) -> list[dict[str, Any]]:
    from fedsga_edge.wire import decode, encode

    rows = []
    rng = np.random.default_rng(0)
    for size in SIZES:
        z = rng.standard_normal(size // 4).astype(np.float32)
        dst = np.empty_like(z)
        msg = _activation(z)
        n = max(3, reps * (4 * MiB // size))  # more calls for small messages: steadier medians
        memcpy = _timed(lambda: np.copyto(dst, z), n)
        for fmt in CODECS:
            data = encode(msg, tensor_format=fmt)
            enc = _timed(lambda: encode(msg, tensor_format=fmt), n)  # noqa: B023 - called in this iteration
            dec = _timed(lambda: decode(data), n)  # noqa: B023
            rows.append({"size": size, "format": fmt, "wire_bytes": len(data), "encode_s": enc, "decode_s": dec,
                         "memcpy_s": memcpy, "ratio": (enc + dec) / memcpy,
                         "codec_mib_s": size / (enc + dec) / MiB, "memcpy_mib_s": size / memcpy / MiB})
    return rows


# ------------------------------------------------------------------ 2. MQTT throughput


class _RssPeak:
    """Samples a process's RSS every 50 ms; ``peak`` in bytes."""

    def __init__(self, pid: int) -> None:
        import psutil

        self.proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except Exception:  # the process ended
                return
            self._stop.wait(0.05)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _paho(port: int, client_id: str) -> Any:
    import paho.mqtt.client as paho
    from paho.mqtt.enums import CallbackAPIVersion

    c = paho.Client(callback_api_version=CallbackAPIVersion.VERSION2, client_id=client_id, protocol=paho.MQTTv311)
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def raw_paho(port: int, size: int, count: int, timeout: float, slow_s: float = 0.0) -> dict[str, Any]:
    """``count`` QoS 1 publishes of ``size`` bytes from one paho client to another; MiB/s until the last arrives."""
    got, last = 0, time.monotonic()
    done = threading.Event()
    subscribed = threading.Event()

    def on_message(*_: Any) -> None:
        nonlocal got, last
        got += 1
        last = time.monotonic()
        if slow_s:
            time.sleep(slow_s)
        if got >= count:
            done.set()

    sub = _paho(port, f"bench-sub-{os.getpid()}")
    sub.on_message = on_message
    sub.on_subscribe = lambda *_: subscribed.set()
    sub.subscribe("bench/raw", qos=1)
    subscribed.wait(5)
    pub = _paho(port, f"bench-pub-{os.getpid()}")
    payload = os.urandom(size)
    try:
        t = time.perf_counter()
        start = time.monotonic()
        infos = [pub.publish("bench/raw", payload, qos=1) for _ in range(count)]
        for info in infos:
            info.wait_for_publish(timeout)
        # All acknowledged; a broker that dropped some never completes: stop 2 s after the last arrival.
        while not done.wait(0.1) and time.monotonic() - last < 2 and time.perf_counter() - t < timeout:
            pass
        ok = done.is_set()
        dt = time.monotonic() - start if ok else last - start  # incomplete: until the last arrival
    finally:
        for c in (pub, sub):
            c.loop_stop()
            c.disconnect()
    return {"received": got, "sent": count, "complete": ok, "seconds": dt, "mib_s": got * size / dt / MiB}


def transport(port: int, size: int, count: int, timeout: float, *, max_packet: int, lockstep: bool) -> dict[str, Any]:
    """``count`` activations of ``size`` bytes of z from a device Peer to the coordinator's, over MqttTransport.

    One-way ``send``s (pipelined, like the raw publishes) or, with ``lockstep``, ``call``s that wait for
    a small ``ack`` each, as a device waits for its gradient.
    """
    from fedsga_edge.transport import Peer
    from fedsga_edge.transport.mqtt import MqttTransport

    tag = f"{os.getpid()}-{size}-{max_packet}-{int(lockstep)}"
    coord_t = MqttTransport("127.0.0.1", port, run=RUN, client_id=f"coordinator-{tag}", max_packet=max_packet,
                            clean_session=True)
    dev_t = MqttTransport("127.0.0.1", port, run=RUN, client_id=f"client-000-{tag}", max_packet=max_packet,
                          clean_session=True)
    coord, dev = Peer(coord_t, "coordinator", RUN), Peer(dev_t, "client-000", RUN)
    got = 0
    done = threading.Event()

    def handler(msg: Any) -> Any:
        nonlocal got
        got += 1
        if got >= count:
            done.set()
        return coord.reply(msg, "ack") if lockstep else None

    coord.register(handler)
    coord_t.wait_ready(5)
    z = np.random.default_rng(1).standard_normal(size // 4).astype(np.float32)
    y = np.zeros(32, dtype=np.int64)
    try:
        t = time.perf_counter()
        for _ in range(count):
            if lockstep:
                dev.call("coordinator", "activation", 1, {"z": z, "y": y, "split": 1}, timeout=timeout)
            else:
                dev.send("coordinator", "activation", 1, {"z": z, "y": y, "split": 1})
        ok = done.wait(timeout)
        dt = time.perf_counter() - t
    finally:
        dev_t.close()
        coord_t.close()
    return {"received": got, "sent": count, "complete": ok, "seconds": dt, "mib_s": got * size / dt / MiB}


def bench_mqtt(kind: str, total: int, reps: int, workdir: Path) -> dict[str, Any]:
    from fedsga_edge.broker.launch import BrokerError, start_embedded, start_mosquitto

    try:
        broker = (start_embedded if kind == "embedded" else start_mosquitto)(workdir / f"broker-{kind}")
    except BrokerError as exc:
        return {"broker": kind, "skipped": str(exc)}
    rss = _RssPeak(broker.pid)
    rows = []
    try:
        for size in SIZES:
            count = max(4, total // size)
            modes: dict[str, Callable[[], dict[str, Any]]] = {
                "paho": lambda: raw_paho(broker.port, size, count, 60),  # noqa: B023 - used in this iteration
                "transport": lambda: transport(broker.port, size, count, 60, max_packet=256 * 1024, lockstep=False),  # noqa: B023
                "transport_unchunked": lambda: transport(broker.port, size, count, 60, max_packet=8 * MiB,  # noqa: B023
                                                         lockstep=False),
                "transport_lockstep": lambda: transport(broker.port, size, count, 60, max_packet=256 * 1024,  # noqa: B023
                                                        lockstep=True),
            }
            runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
            for _ in range(reps):  # interleaved, so a burst of load elsewhere hits every mode alike
                for m, fn in modes.items():
                    runs[m].append(fn())
            row: dict[str, Any] = {"size": size, "count": count}
            for m, rs in runs.items():
                row[m] = statistics.median(r["mib_s"] for r in rs)
                row[f"{m}_complete"] = all(r["complete"] for r in rs)
            row["ratio"] = row["transport"] / row["paho"]
            rows.append(row)
        # A subscriber that falls behind: 200 x 1 MiB published at full speed, 50 ms of work per message
        # (10 s to drain). Mosquitto holds everything back for it; the embedded broker's bounded log drops.
        slow = raw_paho(broker.port, MiB, 200, 60, slow_s=0.05)
    finally:
        broker.stop()
        peak = rss.stop()
    return {"broker": kind, "rows": rows, "slow_subscriber": slow, "broker_peak_rss": peak}


# ------------------------------------------------------------------ 3. bytes per sample per split


def bench_sizes(batch: int = 32) -> list[dict[str, Any]]:
    """Encoded ``activation`` (z, y, split) and ``gradient`` (dz, loss) bytes per sample at each split."""
    from fedsga_edge.models import create_model
    from fedsga_edge.wire import Message, encode

    model = create_model("resnet18_cifar", num_classes=10, width=0.25)
    rows = []
    rng = np.random.default_rng(0)
    for k in range(1, model.num_splits + 1):
        depth = model.depth_of(k)
        shape = model.interface_shape(depth)
        z = rng.standard_normal((batch, *shape)).astype(np.float32)
        row: dict[str, Any] = {"split": k, "depth": depth, "shape": list(shape), "fp32_tensor_bytes": z[0].nbytes}
        for fmt in CODECS:
            act = encode(Message("activation", RUN, 1, 1, "client-000",
                                 {"z": z, "y": np.zeros(batch, np.int64), "split": k}), tensor_format=fmt)
            grad = encode(Message("gradient", RUN, 1, 2, "coordinator", {"dz": z, "loss": 0.0}), tensor_format=fmt)
            row[fmt] = {"activation": len(act) / batch, "gradient": len(grad) / batch}
        rows.append(row)
    return rows


# ------------------------------------------------------------------ 4. trial vs simulate


def _cli(args: list[str], timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "fedsga_edge.cli.main", *args], capture_output=True, text=True,
                         timeout=timeout)
    return time.perf_counter() - t, res


def bench_runs(brokers: list[str], workdir: Path) -> list[dict[str, Any]]:
    runs: list[tuple[str, list[str]]] = [("simulate", ["simulate", "--threads", "1"])]
    runs += [(f"trial ({b})", ["trial", "--broker", b, "--threads", "1"]) for b in brokers]
    rows = []
    for name, cmd in runs:
        out = workdir / name.replace(" ", "_").replace("(", "").replace(")", "")
        wall, res = _cli([*cmd, "--out", str(out), "--quiet", *TINY], timeout=900)
        if res.returncode != 0:
            rows.append({"run": name, "error": (res.stderr or res.stdout)[-500:]})
            continue
        metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
        rows.append({"run": name, "command_s": wall, "round_s": [m["round_s"] for m in metrics],
                     "failures": [len(m.get("failures", {})) for m in metrics],
                     "bytes_up": [m.get("bytes_up") for m in metrics], "bytes_down": [m.get("bytes_down") for m in metrics]})
    base = next((r for r in rows if r["run"] == "simulate" and "round_s" in r), None)
    for r in rows:
        if base is not None and "round_s" in r:
            r["round_ratio"] = [a / b for a, b in zip(r["round_s"], base["round_s"])]
            r["command_ratio"] = r["command_s"] / base["command_s"]
    return rows


# ------------------------------------------------------------------ 5. accuracy per wire format


def bench_accuracy(strategies: list[str], workdir: Path) -> list[dict[str, Any]]:
    """One ``simulate --wire-format F`` per strategy and format; accuracy and bytes against fp32's."""
    rows = []
    for strategy in strategies:
        for fmt in WIRE_FORMATS:
            out = workdir / f"accuracy-{strategy}-{fmt}"
            wall, res = _cli(["simulate", "--threads", "1", "--quiet", "--out", str(out), "--wire-format", fmt,
                              *ACCURACY, *ACCURACY_STRATEGIES[strategy]], timeout=3600)
            if res.returncode != 0:
                rows.append({"strategy": strategy, "format": fmt, "error": (res.stderr or res.stdout)[-500:]})
                continue
            summary = json.loads((out / "summary.json").read_text())
            info = json.loads((out / "config.json").read_text())
            # samples that went through the split: every client's share (or its --max-batches of it), every
            # local epoch, every round
            t = info["train"]
            cap = t["max_batches"] * t["batch_size"] or None
            trained = summary["rounds"] * t["local_epochs"] * sum(min(n, cap or n) for n in info["client_sizes"].values())
            rows.append({"strategy": strategy, "format": fmt, "final_acc": summary["final_acc"],
                         "final_test_loss": summary["final_test_loss"], "bytes_up": summary["bytes_up"],
                         "bytes_down": summary["bytes_down"], "samples_trained": trained,
                         "bytes_up_per_sample": summary["bytes_up"] / trained,
                         "bytes_down_per_sample": summary["bytes_down"] / trained,
                         "split_histogram": summary["split_histogram"], "failures": summary["failures"],
                         "command_s": wall})
    for r in rows:
        base = next((b for b in rows if b["strategy"] == r["strategy"] and b["format"] == "fp32" and "error" not in b),
                    None)
        if base is not None and "error" not in r:
            r["acc_diff_vs_fp32"] = r["final_acc"] - base["final_acc"]
            r["bytes_up_vs_fp32"] = r["bytes_up"] / base["bytes_up"]
    return rows


# ------------------------------------------------------------------ 6. the formats on real tensors


def _load_images(n: int, seed: int) -> tuple[np.ndarray, np.ndarray, str]:
    """``n`` CIFAR-10 training images (uint8 NHWC) and labels; standard-normal noise if the npz is absent."""
    rng = np.random.default_rng(seed)
    if CIFAR_NPZ.exists():
        with np.load(CIFAR_NPZ) as f:
            idx = rng.choice(len(f["y_train"]), n, replace=False)
            return f["x_train"][np.sort(idx)], f["y_train"][np.sort(idx)].astype(np.int64), "cifar10"
    x = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
    return x, rng.integers(0, 10, n).astype(np.int64), "random images (no cifar10.npz)"


def bench_tensors(batches: int = 8, batch: int = 64, warmup: int = 30, seed: int = 0) -> dict[str, Any]:
    """Bytes, reconstruction error and error feedback of every codec on real z / dz (see the module doc).

    The model is fixed while the ``batches`` consecutive batches go through it, so every difference in
    the summed parameter gradient comes from the encoding alone: the server's gradient from the decoded
    activations, the device's from the decoded gradients (its prefix's backward with them)."""
    import torch
    import torch.nn.functional as F

    from fedsga_edge.models import create_model
    from fedsga_edge.tensors import image_batch
    from fedsga_edge.wire import Message, decode, encode

    torch.manual_seed(seed)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    x_all, y_all, source = _load_images((warmup + batches) * batch, seed)
    model = create_model("resnet18_cifar", num_classes=10, width=0.25)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for i in range(warmup):  # a model that has learnt a little, so z and dz are not those of a random init
        xb = image_batch(x_all[i * batch:(i + 1) * batch], mean, std, "cpu")
        loss = F.cross_entropy(model(xb), torch.from_numpy(y_all[i * batch:(i + 1) * batch]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    params = list(model.parameters())
    xs = [image_batch(x_all[(warmup + t) * batch:(warmup + t + 1) * batch], mean, std, "cpu") for t in range(batches)]
    ys = [torch.from_numpy(y_all[(warmup + t) * batch:(warmup + t + 1) * batch]) for t in range(batches)]

    def roundtrip(a: np.ndarray, fmt: str, kind: str) -> tuple[np.ndarray, int]:
        body = {"z": a, "y": np.zeros(batch, np.int64), "split": 1} if kind == "activation" else {"dz": a, "loss": 0.0}
        data = encode(Message(kind, RUN, 1, 1, "client-000", body), tensor_format=fmt)
        return decode(data).body["z" if kind == "activation" else "dz"], len(data)

    def flat(gs: list[torch.Tensor | None]) -> torch.Tensor:
        return torch.cat([g.reshape(-1) for g in gs if g is not None]).double()

    def rel(a: np.ndarray | torch.Tensor, b: np.ndarray | torch.Tensor) -> float:
        a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
        return float(np.linalg.norm(a64 - b64) / max(np.linalg.norm(b64), 1e-300))

    rows = []
    for k in range(1, model.num_splits + 1):
        depth = model.depth_of(k)
        zs, dzs, graphs = [], [], []
        for xb, yb in zip(xs, ys):  # the exact z and dz of each batch, and the prefix graph for the device's backward
            z = model.prefix(xb, depth)
            zd = z.detach().requires_grad_(True)
            loss = F.cross_entropy(model.head(model.suffix(zd, depth)), yb)
            (dz,) = torch.autograd.grad(loss, zd)
            zs.append(zd.detach().numpy().copy())
            dzs.append(dz.numpy().copy())
            graphs.append(z)

        def server_grad(zt: np.ndarray, yb: torch.Tensor, depth: int = depth) -> torch.Tensor:
            loss = F.cross_entropy(model.head(model.suffix(torch.from_numpy(zt), depth)), yb)
            return flat(list(torch.autograd.grad(loss, params, allow_unused=True)))

        def device_grad(t: int, dz: np.ndarray, graphs: list[torch.Tensor] = graphs) -> torch.Tensor:
            return flat(list(torch.autograd.grad(graphs[t], params, grad_outputs=torch.from_numpy(dz),
                                                 retain_graph=True, allow_unused=True)))

        row: dict[str, Any] = {"split": k, "depth": depth, "shape": list(zs[0].shape[1:]), "formats": {}}
        exact_s = sum(server_grad(zs[t], ys[t]) for t in range(batches))
        exact_d = sum(device_grad(t, dzs[t]) for t in range(batches))
        raw_bytes = {kind: sum(roundtrip(a, "raw", kind)[1] for a in arrs)
                     for kind, arrs in (("activation", zs), ("gradient", dzs))}
        for fmt in CODECS:
            r: dict[str, Any] = {}
            for kind, arrs in (("activation", zs), ("gradient", dzs)):
                got = [roundtrip(a, fmt, kind) for a in arrs]
                r[f"{kind}_bytes_ratio"] = sum(n for _, n in got) / raw_bytes[kind]
                r[f"{kind}_rel_err"] = statistics.mean(rel(d, a) for (d, _), a in zip(got, arrs))
                r[f"{kind}_max_err"] = max(float(np.abs(d - a).max() / np.abs(a).max()) for (d, _), a in zip(got, arrs))
                if kind == "activation":
                    g = sum(server_grad(d, ys[t]) for t, (d, _) in enumerate(got))
                    r["server_grad_rel_err"] = rel(g, exact_s)
                else:
                    g = sum(device_grad(t, d) for t, (d, _) in enumerate(got))
                    r["device_grad_rel_err"] = rel(g, exact_d)
            if fmt != "raw":  # error feedback: each message carries the previous messages' residual too
                for kind, arrs in (("activation", zs), ("gradient", dzs)):
                    resid = np.zeros_like(arrs[0])
                    sent, errs = [], []
                    for a in arrs:
                        d, _ = roundtrip(a + resid, fmt, kind)
                        resid = a + resid - d
                        sent.append(d)
                        errs.append(rel(d, a))
                    r[f"ef_{kind}_rel_err"] = statistics.mean(errs)
                    if kind == "activation":
                        g = sum(server_grad(d, ys[t]) for t, d in enumerate(sent))
                        r["ef_server_grad_rel_err"] = rel(g, exact_s)
                    else:
                        g = sum(device_grad(t, d) for t, d in enumerate(sent))
                        r["ef_device_grad_rel_err"] = rel(g, exact_d)
            row["formats"][{"raw": "fp32"}.get(fmt, fmt)] = r
        rows.append(row)
    return {"source": source, "batches": batches, "batch": batch, "warmup_steps": warmup, "rows": rows}


def _print_tensors(t: dict[str, Any]) -> None:
    print(f"\n## the formats on real tensors (resnet18_cifar width 0.25, {t['source']}, {t['warmup_steps']} warm-up"
          f" SGD steps, then {t['batches']} consecutive batches of {t['batch']} per split, the model held fixed)")
    print(f"{'split':>5} {'shape':>10} {'format':>6} {'act x fp32':>10} {'grad x fp32':>11} {'z rel err':>9}"
          f" {'z max err':>9} {'dz rel err':>10} {'dz max err':>10} {'server g err':>12} {'device g err':>12}"
          f" {'EF: z err':>9} {'dz err':>7} {'server g':>8} {'device g':>8}")
    for row in t["rows"]:
        for fmt, r in row["formats"].items():
            ef = (f" {r['ef_activation_rel_err']:>9.4f} {r['ef_gradient_rel_err']:>7.4f} {r['ef_server_grad_rel_err']:>8.4f}"
                  f" {r['ef_device_grad_rel_err']:>8.4f}" if "ef_activation_rel_err" in r else f" {'-':>9} {'-':>7} {'-':>8} {'-':>8}")
            print(f"{row['split']:>5} {'x'.join(map(str, row['shape'])):>10} {fmt:>6} {r['activation_bytes_ratio']:>10.4f}"
                  f" {r['gradient_bytes_ratio']:>11.4f} {r['activation_rel_err']:>9.4f} {r['activation_max_err']:>9.4f}"
                  f" {r['gradient_rel_err']:>10.4f} {r['gradient_max_err']:>10.4f} {r['server_grad_rel_err']:>12.4f}"
                  f" {r['device_grad_rel_err']:>12.4f}{ef}")
    print("(x fp32: the whole encoded message, labels and envelope included, against the same message raw. rel err:"
          " ||decoded - exact|| / ||exact|| per message, mean over the batches; max err: max |decoded - exact| / max"
          " |exact|. server g / device g err: the parameter gradient summed over the batches, from the decoded z (the"
          " server's blocks) or the decoded dz (the device's prefix), against the exact one. EF: the same with error"
          " feedback, each message carrying the residual of the ones before.)")


# ------------------------------------------------------------------ 7. int4's rounding late in training


def _int4_candidate(a: np.ndarray, rng: np.random.Generator, *, stochastic: bool, rotate: bool) -> np.ndarray:
    """A rounding the codec could use instead of its own (nearest level, per 256-value block): stochastic
    rounding (unbiased per value) or a Hadamard rotation of each block before rounding (spreads a block's peak).
    Same bytes as the codec's int4; decoded back to float32 here, never sent."""
    from fedsga_edge.wire.codec import INT4_BLOCK

    n, flat = a.size, a.reshape(-1).astype(np.float32)
    rows = np.zeros(-(-n // INT4_BLOCK) * INT4_BLOCK, np.float32)
    rows[:n] = flat
    rows = rows.reshape(-1, INT4_BLOCK)
    signed = rotate or bool(flat.min() < 0)
    if rotate:
        h = np.array([[1.0]], np.float32)
        while h.shape[0] < INT4_BLOCK:
            h = np.block([[h, h], [h, -h]])
        h /= np.sqrt(np.float32(INT4_BLOCK))
        rows = rows @ h
    levels = 7.0 if signed else 15.0
    scale = np.abs(rows).max(axis=1) / levels
    scale[scale == 0] = 1.0
    x = rows / scale[:, None]
    x = np.floor(x + rng.random(x.shape, dtype=np.float32)) if stochastic else np.rint(x)
    x = np.clip(x, -levels if signed else 0.0, levels) * scale[:, None]
    if rotate:
        x = x @ h.T
    return x.reshape(-1)[:n].reshape(a.shape)


def bench_int4_rounding(steps: int = 1500, batches: int = 16, local_steps: int = 100, split: int = 2,
                        seed: int = 0) -> dict[str, Any]:
    """Is int4's nearest-level rounding biased on the gradients of a model late in training?

    resnet18_cifar width 0.25 trained ``steps`` SGD steps (batch 64, lr 0.05, momentum 0.5) on CIFAR-10; then at
    ``split`` (static's p_ref) for ``batches`` consecutive batches, once IID and once on a two-class device after
    ``local_steps`` local steps (label skew, as under Dirichlet(0.1)), the model held fixed: per rounding, the
    error of z and dz, the bias <Q(dz), dz> / |dz|^2, the share of non-zero dz values sent as 0, and the error
    of the parameter gradient summed over 1, 4 and ``batches`` batches (what SGD integrates; a bias shows as an
    error that does not shrink with more batches, and as a projection on the exact sum away from 1)."""
    import torch
    import torch.nn.functional as F

    from fedsga_edge.models import create_model
    from fedsga_edge.tensors import image_batch
    from fedsga_edge.wire import Message, decode, encode

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    mean, std = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    x_all, y_all, source = _load_images(50000, seed)
    model = create_model("resnet18_cifar", num_classes=10, width=0.25)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
    batch, depth, params = 64, model.depth_of(split), list(model.parameters())

    def train(idx_of: Callable[[int], np.ndarray], n: int) -> float:
        model.train()
        loss = torch.zeros(())
        for i in range(n):
            idx = idx_of(i)
            loss = F.cross_entropy(model(image_batch(x_all[idx], mean, std, "cpu")), torch.from_numpy(y_all[idx]))
            opt.zero_grad()
            loss.backward()
            opt.step()
        return float(loss.detach())

    def codec_int4(a: np.ndarray, kind: str) -> np.ndarray:
        body = {"z": a, "y": np.zeros(batch, np.int64), "split": split} if kind == "z" else {"dz": a, "loss": 0.0}
        return decode(encode(Message("activation" if kind == "z" else "gradient", RUN, 1, 1, "client-000", body),
                             tensor_format="int4")).body[kind]

    def measure(pool: np.ndarray) -> dict[str, Any]:
        zs, dzs, graphs, ys = [], [], [], []
        for t in range(batches):
            idx = pool[t * batch:(t + 1) * batch]
            yb = torch.from_numpy(y_all[idx])
            z = model.prefix(image_batch(x_all[idx], mean, std, "cpu"), depth)
            zd = z.detach().requires_grad_(True)
            (dz,) = torch.autograd.grad(F.cross_entropy(model.head(model.suffix(zd, depth)), yb), zd)
            zs.append(zd.detach().numpy().copy())
            dzs.append(dz.numpy().copy())
            graphs.append(z)
            ys.append(yb)

        def flat(gs: Any) -> torch.Tensor:
            return torch.cat([g.reshape(-1) for g in gs if g is not None]).double()

        def device_g(t: int, dz: np.ndarray) -> torch.Tensor:
            return flat(torch.autograd.grad(graphs[t], params, grad_outputs=torch.from_numpy(np.ascontiguousarray(dz)),
                                            retain_graph=True, allow_unused=True))

        def server_g(t: int, z: np.ndarray) -> torch.Tensor:
            loss = F.cross_entropy(model.head(model.suffix(torch.from_numpy(np.ascontiguousarray(z)), depth)), ys[t])
            return flat(torch.autograd.grad(loss, params, allow_unused=True))

        exact_d = [device_g(t, dzs[t]) for t in range(batches)]
        exact_s = [server_g(t, zs[t]) for t in range(batches)]
        draws = np.random.default_rng(seed + 1)
        roundings: dict[str, Callable[[np.ndarray, str], np.ndarray]] = {
            "nearest (the codec)": codec_int4,
            "stochastic": lambda a, _k: _int4_candidate(a, draws, stochastic=True, rotate=False),
            "Hadamard + nearest": lambda a, _k: _int4_candidate(a, draws, stochastic=False, rotate=True),
        }
        out: dict[str, Any] = {}
        for name, fn in roundings.items():
            qd = [fn(d, "dz").astype(np.float32) for d in dzs]
            qz = [fn(z, "z").astype(np.float32) for z in zs]
            gd = [device_g(t, qd[t]) for t in range(batches)]
            gs = [server_g(t, qz[t]) for t in range(batches)]
            r: dict[str, Any] = {
                "dz_rel_err": statistics.mean(float(np.linalg.norm(q - d) / np.linalg.norm(d)) for q, d in zip(qd, dzs)),
                "dz_bias": statistics.mean(float((q * d).sum() / (d * d).sum()) for q, d in zip(qd, dzs)),
                "dz_zeroed": statistics.mean(float(((q == 0) & (d != 0)).sum() / max(int((d != 0).sum()), 1))
                                             for q, d in zip(qd, dzs)),
                "z_rel_err": statistics.mean(float(np.linalg.norm(q - z) / np.linalg.norm(z)) for q, z in zip(qz, zs)),
            }
            for n in sorted({1, 4, batches}):
                sd, ed, ss, es = sum(gd[:n]), sum(exact_d[:n]), sum(gs[:n]), sum(exact_s[:n])
                r[f"device_g_err_{n}"] = float((sd - ed).norm() / ed.norm())
                r[f"server_g_err_{n}"] = float((ss - es).norm() / es.norm())
                r[f"device_g_proj_{n}"] = float((sd * ed).sum() / (ed * ed).sum())
            out[name] = r
        return out

    t0 = time.perf_counter()
    order = rng.permutation(len(y_all))
    last = train(lambda i: order[(i * batch) % (len(order) - batch):][:batch], steps)
    held = order[-batches * batch:]  # consecutive batches for the IID measurement
    result: dict[str, Any] = {"source": source, "steps": steps, "batches": batches, "split": split,
                              "shape": None, "train_loss": last, "cases": {}}
    result["cases"]["IID batches"] = measure(held)
    two = np.flatnonzero(np.isin(y_all, [3, 5]))
    local = train(lambda i: rng.choice(two, batch, replace=False), local_steps)
    result["cases"][f"2-class device, +{local_steps} steps ({local:.2f})"] = measure(rng.permutation(two))
    result["shape"] = list(model.prefix(image_batch(x_all[:2], mean, std, "cpu"), depth).shape[1:])
    result["seconds"] = time.perf_counter() - t0
    return result


def _print_int4_rounding(r: dict[str, Any]) -> None:
    n = r["batches"]
    print(f"\n## int4 rounding late in training (resnet18_cifar w0.25, {r['source']}, {r['steps']} SGD steps, final"
          f" batch loss {r['train_loss']:.3f}; split {r['split']}, z {'x'.join(map(str, r['shape']))}, {n} batches of 64)")
    print(f"{'case':>32} {'rounding':>20} {'dz err':>7} {'dz bias':>7} {'zeroed':>6} {'z err':>6}"
          f" {'dev g err 1/4/' + str(n):>22} {'srv g err 1/4/' + str(n):>22} {'dev g proj ' + str(n):>12}")
    for case, rows in r["cases"].items():
        for name, x in rows.items():
            dev = "/".join(f"{x[f'device_g_err_{k}']:.3f}" for k in sorted({1, 4, n}))
            srv = "/".join(f"{x[f'server_g_err_{k}']:.3f}" for k in sorted({1, 4, n}))
            print(f"{case:>32} {name:>20} {x['dz_rel_err']:>7.4f} {x['dz_bias']:>7.4f} {x['dz_zeroed']:>6.3f}"
                  f" {x['z_rel_err']:>6.4f} {dev:>22} {srv:>22} {x[f'device_g_proj_{n}']:>12.4f}")
    print("(case: IID batches, or a device holding classes 3 and 5 after its local steps (its last batch loss);"
          " dz bias: <Q(dz), dz> / |dz|^2 per message, 1 = unbiased; zeroed: non-zero dz values sent as 0; g err: the"
          " parameter gradient summed over 1, 4 and all batches from the decoded dz (device) or z (server) against the"
          " exact sum; proj: that device sum projected on the exact one, 1 = no shrink)")


# ------------------------------------------------------------------ report


def _print(result: dict[str, Any]) -> None:
    print(f"# wire benchmark  ({result['machine']})\n")
    if result.get("codec"):
        _print_transport(result)
    if result.get("tensors"):
        _print_tensors(result["tensors"])
    if result.get("accuracy"):
        _print_accuracy(result["accuracy"])


def _print_accuracy(rows: list[dict[str, Any]]) -> None:
    print("\n## accuracy per --wire-format (simulate: digits, 4 clients, 3 rounds, width 0.25, seed 0, --threads 1;"
          " static at split 2, and fedsga)")
    print(f"{'strategy':>8} {'format':>6} {'final acc':>9} {'vs fp32 pp':>10} {'test loss':>9} {'bytes_up MB':>11}"
          f" {'x fp32':>6} {'up B/sample':>11} {'down B/sample':>13} {'command s':>9}")
    for r in rows:
        if "error" in r:
            print(f"{r['strategy']:>8} {r['format']:>6} error: {r['error'][-200:]}")
            continue
        diff = f"{100 * r['acc_diff_vs_fp32']:+.2f}" if "acc_diff_vs_fp32" in r else "-"
        ratio = f"{r['bytes_up_vs_fp32']:.3f}" if "bytes_up_vs_fp32" in r else "-"
        print(f"{r['strategy']:>8} {r['format']:>6} {r['final_acc']:>9.4f} {diff:>10} {r['final_test_loss']:>9.4f}"
              f" {r['bytes_up'] / 1e6:>11.1f} {ratio:>6} {r['bytes_up_per_sample']:>11.0f}"
              f" {r['bytes_down_per_sample']:>13.0f} {r['command_s']:>9.0f}")
    print("(bytes_up: everything the devices sent, updates included; per sample: over the samples trained through"
          " the split, every epoch and round. Weights travel fp32 under every format.)")


def _print_transport(result: dict[str, Any]) -> None:
    print("## codec encode+decode vs memcpy of the same bytes (activation message, median)")
    print(f"{'size':>7} {'format':>6} {'wire bytes':>11} {'enc+dec us':>11} {'memcpy us':>10} {'ratio':>6}"
          f" {'codec MiB/s':>12} {'memcpy MiB/s':>13}")
    for r in result["codec"]:
        print(f"{_label(r['size']):>7} {r['format']:>6} {r['wire_bytes']:>11} {1e6 * (r['encode_s'] + r['decode_s']):>11.0f}"
              f" {1e6 * r['memcpy_s']:>10.0f} {r['ratio']:>6.1f} {r['codec_mib_s']:>12.0f} {r['memcpy_mib_s']:>13.0f}")
    for m in result["mqtt"]:
        print(f"\n## MQTT activation throughput, {m['broker']} broker (MiB/s of z, QoS 1, 127.0.0.1, median)")
        if "skipped" in m:
            print(f"skipped: {m['skipped']}")
            continue
        print(f"{'size':>7} {'count':>5} {'raw paho':>9} {'transport':>10} {'ratio':>6} {'unchunked':>10}"
              f" {'lockstep':>9}   (transport: Peer.send, max_packet 256 KiB; unchunked: 8 MiB; lockstep: Peer.call)")
        for r in m["rows"]:
            flags = "" if all(r[f"{k}_complete"] for k in ("paho", "transport", "transport_unchunked", "transport_lockstep")) \
                else "  INCOMPLETE"
            print(f"{_label(r['size']):>7} {r['count']:>5} {r['paho']:>9.0f} {r['transport']:>10.0f} {r['ratio']:>6.2f}"
                  f" {r['transport_unchunked']:>10.0f} {r['transport_lockstep']:>9.0f}{flags}")
        s = m["slow_subscriber"]
        print(f"slow subscriber (1 MiB publishes, 50 ms per message): received {s['received']}/{s['sent']};"
              f" broker peak RSS {m['broker_peak_rss'] / MiB:.0f} MiB")
    print("\n## bytes per sample per split (resnet18_cifar width 0.25, batch 32; the codec's tensor encodings)")
    print(f"{'split':>5} {'depth':>5} {'shape':>14} {'fp32 act':>9} {'fp16 act':>9} {'int8 act':>9} {'int4 act':>9}"
          f" {'fp32 grad':>10} {'fp16 grad':>10} {'int8 grad':>10} {'int4 grad':>10}")
    for r in result["sizes"]:
        print(f"{r['split']:>5} {r['depth']:>5} {'x'.join(map(str, r['shape'])):>14} {r['raw']['activation']:>9.0f}"
              f" {r['fp16']['activation']:>9.0f} {r['int8']['activation']:>9.0f} {r['int4']['activation']:>9.0f}"
              f" {r['raw']['gradient']:>10.0f} {r['fp16']['gradient']:>10.0f} {r['int8']['gradient']:>10.0f}"
              f" {r['int4']['gradient']:>10.0f}")
    print("(the run flag --wire-format fp32 | fp16 | int8 | int4 selects these for activations and gradients;"
          " weights always travel fp32; docs/protocol.md, \"Messages\")")
    if result.get("runs"):
        print("\n## trial vs simulate (digits, 3 clients, 2 rounds, width 0.25, --max-batches 2, --threads 1)")
        print(f"{'run':>20} {'round 1 s':>10} {'round 2 s':>10} {'x simulate':>14} {'command s':>10} {'x simulate':>11}")
        for r in result["runs"]:
            if "error" in r:
                print(f"{r['run']:>20} error: {r['error'][-200:]}")
                continue
            ratio = "/".join(f"{x:.1f}" for x in r.get("round_ratio", []))
            print(f"{r['run']:>20} {r['round_s'][0]:>10.1f} {r['round_s'][-1]:>10.1f} {ratio:>14}"
                  f" {r['command_s']:>10.1f} {r.get('command_ratio', 1.0):>11.1f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, default=None, help="Write every figure here too.")
    ap.add_argument("--mib", type=int, default=48, help="MiB per MQTT measurement (below the embedded broker's "
                    "56 MiB per-filter retention, so a pipelined burst is never dropped).")
    ap.add_argument("--reps", type=int, default=3, help="Repetitions per figure (the median is reported).")
    ap.add_argument("--brokers", default="embedded,mosquitto", help="Comma-separated: embedded, mosquitto.")
    ap.add_argument("--skip-runs", action="store_true", help="Skip the trial vs simulate runs (minutes).")
    ap.add_argument("--skip-accuracy", action="store_true", help="Skip the accuracy per --wire-format runs (minutes).")
    ap.add_argument("--accuracy-only", action="store_true", help="Only the accuracy per --wire-format runs.")
    ap.add_argument("--tensors-only", action="store_true",
                    help="Only the formats on real tensors (bytes, error, error feedback; about a minute).")
    ap.add_argument("--tensor-batches", type=int, default=8, help="Consecutive batches per split for the real tensors.")
    ap.add_argument("--int4-rounding", action="store_true",
                    help="Only: int4's rounding on the gradients of a model late in training, against stochastic and "
                         "Hadamard-rotated rounding (about 10 CPU-minutes; --late-steps).")
    ap.add_argument("--late-steps", type=int, default=1500, help="SGD steps before --int4-rounding measures.")
    ap.add_argument("--accuracy-strategies", default="static,fedsga",
                    help=f"Comma-separated strategies for the accuracy part: {', '.join(ACCURACY_STRATEGIES)}.")
    args = ap.parse_args(argv)
    strategies = [x.strip() for x in args.accuracy_strategies.split(",") if x.strip()]
    unknown = sorted(set(strategies) - set(ACCURACY_STRATEGIES))
    if unknown or not strategies:
        ap.error(f"--accuracy-strategies: unknown {unknown}; use {', '.join(ACCURACY_STRATEGIES)}")
    if args.skip_accuracy and args.accuracy_only:
        ap.error("--skip-accuracy and --accuracy-only contradict each other")
    if args.tensors_only and args.accuracy_only:
        ap.error("--tensors-only and --accuracy-only contradict each other")
    brokers = [b.strip() for b in args.brokers.split(",") if b.strip()]
    bad = sorted(set(brokers) - {"embedded", "mosquitto"})
    if bad:
        ap.error(f"unknown broker(s) {bad}; use embedded, mosquitto")
    import psutil

    if args.int4_rounding:
        rounding = bench_int4_rounding(args.late_steps, args.tensor_batches)
        _print_int4_rounding(rounding)
        print(f"\n({rounding['seconds']:.0f} s)")
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(rounding, indent=2))
        return
    result: dict[str, Any] = {
        "machine": f"{platform.machine()}, {psutil.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
                   f"Python {platform.python_version()}",
        "args": vars(args) | {"json": str(args.json) if args.json else None},
    }
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedsga-wire-") as tmp:
        work = Path(tmp)
        if not args.accuracy_only and not args.tensors_only:
            result["codec"] = bench_codec(args.reps)
            result["mqtt"] = [bench_mqtt(b, args.mib * MiB, args.reps, work) for b in brokers]
            result["sizes"] = bench_sizes()
            result["runs"] = [] if args.skip_runs else bench_runs(brokers, work)
        if not args.accuracy_only:
            result["tensors"] = bench_tensors(args.tensor_batches)
        result["accuracy"] = [] if args.skip_accuracy or args.tensors_only else bench_accuracy(strategies, work)
    result["seconds"] = time.perf_counter() - t0
    _print(result)
    print(f"\n({result['seconds']:.0f} s)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
