"""Fault scenarios of a field run, with real processes: a Mosquitto, the coordinator, N device agents.

Each scenario starts a fresh broker on a free 127.0.0.1 port and a fresh run folder, runs the
same tiny configuration, disturbs it (or not), and reports what the run made of it:

* ``baseline``: nothing happens; the reference for the others' accuracy.
* ``device_killed``: SIGKILL one agent the moment the server answers its first activation of
  round 2 (a bystander client reads its replies), restart it with the same state dir.
  The round must close at its deadline without it; it must rejoin from its saved state.
* ``coordinator_killed``: SIGKILL the coordinator once round 1 is in ``metrics.jsonl``,
  restart it with ``--resume RUN``; the devices keep running.
* ``broker_restart``: stop Mosquitto after round 1 and start it again on the same port
  (no persistence: sessions and subscriptions are lost); everyone reconnects. Round 2 may lose
  devices whose requests were in flight; round 3 must have them all.
* ``baseline_again``: the baseline once more, for how far two undisturbed runs differ (the
  order in which activations reach the server is not deterministic with several devices).

What each scenario does and why is in docs/protocol.md, "Faults".

    python benchmarks/faults.py --out runs/faults [--scenarios baseline,device_killed,...] \\
        [--clients 3] [--rounds 4] [--max-batches 6] [--round-timeout 60] [--json runs/faults/faults.json]

Adding a scenario is one function: decorate ``f(h: Harness) -> dict`` with ``@scenario(name,
help)``. It starts what it needs (``h.start_all()``, ``h.device(i)``, ``h.coordinator()``),
disturbs the run (``h.kill``, ``h.broker.restart``), waits for the end (``h.finish()``) and
returns extra columns; ``h.check(name, ok, detail)`` records what must hold, and the outcome is
``ok`` only if every check held. The faults and their checks are functions too
(``kill_device_mid_round`` + ``check_device_killed``, ...), so a scenario can chain several. Columns every row gets come from the run folder: rounds,
accuracy, failures, rejected messages (coordinator.log: refused requests and hellos, plus its
Peer's and transport's counters at the end; "unserved" are messages that reached the coordinator
while nothing served its address, i.e. during a restart), peak RSS (psutil).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from fedsga_edge.broker.launch import mosquitto_path, start_mosquitto

HERE = Path(__file__).resolve()
MOSQUITTO = mosquitto_path()


# -- settings and the scenario registry ----------------------------------------------------------

@dataclass
class Settings:
    """One tiny configuration for every scenario, so their accuracies compare."""

    clients: int = 3
    rounds: int = 3
    strategy: str = "fedsga"
    seed: int = 0
    round_timeout: float = 40.0  # the deadline a killed device's round waits for
    request_timeout: float = 15.0  # a device's wait for one reply (a lost request costs this much)
    startup_timeout: float = 240.0  # process start, data, model (slow on a busy 2-core machine)
    run_timeout: float = 600.0  # the whole run
    extra: list[str] = field(default_factory=lambda: ["--width", "0.25", "--local-epochs", "1", "--max-batches", "2",
                                                      "--batch-size", "32"])

    def run_flags(self) -> list[str]:
        return ["--dataset", "digits", "--model", "resnet18_cifar", "--clients", str(self.clients), "--rounds",
                str(self.rounds), "--strategy", self.strategy, "--seed", str(self.seed), "--round-timeout",
                str(self.round_timeout), *self.extra]


Scenario = Callable[["Harness"], "dict[str, Any] | None"]
SCENARIOS: dict[str, tuple[Scenario, str]] = {}


def scenario(name: str, help: str) -> Callable[[Scenario], Scenario]:
    """Register a scenario under ``name`` (``--scenarios`` picks them; the table shows them in order)."""
    def register(fn: Scenario) -> Scenario:
        if name in SCENARIOS:
            raise ValueError(f"scenario {name!r} registered twice")
        SCENARIOS[name] = (fn, help)
        return fn
    return register


# -- processes and their memory --------------------------------------------------------------------

@dataclass
class Proc:
    name: str
    role: str  # "coordinator" | "device"
    popen: subprocess.Popen
    log: Path
    peak_rss: int = 0

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


class RssMonitor:
    """Samples every process's resident set size (psutil) a few times a second; keeps the peak."""

    def __init__(self, interval: float = 0.2) -> None:
        self.procs: list[Proc] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-monitor", daemon=True)
        self._interval = interval
        self._thread.start()

    def add(self, proc: Proc) -> None:
        with self._lock:
            self.procs.append(proc)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with self._lock:
                procs = [p for p in self.procs if p.alive]
            for p in procs:
                try:
                    p.peak_rss = max(p.peak_rss, psutil.Process(p.popen.pid).memory_info().rss)
                except psutil.Error:
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


