"""Coordinator capacity: how far one coordinator goes as the devices per round grow.

Each run is a ``Simulation`` (the one round driver, coordinator and device roles of ``simulate``) with
light device compute (digits, resnet18_cifar at width 0.125, split 1, batches of 8, ``--max-batches``
per device), over the loopback transport or over a real Mosquitto on a free loopback port (one MQTT
connection per device and one for the coordinator, all in this process: the virtual devices are real
MQTT clients). For each transport, server side (``--server-copies shared`` / ``per-client``) and fleet
size it prints, for the last round (the first warms the models up):

- ``msg/s``: the requests the coordinator answered over the round's wall seconds;
- ``round_s``: the round's wall seconds;
- ``co_cpu_ms/dev``: CPU milliseconds the coordinator spent in its entry points (``receive`` and
  ``end_round``: the server steps and the aggregation) per device;
- ``co_share``: that CPU over the round's wall seconds (1.0 = one core busy with the coordinator alone);
- ``server_MB``: the most tensor memory the coordinator's server side held during the round (its copy
  and, with per-client copies, each device's copy with its optimizer state and each finished device's
  trained state), and that per device;
- ``rss_MB/dev``: the process's peak resident memory over the round per device (the devices' models,
  the data and the earlier runs of this process included: an upper bound).

The coordinator saturates where its share of a core stops leaving room: it is single-threaded (its entry
points run under one lock), so its requests per second are bounded by 1 / (its CPU per request). The last
lines print that bound for each server side and the fleet size at which one round's coordinator CPU alone
passes ``--round-budget`` seconds.

    python benchmarks/capacity.py                                   # 5..80 devices, loopback and mosquitto
    python benchmarks/capacity.py --devices 10,40 --transports loopback --rounds 2
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedsga_edge.config import FedSGAConfig, RunConfig, TrainConfig  # noqa: E402
from fedsga_edge.simulation import Simulation  # noqa: E402


def config(devices: int, copies: str, max_batches: int, rounds: int) -> RunConfig:
    """Light device compute: the smallest resnet at split 1, a few batches of 8 per device."""
    return RunConfig(strategy="static", split=1, dataset="digits", clients=devices, rounds=rounds,
                     model="resnet18_cifar", width=0.125, seed=0, device="cpu", server_copies=copies.replace("-", "_"),
                     eval_every=10_000, fedsga=FedSGAConfig(),
                     train=TrainConfig(local_epochs=1, batch_size=8, max_batches=max_batches))


def tensor_bytes(obj: Any, seen: set[int]) -> int:
    """Bytes of the tensors a server side holds: modules (parameters, gradients, buffers), optimizer state,
    state dicts, through dicts, lists and ``ServerCopy``-like objects; each storage counted once."""
    import torch

    if isinstance(obj, torch.Tensor):
        key = obj.untyped_storage().data_ptr()
        if key in seen or obj.device.type == "meta":
            return 0
        seen.add(key)
        return obj.untyped_storage().nbytes() + (tensor_bytes(obj.grad, seen) if obj.grad is not None else 0)
    if isinstance(obj, torch.nn.Module):
        return sum(tensor_bytes(t, seen) for t in (*obj.parameters(), *obj.buffers()))
    if isinstance(obj, torch.optim.Optimizer):
        return sum(tensor_bytes(v, seen) for st in obj.state.values() for v in st.values())
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    if hasattr(obj, "model") and hasattr(obj, "opt"):  # a ServerCopy
        return sum(tensor_bytes(v, seen) for v in (obj.model, obj.head, obj.opt))
    return 0


def server_bytes(co: Any) -> int:
    """What the coordinator's server side holds now: its own copy plus each device's copy and kept state."""
    side, seen = co.server, set()
    return sum(tensor_bytes(v, seen) for v in vars(side).values())


class CoordinatorTimer:
    """CPU seconds the coordinator spends in ``receive`` and ``end_round`` (on whichever thread calls them),
    and the peak bytes its server side held after a request."""

    def __init__(self, co: Any) -> None:
        self.cpu = 0.0
        self.requests = 0
        self.peak = 0
        self.co = co
        for name in ("receive", "end_round"):
            setattr(co, name, self._timed(getattr(co, name), count=name == "receive"))

    def _timed(self, fn: Any, *, count: bool) -> Any:
        def timed(*a: Any, **kw: Any) -> Any:
            if not count:  # end_round: every finished device's state is still held
                self.peak = max(self.peak, server_bytes(self.co))
            t0 = time.thread_time()
            try:
                return fn(*a, **kw)
            finally:
                self.cpu += time.thread_time() - t0
                self.requests += count
                if count and self.requests % 8 == 0:  # sampled, outside the CPU count: the benchmark's work
                    self.peak = max(self.peak, server_bytes(self.co))
        return timed


@contextlib.contextmanager
def peak_rss(interval: float = 0.02) -> Iterator[list[int]]:
    """The process's peak resident bytes while the block runs (sampled)."""
    proc, peak, stop = psutil.Process(), [psutil.Process().memory_info().rss], threading.Event()

    def sample() -> None:
        while not stop.wait(interval):
            peak[0] = max(peak[0], proc.memory_info().rss)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    try:
        yield peak
    finally:
        stop.set()
        th.join()
        peak[0] = max(peak[0], proc.memory_info().rss)


def mqtt_parties(port: int, run: str) -> tuple[Any, list[Any]]:
    """A transport factory giving each party its own MQTT connection to the broker on ``port``."""
    from fedsga_edge.transport.mqtt import MqttTransport

    opened: list[Any] = []

    def party(cid: str) -> Any:
        t = MqttTransport("127.0.0.1", port, run=run, client_id=cid, max_packet=1 << 20, request_timeout=120.0)
        opened.append(t)
        return t

    return party, opened


