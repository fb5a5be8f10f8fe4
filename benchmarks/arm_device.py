"""The torch-free device agent on aarch64 against the same run on x86: the runs and the check.

benchmarks/arm_device.sh prepares an arm64 root file system with the project's ``[device]`` extra and calls
this with ``--enter`` (its own command that runs a program inside that system under qemu-user). Here, on the
host: one device's share of digits as an image folder (``fedsga-edge partition``), the train graphs of a small
model (``fedsga-edge export --train``), then the same 2-round run twice, each against a coordinator on the
host over its own Mosquitto on a loopback port: first with the device inside the arm64 system, then with a
device on the host that cannot import torch. Both devices take the same batches from the same seed, so the
runs differ only by the CPU that computed the device's part; the check is that their round results (the
coordinator's metrics and its final weights) agree to float tolerance. Emulated numeric code is 15-2000x slower
than the host's (this check's device rounds: 15-30x), so the model and the batches are small and the times say
nothing about a real Pi.

Usage: python benchmarks/arm_device.py --work HOST_DIR --inside DIR_IN_ROOTFS --enter "CMD" [--venv /opt/...]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import textwrap
import time
from pathlib import Path

# One device, two rounds, a small model (resnet18_cifar at width 0.125, split 1: stem + layer1 on the device),
# two batches of 16 per round: minutes under emulation. Augmentation off: nothing random but the seeded batches.
# Rate 0.01: at the default 0.1 an untrained BatchNorm net amplifies float32 rounding (NEON against AVX2 kernels:
# 1e-7 relative in one step) to 0.7 % of the test loss after round 1 and 0.06 in a weight after round 2.
RUN = ["--dataset", "digits", "--model", "resnet18_cifar", "--width", "0.125", "--strategy", "static",
       "--split", "1", "--seed", "0", "--clients", "1", "--rounds", "2", "--local-epochs", "1", "--max-batches",
       "2", "--batch-size", "16", "--lr", "0.01", "--no-augment", "--eval-holdout", "0.2", "--round-timeout", "1800"]
TRAIN_SUBSET = "160"  # images in the device's folder: read and decoded by Pillow under emulation
# What the two runs must share, per round: the figures that are counts exactly, the losses and accuracies to
# float tolerance, and the final weights. Not bit for bit: onnxruntime's NEON kernels round differently from its
# AVX2 ones (1e-7 relative per step), and on digits' flat backgrounds many activations tie near a ReLU's kink,
# so a rounding difference flips whole regions of a mask. Measured on this check: the aarch64 device against
# the x86 one 2.7e-4 (losses) and 6.8e-4 (weights, relative L2); the x86 torch device against the x86 onnx one,
# which tests/test_onnx_device.py holds equal to float rounding, 5.7e-3 and 1.2e-3 (docs/deploy.md).
EXACT = ("round", "splits", "bytes_up", "bytes_down", "failures", "fed_count")
LOSSES = ("train_loss", "test_loss", "fed_loss")
ACCURACIES = ("test_acc", "fed_acc")
LOSS_TOL = 2e-3  # relative
ACC_TOL = 0.035  # absolute: one image of the 32 held out (0.031) may flip; of the 360 test images one is 0.003
WEIGHT_TOL = 5e-3  # relative L2 over all trained weights
STATS_TOL = 2e-2  # relative L2 over BatchNorm's running statistics

# The host's torch-free device: the same meta-path block the tests use (tests/test_device_runtime.py).
NO_TORCH = textwrap.dedent("""
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"torch is not installed on this device ({name})")
    sys.meta_path.insert(0, _NoTorch())
    from fedsga_edge.cli.main import app
    app(sys.argv[1:])