# -- watching the protocol from the broker --------------------------------------------------------

class ReplyWatch:
    """A bystander client reading the replies one device gets (the scenarios' brokers are open), so a
    fault can be timed by a protocol event, e.g. the first ``gradient`` of round 2: the server has
    then stepped on that device's activation, and the device has not sent its update yet.

    Frames and chunks are parsed as docs/protocol.md lays them out (msgpack frame, chunk reassembly,
    then the message codec); ``seen`` holds (kind, round) of every reply, in arrival order.
    """

    def __init__(self, port: int, run: str, device: str, *, on: tuple[str, int] | None = None,
                 timeout: float = 10.0) -> None:
        import paho.mqtt.client as mqtt
        from paho.mqtt.enums import CallbackAPIVersion

        from fedsga_edge.wire import Reassembler

        self.topic = f"fedsga/{run}/down/{device}"
        self.on = on
        self.hit = threading.Event()  # set when (kind, round) == on arrives
        self.seen: list[tuple[str, int]] = []
        self._parts = Reassembler(256 * 2**20, 120.0)
        subscribed = threading.Event()
        self._client = mqtt.Client(callback_api_version=CallbackAPIVersion.VERSION2,
                                   client_id=f"watch-{os.urandom(4).hex()}", clean_session=True)
        self._client.on_connect = lambda c, *_: c.subscribe(self.topic, qos=0)
        self._client.on_subscribe = lambda *_: subscribed.set()
        self._client.on_message = self._on_message
        self._client.connect("127.0.0.1", port)
        self._client.loop_start()
        if not subscribed.wait(timeout):
            self.close()
            raise ScenarioFailed(f"could not watch {self.topic}")

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        import msgpack

        from fedsga_edge.wire import decode

        try:
            frame = msgpack.unpackb(message.payload, raw=False)
            if frame.get("op") != "rep":
                return
            data = frame["p"] if frame.get("chunk") is None else self._parts.feed(frame["chunk"])
            if data is None:
                return
            msg = decode(bytes(data))
        except Exception:  # a bystander: anything odd is not its business
            return
        self.seen.append((msg.kind, msg.round))
        if self.on == (msg.kind, msg.round):
            self.hit.set()

    def close(self) -> None:
        self._client.disconnect()
        self._client.loop_stop()


# -- the harness a scenario drives -----------------------------------------------------------------

class ScenarioFailed(Exception):
    """A wait ran out or a process died early: the scenario cannot go on."""


