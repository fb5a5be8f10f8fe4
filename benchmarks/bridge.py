"""Devices at a site broker bridged to the coordinator's central broker, against all on one broker.

``broker-config --site`` writes the central Mosquitto's config (the coordinator's login and one bridge login
per site), ``broker-config --bridge`` the site's (its devices' logins and ACL, the bridge); both brokers run
on free 127.0.0.1 ports. The same seeded field run then runs twice, side by side: the coordinator on the
central broker and the devices on the site broker (bridged), and every process on the central broker
(single). Each process gets its own login and its key from the central config (the trial's setup). It
prints each round's seconds both ways and their ratio, and the small-message round trip over each path.

    nice python benchmarks/bridge.py --devices 3 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import pwd
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fedsga_edge.broker.config import (BridgeSpec, BrokerSpec, device_ids, read_bridge,  # noqa: E402
                                       write_broker_config)
from fedsga_edge.broker.launch import free_port, mosquitto_path, run_mosquitto  # noqa: E402
from fedsga_edge.trial import stop_all  # noqa: E402

MOSQUITTO = mosquitto_path()
CLI = [sys.executable, "-m", "fedsga_edge.cli.main"]
RUN = "sim-0"  # the field commands' run id for --seed 0


def flags(args: argparse.Namespace) -> list[str]:
    return ["--dataset", "digits", "--clients", str(args.devices), "--rounds", str(args.rounds), "--model",
            "resnet18_cifar", "--width", "0.125", "--seed", "0", "--max-batches", str(args.max_batches),
            "--threads", "1", "--eval-every", str(args.rounds)]


class Brokers:
    """The central broker and one site's, configured by broker-config, running on free loopback ports."""

    def __init__(self, root: Path, devices: int, qos_in: int = 0) -> None:
        ids = device_ids(devices)
        self.central_port, self.site_port = free_port(), free_port()
        self.central = write_broker_config(BrokerSpec(devices=tuple(ids), run=RUN, port=self.central_port,
                                                      bind="127.0.0.1", host="127.0.0.1", persistence=False,
                                                      sites=(("a", tuple(ids)),)), root / "central")
        bridge = BridgeSpec(read_bridge(str(self.central.credentials["site-a"])), qos_in=qos_in)
        self.site = write_broker_config(BrokerSpec(devices=tuple(ids), run=RUN, port=self.site_port, bind="127.0.0.1",
                                                   host="127.0.0.1", persistence=False, bridge=bridge),
                                        root / "site-a", keys=root / "central" / "keys")
        for conf in (self.central.conf, self.site.conf):  # as root Mosquitto would drop to user mosquitto
            with open(conf, "a") as f:
                f.write(f"\nuser {pwd.getpwuid(os.geteuid()).pw_name}\n")
        self.running = [run_mosquitto(self.central.conf, self.central_port, log=root / "central.log"),
                        run_mosquitto(self.site.conf, self.site_port, log=root / "site-a.log")]
        time.sleep(1.0)  # the bridge connects

    def url(self, login: str, bridged: bool) -> str:
        return (self.site if bridged and login != "coordinator" else self.central).urls[login]

    def close(self) -> None:
        for b in self.running[::-1]:
            b.stop()