""")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedsga_edge.cli.main", *args]


def check(cmd: list[str], what: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"COLUMNS": "200"})
    if res.returncode != 0:
        sys.exit(f"{what} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-3000:]}")


def prepare(work: Path) -> None:
    """The device's share (an image folder), the coordinator's class list and test set, the train graphs."""
    check(cli("partition", "--dataset", "digits", "--clients", "1", "--seed", "0", "--train-subset", TRAIN_SUBSET,
              "--out", str(work / "shares"), "--test"), "fedsga-edge partition")
    check(cli("export", "--model", "resnet18_cifar", "--width", "0.125", "--splits", "1", "--train", "--num-classes",
              "10", "--seed", "0", "--out", str(work / "artifacts")), "fedsga-edge export --train")


def run_pair(work: Path, name: str, device: list[str], paths: dict[str, str], timeout: float) -> dict:
    """A coordinator on the host and ``device`` (a command prefix) against a fresh Mosquitto; the run folder."""
    from fedsga_edge.broker.launch import start_mosquitto

    run = work / f"run-{name}"
    broker = start_mosquitto(work / f"broker-{name}")
    common = ["--broker", broker.url, "--threads", "1", *RUN]
    env = os.environ | {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    logs = {k: open(work / f"{k}-{name}.log", "w") for k in ("coordinator", "device")}
    t0 = time.monotonic()
    coord = subprocess.Popen(cli("coordinator", "--run-dir", str(run), "--classes", str(work / "shares/dataset.json"),
                                 "--test-data", str(work / "shares/test"), "--device", "cpu", *common),
                             stdout=logs["coordinator"], stderr=subprocess.STDOUT, env=env)
    dev = subprocess.Popen([*device, "device", "--index", "0", "--backend", "onnx", "--state-dir", paths["state"],
                            "--data", paths["data"], "--artifacts", paths["artifacts"], *common],
                           stdout=logs["device"], stderr=subprocess.STDOUT, env=env)
    try:
        coord.wait(timeout=timeout)
        dev.wait(timeout=120)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in (coord, dev):
            if p.poll() is None:
                p.kill()
                p.wait()
        broker.stop()
        for f in logs.values():
            f.close()
    seconds = time.monotonic() - t0
    if coord.returncode != 0 or dev.returncode != 0:
        tails = {k: (work / f"{k}-{name}.log").read_text()[-2500:] for k in logs}
        sys.exit(f"the {name} run failed (coordinator {coord.returncode}, device {dev.returncode}):\n"
                 + "\n".join(f"--- {k}\n{t}" for k, t in tails.items()))
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    registered = json.loads((run / "devices.json").read_text())["client-000"]
    device = {"backend": registered.get("backend"), **registered.get("capabilities", {})}
    log = [json.loads(x) for x in (work / f"state-{name}" / "agent.log").read_text().splitlines() if x.strip()]
    rounds_s = [e["wall_s"] for e in log if e.get("event") == "round_end"]  # the device's own clock, per round
    return {"name": name, "dir": run, "records": recs, "seconds": seconds, "device": device, "rounds_s": rounds_s}


def _show(r: dict) -> str:
    cells = [f"round {r['round']}"] + [f"{k} {r[k]:.6f}" for k in (*LOSSES, *ACCURACIES)
                                       if isinstance(r.get(k), (int, float))]
    return ", ".join(cells + [f"bytes up/down {r.get('bytes_up')}/{r.get('bytes_down')}"])


def _rel_l2(a: dict, b: dict, keys: list[str]) -> float:
    import torch

    va = torch.cat([a[k].double().flatten() for k in keys])
    vb = torch.cat([b[k].double().flatten() for k in keys])
    return float((va - vb).norm() / vb.norm().clamp_min(1e-12))


def compare(a: dict, b: dict) -> list[str]:
    """Every difference beyond tolerance between the two runs' rounds and final weights (empty: they match)."""
    bad: list[str] = []
    if len(a["records"]) != len(b["records"]):
        return [f"{a['name']} has {len(a['records'])} rounds, {b['name']} {len(b['records'])}"]
    worst = 0.0
    for ra, rb in zip(a["records"], b["records"]):
        for k in EXACT:
            if ra.get(k) != rb.get(k):
                bad.append(f"round {ra['round']}: {k} {ra.get(k)!r} != {rb.get(k)!r}")
        for keys, rel, tol in ((LOSSES, True, LOSS_TOL), (ACCURACIES, False, ACC_TOL)):
            for k in keys:
                x, y = ra.get(k), rb.get(k)
                if (x is None) != (y is None):
                    bad.append(f"round {ra['round']}: {k} {x!r} vs {y!r}")
                elif x is not None:
                    d = abs(x - y) / (abs(y) if rel else 1.0)
                    worst = max(worst, d) if rel else worst
                    if d > tol:
                        bad.append(f"round {ra['round']}: {k} {x!r} vs {y!r} ({'rel' if rel else 'abs'} tol {tol:g})")
    import torch

    wa, wb = (torch.load(r["dir"] / "checkpoint.pt", map_location="cpu", weights_only=False)["model"]
              for r in (a, b))
    floats = [k for k in wb if wb[k].is_floating_point()]
    stats = [k for k in floats if "running_" in k]
    weights = [k for k in floats if k not in stats]
    dw, ds = _rel_l2(wa, wb, weights), _rel_l2(wa, wb, stats) if stats else 0.0
    print(f"largest loss difference {worst:.2g} (relative; tol {LOSS_TOL:g}); final weights {dw:.2g} and "
          f"BatchNorm statistics {ds:.2g} apart (relative L2 over {len(weights)} and {len(stats)} tensors; tol "
          f"{WEIGHT_TOL:g}, {STATS_TOL:g})")
    if dw > WEIGHT_TOL:
        bad.append(f"final weights differ by {dw:.3g} (relative L2; tol {WEIGHT_TOL:g})")
    if ds > STATS_TOL:
        bad.append(f"final BatchNorm statistics differ by {ds:.3g} (relative L2; tol {STATS_TOL:g})")
    return bad


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", type=Path, required=True, help="host path of a folder the arm64 system also sees")
    ap.add_argument("--inside", required=True, help="that folder's path inside the arm64 system")
    ap.add_argument("--enter", required=True, help="command prefix that runs a program inside the arm64 system")
    ap.add_argument("--venv", default="/opt/fedsga-edge/venv", help="the device's venv inside the arm64 system")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds one run may take")
    args = ap.parse_args(argv)
    work, inside, enter = args.work, args.inside.rstrip("/"), shlex.split(args.enter)

    t0 = time.monotonic()
    prepare(work)
    print(f"prepared the share and the train graphs in {time.monotonic() - t0:.0f} s", flush=True)
    machine = subprocess.run([*enter, "uname", "-m"], capture_output=True, text=True, check=True).stdout.strip()
    print(f"uname -m inside: {machine}", flush=True)
    if machine != "aarch64":
        sys.exit(f"the arm64 system reports {machine!r}, not aarch64")

    arm = run_pair(work, "aarch64", [*enter, f"{args.venv}/bin/fedsga-edge"],
                   {"state": f"{inside}/state-aarch64", "data": f"{inside}/shares/client-000",
                    "artifacts": f"{inside}/artifacts"}, args.timeout)
    host = run_pair(work, "x86_64", [sys.executable, "-c", NO_TORCH],
                    {"state": str(work / "state-x86_64"), "data": str(work / "shares/client-000"),
                     "artifacts": str(work / "artifacts")}, args.timeout)
    for r in (arm, host):
        d = r["device"]
        print(f"{r['name']} device: machine {d['machine']}, backend {d.get('backend', '?')}, onnxruntime "
              f"{d.get('onnxruntime', '?')}, its rounds {', '.join(f'{x:.1f}' for x in r['rounds_s'])} s, the run "
              f"{r['seconds']:.1f} s (coordinator start to exit)")
        for rec in r["records"]:
            print(f"  {_show(rec)}")
    if arm["device"]["machine"] != "aarch64":
        sys.exit(f"the device registered as {arm['device']['machine']!r}, not aarch64")
    bad = compare(arm, host)
    if bad:
        print("MISMATCH between the aarch64 and the x86_64 device:\n  " + "\n  ".join(bad))
        return 1
    print("the aarch64 and x86_64 devices' rounds match to float tolerance")
    return 0


if __name__ == "__main__":
    sys.exit(main())