class Harness:
    """One run folder, one broker, the processes of one scenario and what must hold at the end."""

    def __init__(self, folder: Path, settings: Settings) -> None:
        self.folder = folder
        self.s = settings
        if folder.exists():
            shutil.rmtree(folder)
        (folder / "logs").mkdir(parents=True)
        self.run_dir = folder / "run"
        self.broker = start_mosquitto(folder / "broker")  # anonymous, no persistence: the intruder needs an open broker
        self.monitor = RssMonitor()
        self.procs: list[Proc] = []
        self.coord: Proc | None = None
        self.devices: dict[int, Proc] = {}
        self.checks: list[dict[str, Any]] = []
        self.kept_lines: list[str] = []  # metrics lines a fault must not touch
        self.started = time.monotonic()

    # processes
    def _spawn(self, name: str, role: str, args: list[str]) -> Proc:
        n = sum(1 for p in self.procs if p.name == name)
        log = self.folder / "logs" / (f"{name}.out" if n == 0 else f"{name}.{n}.out")
        with open(log, "w") as out:
            popen = subprocess.Popen([sys.executable, "-m", "fedsga_edge.cli.main", *args], stdout=out,
                                     stderr=subprocess.STDOUT, env=os.environ | {"COLUMNS": "200"})
        proc = Proc(name, role, popen, log)
        self.procs.append(proc)
        self.monitor.add(proc)
        return proc

    def coordinator(self, *extra: str, resume: bool = False) -> Proc:
        """The coordinator (``--resume RUN`` continues the run from its checkpoint, settings from RUN)."""
        where = ["--resume", str(self.run_dir)] if resume else ["--run-dir", str(self.run_dir), *self.s.run_flags()]
        self.coord = self._spawn("coordinator", "coordinator", [
            "coordinator", "--broker", self.broker.url, *where, "--threads", "1",
            "--register-timeout", str(self.s.startup_timeout), *extra])
        return self.coord

    def state_dir(self, i: int) -> Path:
        return self.folder / "devices" / f"client-{i:03d}"

    def device(self, i: int, *extra: str) -> Proc:
        """Device agent ``i`` with its state dir (the same one after a restart)."""
        self.devices[i] = self._spawn(f"device-{i:03d}", "device", [
            "device", "--broker", self.broker.url, "--index", str(i), "--state-dir", str(self.state_dir(i)),
            "--threads", "1", "--request-timeout", str(self.s.request_timeout), *self.s.run_flags(), *extra])
        return self.devices[i]

    def start_all(self) -> None:
        self.coordinator()
        for i in range(self.s.clients):
            self.device(i)

    @staticmethod
    def kill(proc: Proc) -> None:
        """SIGKILL: no bye, no last words, like a power cut (the broker sends its last will)."""
        proc.popen.send_signal(signal.SIGKILL)
        proc.popen.wait(10)

    # waiting on what the processes write
    def _wait(self, what: str, probe: Callable[[], Any], timeout: float, poll: float = 0.05) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = probe()
            if got:
                return got
            if self.coord is not None and not self.coord.alive and self.coord.popen.returncode not in (0, None, -9):
                raise ScenarioFailed(f"the coordinator exited with {self.coord.popen.returncode} while waiting for "
                                     f"{what}; see {self.coord.log}")
            time.sleep(poll)
        raise ScenarioFailed(f"timed out after {timeout:g} s waiting for {what}")

    def metrics(self) -> list[dict[str, Any]]:
        return read_jsonl(self.run_dir / "metrics.jsonl")

    def wait_round(self, t: int, timeout: float | None = None) -> dict[str, Any]:
        """The record of round ``t`` once it is in metrics.jsonl."""
        timeout = self.s.startup_timeout + self.s.round_timeout * t if timeout is None else timeout
        return self._wait(f"round {t} in metrics.jsonl",
                          lambda: next((r for r in self.metrics() if r.get("round") == t), None), timeout)

    def agent_events(self, i: int) -> list[dict[str, Any]]:
        return read_jsonl(self.state_dir(i) / "agent.log")

    def wait_agent(self, i: int, event: str, timeout: float | None = None, **fields: Any) -> dict[str, Any]:
        """The first event ``event`` (with these fields) in device ``i``'s agent.log."""
        timeout = self.s.startup_timeout + self.s.round_timeout * self.s.rounds if timeout is None else timeout
        return self._wait(f"{event} {fields} in device {i}'s agent.log",
                          lambda: next((e for e in self.agent_events(i) if e.get("event") == event
                                        and all(e.get(k) == v for k, v in fields.items())), None), timeout)

    def wait_event(self, what: str, event: threading.Event, timeout: float) -> None:
        """Block until ``event`` is set (a protocol event seen by a ReplyWatch), at once, no polling."""
        deadline = time.monotonic() + timeout
        while not event.wait(min(0.5, max(deadline - time.monotonic(), 0))):
            if time.monotonic() >= deadline:
                raise ScenarioFailed(f"timed out after {timeout:g} s waiting for {what}")
            if self.coord is not None and not self.coord.alive and self.coord.popen.returncode not in (0, None, -9):
                raise ScenarioFailed(f"the coordinator exited while waiting for {what}; see {self.coord.log}")

    def finish(self) -> None:
        """Wait for the coordinator to end the run, then for the agents it said bye to."""
        assert self.coord is not None
        try:
            self.coord.popen.wait(self.s.run_timeout)
        except subprocess.TimeoutExpired:
            raise ScenarioFailed(f"the run did not end within {self.s.run_timeout:g} s") from None
        for p in self.devices.values():
            try:
                p.popen.wait(30)
            except subprocess.TimeoutExpired:
                pass

    def check(self, name: str, ok: bool, detail: Any = None) -> bool:
        """Something the scenario needs to hold; any failed check makes the outcome FAILED."""
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    def close(self) -> None:
        for p in self.procs:
            if p.alive:
                p.popen.terminate()
        for p in self.procs:
            try:
                p.popen.wait(15)
            except subprocess.TimeoutExpired:
                p.popen.kill()
        self.monitor.close()
        self.broker.stop()

    # what every row reports
    def common_checks(self) -> None:
        rows = self.metrics()
        rounds = [r["round"] for r in rows]
        self.check("every round once in metrics.jsonl", rounds == list(range(1, self.s.rounds + 1)), rounds)
        self.check("the coordinator exited 0", self.coord is not None and self.coord.popen.returncode == 0,
                   None if self.coord is None else self.coord.popen.returncode)
        self.check("summary.json written", (self.run_dir / "summary.json").exists())

    def report(self) -> dict[str, Any]:
        rows = self.metrics()
        summary = {}
        if (self.run_dir / "summary.json").exists():
            summary = json.loads((self.run_dir / "summary.json").read_text())
        events = read_jsonl(self.run_dir / "coordinator.log")
        refused = sum(e.get("event") in ("request_refused", "hello_refused") for e in events)
        end = next((e for e in reversed(events) if e.get("event") == "run_end"), {})
        counters = end.get("transport_counters", {})
        dropped = {k: counters.get(k, 0) for k in ("garbage", "spoofed", "rejected", "no_handler", "late_replies",
                                                   "duplicates", "handler_errors")}
        rss = {role: max((p.peak_rss for p in self.procs if p.role == role), default=0)
               for role in ("coordinator", "device")}
        return {
            "rounds": len(rows),
            "final_acc": summary.get("final_acc", rows[-1].get("test_acc") if rows else None),
            "failures": sum(len(r.get("failures", {})) for r in rows),
            "failures_by_round": {r["round"]: r.get("failures", {}) for r in rows if r.get("failures")},
            "rejected": refused + end.get("peer_errors", 0) + sum(counters.get(k, 0) for k in
                                                                   ("garbage", "spoofed", "rejected", "handler_errors")),
            "unserved": counters.get("no_handler", 0),  # arrived while nothing served the address (a restart)
            "refused_requests": refused,
            "acc_by_round": [r.get("test_acc") for r in rows],
            "transport_dropped": dropped,
            "peak_rss_mb": {k: round(v / 2**20, 1) for k, v in rss.items()},
            "wall_s": round(time.monotonic() - self.started, 1),
        }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every complete JSON line of ``path`` (a line being written, or a torn one, is skipped)."""
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


# -- faults and what must hold after them (scenarios and tests compose these) --------------------

ACTIVATION_BYTES = 256 * 1024  # under one activation of the tiny config at any split (32 x 64 x 8 x 8 float32 = 512 KiB)


def kill_device_mid_round(h: Harness, i: int, t: int) -> dict[str, Any]:
    """SIGKILL device ``i`` in round ``t`` the moment the server answers its first activation (a
    ``gradient`` reply: the server has stepped on its batch) and before its update; then start it
    again on the same state dir, where round t-1's state is saved."""
    victim = f"client-{i:03d}"
    watch = ReplyWatch(h.broker.port, f"sim-{h.s.seed}", victim, on=("gradient", t))
    try:
        h.wait_event(f"{victim}'s first gradient of round {t}", watch.hit,
                     h.s.startup_timeout + h.s.round_timeout * t)
        h.kill(h.devices[i])
        seen = list(watch.seen)
    finally:
        watch.close()
    h.device(i)
    return {"victim": victim, "victim_gradients_before_kill": seen.count(("gradient", t))}