def field_run(brokers: Brokers, out: Path, args: argparse.Namespace, bridged: bool) -> list[dict[str, Any]]:
    """The coordinator and ``args.devices`` device processes to the run's end: its metrics records."""
    keys = brokers.central.conf.parent / "keys"
    procs = []
    env = lambda login: {**os.environ, "FEDSGA_EDGE_BROKER": brokers.url(login, bridged)}
    out.mkdir(parents=True, exist_ok=True)
    logs = [open(out / "coordinator.out", "w")]
    procs.append(subprocess.Popen(CLI + ["coordinator", "--run-dir", str(out), "--keys", str(keys),
                                         "--register-timeout", "120"] + flags(args),
                                  stdout=logs[0], stderr=subprocess.STDOUT, env=env("coordinator")))
    for i, cid in enumerate(device_ids(args.devices)):
        logs.append(open(out / f"{cid}.out", "w"))
        procs.append(subprocess.Popen(CLI + ["device", "--index", str(i), "--state-dir", str(out / cid), "--key",
                                             str(keys / f"{cid}.key")] + flags(args),
                                      stdout=logs[-1], stderr=subprocess.STDOUT, env=env(cid)))
    try:
        rc = procs[0].wait(timeout=args.timeout)
        if rc != 0:
            raise RuntimeError(f"the coordinator exited {rc}: {(out / 'coordinator.out').read_text()[-2000:]}")
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        stop_all(dict(enumerate(procs)), logs, None)  # the trial's own: SIGTERM, then kill after 30 s
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def round_trip_ms(brokers: Brokers, bridged: bool, n: int = 40) -> float:
    """The median round trip of a 64-byte request from client-000 to the coordinator and back (QoS 1)."""
    import paho.mqtt.client as paho
    from urllib.parse import unquote, urlsplit

    def client(login: str, sub: str, on: Any) -> Any:
        u = urlsplit(brokers.url(login, bridged))
        c = paho.Client(paho.CallbackAPIVersion.VERSION2, client_id=login)
        c.username_pw_set(unquote(u.username or ""), unquote(u.password or ""))
        ready = threading.Event()
        c.on_connect = lambda cl, *a: (cl.subscribe(sub, qos=1), ready.set())
        c.on_socket_open = lambda cl, ud, s: s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c.on_message = on
        c.connect(u.hostname or "", int(u.port or 0))
        c.loop_start()
        ready.wait(5)
        return c

    got = threading.Event()
    co = client("coordinator", f"fedsga/{RUN}/up/+",
                lambda cl, ud, m: cl.publish(f"fedsga/{RUN}/down/client-000", m.payload, qos=1))
    dev = client("client-000", f"fedsga/{RUN}/down/client-000", lambda cl, ud, m: got.set())
    time.sleep(0.5)
    rtts = []
    try:
        for _ in range(n):
            got.clear()
            t = time.perf_counter()
            dev.publish(f"fedsga/{RUN}/up/client-000", b"x" * 64, qos=1)
            if got.wait(5):
                rtts.append((time.perf_counter() - t) * 1000)
    finally:
        for c in (co, dev):
            c.loop_stop()
            c.disconnect()
    return sorted(rtts)[len(rtts) // 2] if rtts else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=3)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-batches", type=int, default=4)
    p.add_argument("--qos-in", type=int, default=0, help="QoS of the messages bridged to the site (broker-config "
                   "--bridge-qos)")
    p.add_argument("--out", type=Path, default=Path("runs/bridge"))
    p.add_argument("--timeout", type=float, default=600)
    args = p.parse_args(argv)
    if MOSQUITTO is None:
        print("no mosquitto binary (apt-get install mosquitto)")
        return 2
    brokers = Brokers(args.out / "brokers", args.devices, args.qos_in)
    try:
        rtt = {b: round_trip_ms(brokers, b) for b in (False, True)}
        runs = {b: field_run(brokers, args.out / ("bridged" if b else "single"), args, b) for b in (True, False)}
    finally:
        brokers.close()
    print(f"{args.devices} devices, {args.rounds} rounds; bridge QoS in {args.qos_in}; load average "
          f"{os.getloadavg()[0]:.1f}")
    print(f"small-message round trip: one broker {rtt[False]:.2f} ms, bridged {rtt[True]:.2f} ms")
    for a, b in zip(runs[True], runs[False]):
        print(f"  round {a['round']}: bridged {a['wall_s']:.2f} s, one broker {b['wall_s']:.2f} s "
              f"({a['wall_s'] / b['wall_s']:.2f}x); updates {len(a['splits'])} / {len(b['splits'])}")
    tb, ts = (sum(r["wall_s"] for r in runs[x]) for x in (True, False))
    print(f"rounds in all: bridged {tb:.2f} s, one broker {ts:.2f} s: {tb / ts:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