def wait_for_round_starts(sim: Simulation, timeout: float = 30.0) -> None:
    """Over MQTT a round start is one-way and arrives on the device's network thread: the in-process
    scheduler would skip a device not yet armed, so each round waits until every device has its start."""
    advance = sim.scheduler.advance

    def armed_first(co: Any, clock: Any, send: Any) -> None:
        end = time.monotonic() + timeout
        while not all(c.busy for c in sim.clients) and time.monotonic() < end:
            time.sleep(0.005)
        advance(co, clock, send)

    sim.scheduler.advance = armed_first  # type: ignore[method-assign]


def measure(devices: int, copies: str, transport: str, args: argparse.Namespace, bundle: Any,
            broker: Any) -> dict[str, Any]:
    """Run the rounds and return the last round's figures."""
    cfg = config(devices, copies, args.max_batches, args.rounds)
    opened: list[Any] = []
    party = None
    if transport == "mosquitto":
        party, opened = mqtt_parties(broker.port, f"cap{devices}{copies[0]}{os.getpid()}")
    try:
        sim = Simulation(cfg, bundle, transport=party)
        if party is not None:
            wait_for_round_starts(sim)
        timer = CoordinatorTimer(sim.coordinator)
        rounds = sim.rounds()
        for _ in range(args.rounds - 1):  # warm-up: the devices build their models in their first round
            next(rounds)
        cpu0, req0, timer.peak = timer.cpu, timer.requests, 0
        with peak_rss() as peak:
            rec = next(rounds)
    finally:
        for t in opened:
            t.close()
    wall = rec["wall_s"]
    cpu, req = timer.cpu - cpu0, timer.requests - req0
    return {"transport": transport, "copies": copies, "devices": devices, "requests": req,
            "msg_s": req / wall, "round_s": wall, "co_cpu_ms_dev": 1e3 * cpu / devices, "co_share": cpu / wall,
            "co_ms_req": 1e3 * cpu / max(req, 1), "rss_mb_dev": peak[0] / 2**20 / devices,
            "server_mb": timer.peak / 2**20,
            "failures": len(rec["failures"])}


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = ("| transport | server side | devices | requests | msg/s | round_s | co_cpu_ms/dev | co_share | co_ms/req "
            "| server_MB | server_MB/dev | rss_MB/dev | failures |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        out.append(f"| {r['transport']} | {r['copies']} | {r['devices']} | {r['requests']} | {r['msg_s']:.0f} | "
                   f"{r['round_s']:.2f} | {r['co_cpu_ms_dev']:.1f} | {r['co_share']:.2f} | {r['co_ms_req']:.2f} | "
                   f"{r['server_mb']:.1f} | {r['server_mb'] / r['devices']:.2f} | {r['rss_mb_dev']:.1f} | "
                   f"{r['failures']} |")
    return out


def saturation(rows: list[dict[str, Any]], budget: float) -> list[str]:
    """Per transport and server side: requests per second one core of coordinator can answer, and the
    devices per round whose coordinator CPU alone fills ``budget`` seconds."""
    lines = []
    for key in sorted({(r["transport"], r["copies"]) for r in rows}):
        rs = [r for r in rows if (r["transport"], r["copies"]) == key]
        big = max(rs, key=lambda r: r["devices"])
        per_req = big["co_ms_req"] / 1e3
        per_dev = big["co_cpu_ms_dev"] / 1e3
        lines.append(f"{key[0]} {key[1]}: coordinator CPU {1e3 * per_req:.2f} ms/request at {big['devices']} devices "
                     f"-> at most {1 / per_req:.0f} requests/s on one core; a {budget:.0f} s round's coordinator CPU "
                     f"is full at about {budget / per_dev:.0f} devices; its server side holds "
                     f"{big['server_mb'] / big['devices']:.2f} MB per device of the round; measured round_s grows "
                     f"{rs[0]['round_s']:.2f} -> {big['round_s']:.2f} s for {rs[0]['devices']} -> {big['devices']} "
                     "devices")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", default="5,10,20,40,80", help="fleet sizes, comma-separated")
    ap.add_argument("--transports", default="loopback,mosquitto")
    ap.add_argument("--copies", default="shared,per-client", help="server sides (--server-copies)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per run; the last is measured")
    ap.add_argument("--max-batches", type=int, default=2, help="local batches (requests) per device per round")
    ap.add_argument("--round-budget", type=float, default=60.0, help="seconds of a round, for the saturation line")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: the coordinator's one core)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    from fedsga_edge.data import load_dataset

    bundle = load_dataset("digits")
    rows = []
    with contextlib.ExitStack() as stack:
        broker = None
        if "mosquitto" in args.transports.split(","):
            from fedsga_edge.broker.launch import start_mosquitto

            broker = stack.enter_context(start_mosquitto(Path(stack.enter_context(tempfile.TemporaryDirectory()))))
        for transport in args.transports.split(","):
            for copies in args.copies.split(","):
                for n in (int(x) for x in args.devices.split(",")):
                    rows.append(measure(n, copies, transport, args, bundle, broker))
                    print(*table(rows[-1:])[2:], flush=True)
    print()
    print(f"host: {os.cpu_count()} cores, torch threads {args.threads}; command: python benchmarks/capacity.py "
          + " ".join(argv if argv is not None else sys.argv[1:]))
    print("\n".join(table(rows)))
    print()
    print("\n".join(saturation(rows, args.round_budget)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