def check_device_killed(h: Harness, i: int, t: int, later: list[int]) -> dict[str, Any]:
    """Round ``t`` closed at its deadline without device ``i`` (after it had sent activations); it
    restarted from its saved state and took part in rounds ``later``."""
    victim = f"client-{i:03d}"
    rows = {r["round"]: r for r in h.metrics()}
    rt = rows.get(t, {})
    h.check(f"round {t} closed without the killed device", victim not in rt.get("splits", {})
            and rt.get("failures", {}).get(victim) == "missed the round deadline", rt.get("failures"))
    h.check(f"round {t} waited for its deadline", rt.get("round_s", 0) >= h.s.round_timeout - 1, rt.get("round_s"))
    end = next((e for e in read_jsonl(h.run_dir / "coordinator.log")
                if e.get("event") == "round_end" and e.get("round") == t), {})
    up = end.get("bytes_up_by_device", {}).get(victim, 0)
    h.check(f"it had sent activations in round {t}", up >= ACTIVATION_BYTES, up)
    took = [r for r in later if victim in rows.get(r, {}).get("splits", {})]
    h.check("it took part in the rounds after", took == later, took)
    starts = [e for e in h.agent_events(i) if e.get("event") == "agent_start"]
    h.check("the restarted agent restored its state", len(starts) == 2 and starts[-1].get("restored") is True
            and starts[-1].get("rounds_done") == t - 1, starts[-1:])
    return {f"victim_bytes_up_round{t}": up, f"round{t}_s": round(rt.get("round_s", 0.0), 1)}


def restart_broker_after(h: Harness, t: int, down_s: float = 2.0) -> None:
    """Once round ``t`` is in metrics.jsonl (round t+1 is starting), stop Mosquitto for ``down_s``."""
    h.wait_round(t)
    h.broker.restart(down_s=down_s)


def check_every_device_in(h: Harness, t: int) -> None:
    rec = next((r for r in h.metrics() if r["round"] == t), {})
    h.check(f"every device in round {t}", len(rec.get("splits", {})) == h.s.clients, rec.get("splits"))


def kill_coordinator_after(h: Harness, t: int) -> dict[str, Any]:
    """SIGKILL the coordinator once round ``t`` is in metrics.jsonl, restart it with ``--resume RUN``."""
    h.wait_round(t)
    h.kept_lines = (h.run_dir / "metrics.jsonl").read_text().splitlines()[:t]
    h.kill(h.coord)
    down = time.time()
    time.sleep(1.0)
    h.coordinator(resume=True)
    return {"killed_at": down}


def check_resumed(h: Harness, t: int, killed_at: float) -> dict[str, Any]:
    after = (h.run_dir / "metrics.jsonl").read_text().splitlines()
    h.check(f"rounds 1..{t} kept byte for byte", after[:t] == h.kept_lines)
    resumed = [e for e in read_jsonl(h.run_dir / "coordinator.log") if e.get("event") == "resume"]
    h.check(f"resumed from round {t}", [e.get("from_round") for e in resumed] == [t], resumed)
    h.check("the devices were not restarted", all(sum(p.name == f"device-{i:03d}" for p in h.procs) == 1
                                                  for i in range(h.s.clients)))
    rows = h.metrics()
    return {"devices_in_redone_round": len(rows[t]["splits"]) if len(rows) > t else 0,
            "resumed_after_s": round(resumed[0]["ts"] - killed_at, 1) if resumed else None}


# -- the scenarios ---------------------------------------------------------------------------------

@scenario("baseline", "nothing goes wrong: the reference run")
def baseline(h: Harness) -> dict[str, Any]:
    h.start_all()
    h.finish()
    h.common_checks()
    h.check("no failures", all(not r.get("failures") for r in h.metrics()))
    return {}


@scenario("baseline_again", "the reference run once more: how far two undisturbed runs differ")
def baseline_again(h: Harness) -> dict[str, Any]:
    return baseline(h)


@scenario("device_killed", "SIGKILL the last device while it sends round 2's activations, restart it on its state")
def device_killed(h: Harness) -> dict[str, Any]:
    i = h.s.clients - 1
    h.start_all()
    info = kill_device_mid_round(h, i, 2)
    h.finish()
    h.common_checks()
    return info | check_device_killed(h, i, 2, later=list(range(3, h.s.rounds + 1)))


@scenario("coordinator_killed", "SIGKILL the coordinator after round 1, restart it with --resume RUN")
def coordinator_killed(h: Harness) -> dict[str, Any]:
    h.start_all()
    info = kill_coordinator_after(h, 1)
    h.finish()
    h.common_checks()
    return check_resumed(h, 1, info["killed_at"])


@scenario("broker_restart", "stop Mosquitto after round 1, start it again on the same port 2 s later")
def broker_restart(h: Harness) -> dict[str, Any]:
    h.start_all()
    restart_broker_after(h, 1)
    h.finish()
    h.common_checks()
    check_every_device_in(h, 3)  # round 2 may lose requests in flight during the restart; round 3 may not
    return {}


@scenario("hostile_device", "an intruder on the open broker: garbage, a hypothesis fuzz, NaN / unknown-device / "
          "other-round activations, replays, stale rounds, 160 MiB of half-sent chunks (benchmarks/hostile.py)")
def hostile_device(h: Harness) -> dict[str, Any]:
    sys.path.insert(0, str(HERE.parent))
    import hostile  # benchmarks/hostile.py: the intruder, its attacks and what each must get back

    victim, other = "client-000", f"client-{h.s.clients - 1:03d}"
    h.coordinator()
    h._wait("the coordinator to serve", lambda: hostile.logged(h.run_dir, "service_open"), h.s.startup_timeout)
    ix = hostile.Intruder("127.0.0.1", h.broker.port, run=f"sim-{h.s.seed}")
    rep = hostile.Report()
    try:  # the same stages as benchmarks/hostile.py: coordinator alone, then device 0, then the rest
        hostile.attack_idle(ix, rep, victim=victim, other=other, examples=60)
        h.device(0)
        h._wait("device 0 to register", lambda: hostile.logged(h.run_dir, "hello_ack", device=victim),
                h.s.startup_timeout)
        hostile.attack_device(ix, rep, victim=victim, other=other, examples=20)
        hostile.flood(ix, rep, 160)
        for i in range(1, h.s.clients):
            h.device(i)
        hostile.attack_rounds(ix, rep, h.run_dir, victim=victim, other=other, misdeclared_mb=16)
    except (TimeoutError, RuntimeError) as exc:
        raise ScenarioFailed(f"the intruder could not go on: {exc}") from exc
    finally:
        ix.close()
    h.finish()
    h.common_checks()
    h.check("every hostile request refused as expected", not rep.problems, rep.problems[:5])
    h.check("no failures", all(not r.get("failures") for r in h.metrics()),
            [r.get("failures") for r in h.metrics()])
    return {"hostile_messages": sum(v for k, v in rep.sent.items() if k != "flood:chunks"),
            "must_show": {k: v[1] for k, v in rep.must_show.items()}}


# -- running and reporting -------------------------------------------------------------------------

def run_scenario(name: str, out: Path, settings: Settings) -> dict[str, Any]:
    """Run one registered scenario in ``out/name``; its row (outcome, checks, columns)."""
    fn, _ = SCENARIOS[name]
    h = Harness(out / name, settings)
    row: dict[str, Any] = {"scenario": name}
    try:
        row.update(fn(h) or {})
    except ScenarioFailed as exc:
        h.check("scenario ran to the end", False, str(exc))
    finally:
        h.close()
    row.update(h.report())
    failed = [c["check"] for c in h.checks if not c["ok"]]
    row["outcome"] = "ok" if not failed else "FAILED: " + "; ".join(failed)
    row["checks"] = h.checks
    return row


def table(rows: list[dict[str, Any]], rounds: int) -> str:
    """Markdown: one row per scenario, accuracy against the baseline's."""
    ref = next((r["final_acc"] for r in rows if r["scenario"] == "baseline" and r.get("final_acc") is not None), None)
    def last3(r: dict[str, Any]) -> float | None:
        accs = [a for a in r.get("acc_by_round", []) if a is not None][-3:]
        return sum(accs) / len(accs) if accs else None

    ref3 = next((last3(r) for r in rows if r["scenario"] == "baseline"), None)

    def vs(value: float | None, base: float | None, name: str) -> str:
        if value is None:
            return "-"
        return f"{value:.4f}" + (f" ({value - base:+.4f})" if base is not None and name != "baseline" else "")

    head = ("| scenario | outcome | rounds | final acc (vs baseline) | mean acc, last 3 rounds (vs baseline) "
            "| device-rounds missed | rejected (unserved) msgs | peak RSS coordinator / agent (MB) | wall s |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        rss = r["peak_rss_mb"]
        lines.append(f"| {r['scenario']} | {r['outcome']} | {r['rounds']}/{rounds} "
                     f"| {vs(r.get('final_acc'), ref, r['scenario'])} | {vs(last3(r), ref3, r['scenario'])} "
                     f"| {r['failures']} | {r['rejected']} ({r['unserved']}) "
                     f"| {rss['coordinator']:.0f} / {rss['device']:.0f} | {r['wall_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("runs/faults"))
    ap.add_argument("--scenarios", default="baseline,device_killed,coordinator_killed,broker_restart",
                    help=f"comma-separated, of: {', '.join(SCENARIOS)}")
    ap.add_argument("--clients", type=int, default=Settings.clients)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--strategy", default=Settings.strategy)
    ap.add_argument("--seed", type=int, default=Settings.seed)
    ap.add_argument("--max-batches", type=int, default=6, help="local batches per round (0 = all)")
    ap.add_argument("--round-timeout", type=float, default=60.0, help="the deadline a killed device's round waits for")
    ap.add_argument("--request-timeout", type=float, default=Settings.request_timeout)
    ap.add_argument("--json", type=Path, default=None, help="write every row (with its checks) here")
    ap.add_argument("--from-json", type=Path, default=None, help="only print the table of an earlier --json")
    args = ap.parse_args(argv)
    if args.from_json is not None:
        saved = json.loads(args.from_json.read_text())
        print(table(saved["rows"], saved["settings"]["rounds"]))
        return 0
    names = [n.strip() for n in args.scenarios.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    if MOSQUITTO is None:
        ap.error("no mosquitto binary (Debian/Ubuntu: apt-get install mosquitto)")
    if args.rounds < 3:
        ap.error("--rounds must be >= 3: the scenarios disturb round 2 and look at the rounds after")
    settings = Settings(clients=args.clients, rounds=args.rounds, strategy=args.strategy, seed=args.seed,
                        round_timeout=args.round_timeout, request_timeout=args.request_timeout)
    settings.extra[settings.extra.index("--max-batches") + 1] = str(args.max_batches)
    rows = []
    for name in names:
        print(f"[faults] {name}: {SCENARIOS[name][1]}", flush=True)
        rows.append(run_scenario(name, args.out, settings))
        r = rows[-1]
        print(f"[faults] {name}: {r['outcome']} ({r['rounds']} rounds, acc {r['final_acc']}, {r['wall_s']} s)",
              flush=True)
    print(table(rows, settings.rounds))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"settings": vars(settings), "rows": rows}, indent=2, default=str))
    return 0 if all(r["outcome"] == "ok" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
