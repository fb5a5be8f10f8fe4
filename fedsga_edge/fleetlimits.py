"""A fleet's limits on one machine, for ``trial --fleet`` (docs/fleet.md, "A real fleet on one machine").

Two modes with the same interface (``Limits``): what a device process is started under, and where it
reaches the broker.

* ``cgroup+netns`` (root, a cgroup v1 ``cpu`` controller, ``ip`` and ``tc``): each device gets a cgroup
  ``/sys/fs/cgroup/cpu/<prefix>-<class>-<i>`` whose ``cpu.cfs_quota_us`` is its class's speed factor
  times the period (10 ms, ``PERIOD_US``; one CPU at factor 1; the devices run torch on one thread).
  One group per device, not per class: a device is its own machine, so two devices of a class must not
  share one quota.
  The quota is a ceiling: on a busy host a device gets less (its update reports the CPU seconds it
  got, ``cpu_s``, next to its wall-clock compute). Each device also gets its own network
  namespace, joined by a veth pair to a bridge on the host that holds the broker's address (a private
  ``10.x.0.0/24``), with a ``tbf`` rate limiter on both ends: the namespace's end shapes its uplink, the
  bridge's end its downlink. The round trip's delay is added in the device's transport
  (``fedsga_edge.transport.link``), since this kernel has no ``netem``. Everything is named with a
  prefix unique to the trial (``fsg<pid>``) and removed by ``close()`` (also on error).
* ``emulated`` (anything else, or on request): no OS limits; the device's transport sleeps for the
  delay, for its bytes over its link's rates, and after each stretch of compute for what a slower CPU
  would have added (``FleetLink``).

Torch-free (the trial's parent process imports it).
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .fleet import DeviceClass, Fleet, FleetError

__all__ = ["CGROUP_CPU", "MODES", "FleetSandbox", "class_speed", "real_limits_problem"]

CGROUP_CPU = Path("/sys/fs/cgroup/cpu")
MODES = ("cgroup+netns", "emulated")
PERIOD_US = 10_000
"""The quota's period: 10 ms, not the kernel's default 100 ms. CFS lets a group run at full speed until its
quota for the period is spent, so a device whose compute comes in stretches shorter than the period (a few
steps between waits on its link) ran them at nearly full speed under a 100 ms period: a quarter-core device's
round-2 compute was 0.2 s where a quarter of the fast devices' speed gives 0.7 s (benchmarks/RESULTS.md)."""
MIN_QUOTA_US = 1000  # the kernel's smallest quota


def real_limits_problem() -> str | None:
    """Why this machine cannot run devices under real limits (None: it can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not root (cgroups and network namespaces need root)"
    if not (CGROUP_CPU / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUP_CPU}"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"no `{tool}` command (iproute2)"
    return None


def class_speed(fleet: Fleet, cls: DeviceClass) -> float:
    """A class's speed factor relative to this host (what its CPU quota is made of)."""
    if fleet.host_gflops is None:
        raise FleetError(f"fleet file {fleet.path}: trial --fleet needs [host] gflops (or [host] profile) to turn "
                         f"classes.{cls.name}'s speed into a share of this machine's CPU")
    return cls.gflops / fleet.host_gflops


def _run(*cmd: str) -> None:
    res = subprocess.run(list(cmd), capture_output=True, text=True)
    if res.returncode != 0:
        raise OSError(f"`{' '.join(cmd)}` failed: {(res.stderr or res.stdout).strip()[:300]}")


@dataclass
class FleetSandbox:
    """cgroups per class and a namespace per device; ``open()`` builds them, ``close()`` removes them all."""

    fleet: Fleet
    devices: list[str]
    prefix: str = field(default_factory=lambda: f"fsg{os.getpid() % 100000}")
    subnet: str = ""  # "10.A.B": the bridge is .1, device i is .(i + 2)
    groups: dict[str, Path] = field(default_factory=dict)  # device -> its cgroup folder
    namespaces: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)  # host-side links to delete (the bridge, veths)
    classes: dict[str, DeviceClass] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.classes = self.fleet.assign(self.devices)
        if len(self.devices) > 250:
            raise FleetError("trial --fleet under real limits takes at most 250 devices (one /24)")
        if not self.subnet:
            pid = os.getpid()
            self.subnet = f"10.{200 + pid % 50}.{pid // 50 % 250}"

    @property
    def host(self) -> str:
        """The broker's address, reachable from every namespace and from the host."""
        return f"{self.subnet}.1"

    def namespace(self, i: int) -> str:
        return f"{self.prefix}d{i}"

    def open(self) -> FleetSandbox:
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def _open(self) -> None:
        for i, cid in enumerate(self.devices):
            cls = self.classes[cid]
            group = CGROUP_CPU / f"{self.prefix}-{cls.name}-{i}"
            group.mkdir()
            self.groups[cid] = group
            speed = class_speed(self.fleet, cls)
            period = max(PERIOD_US, math.ceil(MIN_QUOTA_US / speed)) if speed > 0 else PERIOD_US  # quota >= 1 ms
            (group / "cpu.cfs_period_us").write_text(str(period))
            quota = max(MIN_QUOTA_US, int(round(speed * period)))
            (group / "cpu.cfs_quota_us").write_text(str(quota))
        bridge = f"{self.prefix}br"
        _run("ip", "link", "add", bridge, "type", "bridge")
        self.links.append(bridge)
        _run("ip", "addr", "add", f"{self.host}/24", "dev", bridge)
        _run("ip", "link", "set", bridge, "up")
        for i, cid in enumerate(self.devices):
            cls, ns = self.classes[cid], self.namespace(i)
            hside, nside = f"{self.prefix}h{i}", f"{self.prefix}n{i}"
            _run("ip", "netns", "add", ns)
            self.namespaces.append(ns)
            _run("ip", "link", "add", hside, "type", "veth", "peer", "name", nside)
            self.links.append(hside)
            _run("ip", "link", "set", nside, "netns", ns)
            _run("ip", "link", "set", hside, "master", bridge)
            _run("ip", "link", "set", hside, "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{self.subnet}.{i + 2}/24", "dev", nside)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", nside, "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
            _run("tc", "qdisc", "add", "dev", hside, "root", *_tbf(cls.downlink_mbps))  # host -> device
            _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", nside, "root", *_tbf(cls.uplink_mbps))

    def command(self, i: int, argv: list[str]) -> list[str]:
        """``argv`` run inside device ``i``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(i), *argv]

    def join(self, cid: str) -> Any:
        """A ``preexec_fn`` part: move the starting process into ``cid``'s cgroup."""
        procs = self.groups[cid] / "cgroup.procs"

        def enter() -> None:
            procs.write_text(str(os.getpid()))
        return enter

    def quota(self, cid: str) -> float:
        """The CPU share device ``cid`` runs under (quota over period)."""
        group = self.groups[cid]
        return int((group / "cpu.cfs_quota_us").read_text()) / int((group / "cpu.cfs_period_us").read_text())

    def close(self) -> None:
        """Remove every namespace, link and cgroup made here (idempotent; errors are not raised)."""
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
        self.namespaces.clear()
        for link in reversed(self.links):
            subprocess.run(["ip", "link", "delete", link], capture_output=True)
        self.links.clear()
        for group in self.groups.values():
            _remove_group(group)
        self.groups.clear()


def _tbf(mbps: float) -> list[str]:
    """A token bucket at ``mbps``: a burst of 10 ms at the rate (at least 2 full packets), a queue of 2 s."""
    rate = int(mbps * 1e6)
    burst = max(3200, rate // 8 // 100)
    return ["tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "2s"]


def _remove_group(group: Path) -> None:
    """rmdir a cgroup once its processes have gone (they are moved to the root group if still there)."""
    import time

    for _ in range(50):
        try:
            group.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            try:
                for pid in (group / "cgroup.procs").read_text().split():
                    (CGROUP_CPU / "cgroup.procs").write_text(pid)
            except OSError:
                pass
            time.sleep(0.1)


def class_table(records: list[dict[str, Any]], fleet: Fleet, quotas: dict[str, float]) -> list[dict[str, Any]]:
    """Per class, over a trial's rounds (their ``timing``): the measured compute per step against the class's
    CPU share, and the measured wire seconds against the link's model (bytes over rates, plus one round trip
    per request and one for the round_start and update together). ``quotas``: class -> CPU share.

    ``cpu_got``: the CPU seconds the class's devices got over their compute seconds. A quota is a ceiling,
    so under it ``cpu_got`` is at most the quota; below the quota on a class with a full CPU's quota, the
    host was busy (other processes, or more devices than cores) and the steps' ratio between classes
    understates the quotas' ratio."""
    by_name = {c.name: c for c in fleet.classes}
    rows: dict[str, dict[str, Any]] = {}
    for rec in records:
        for tm in (rec.get("timing") or {}).values():
            cls = by_name.get(tm.get("class"))
            if cls is None or tm.get("done_s") is None:
                continue
            row = rows.setdefault(cls.name, {"class": cls.name, "quota": quotas.get(cls.name), "device_rounds": 0,
                                             "steps": 0, "compute_s": 0.0, "wire_s": 0.0, "wait_s": 0.0,
                                             "bytes_up": 0, "bytes_down": 0, "link_model_s": 0.0,
                                             "cpu_s": 0.0, "_cpu_compute_s": 0.0})
            row["device_rounds"] += 1
            row["steps"] += int(tm.get("steps") or 0)
            for key in ("compute_s", "wire_s", "wait_s"):
                row[key] += float(tm[key])
            row["bytes_up"] += int(tm["bytes_up"])
            row["bytes_down"] += int(tm["bytes_down"])
            if tm.get("cpu_s") is not None:  # a device that reports its CPU seconds (trial --fleet)
                row["cpu_s"] += float(tm["cpu_s"])
                row["_cpu_compute_s"] += float(tm["compute_s"])
            row["link_model_s"] += (tm["bytes_up"] * 8 / (cls.uplink_mbps * 1e6) + tm["bytes_down"] * 8
                                    / (cls.downlink_mbps * 1e6) + (int(tm.get("requests") or 0) + 1) * cls.rtt_ms / 1e3)
    out = [rows[c.name] for c in fleet.classes if c.name in rows]
    for row in out:
        row["compute_per_step_s"] = row["compute_s"] / row["steps"] if row["steps"] else None
        row["wire_over_model"] = row["wire_s"] / row["link_model_s"] if row["link_model_s"] > 0 else None
        cpu_compute = row.pop("_cpu_compute_s")
        row["cpu_got"] = row["cpu_s"] / cpu_compute if cpu_compute > 0 else None
    fastest = min((r["compute_per_step_s"] for r in out if r["compute_per_step_s"]), default=None)
    for row in out:
        row["step_ratio"] = row["compute_per_step_s"] / fastest if fastest and row["compute_per_step_s"] else None
    return out


def format_class_table(rows: list[dict[str, Any]], mode: str) -> str:
    """The table ``trial --fleet`` prints at the end."""
    lines = [f"fleet ({mode}): per class, over all rounds",
             f"{'class':<14}{'cpu':>6}{'got':>6}{'dev-rds':>8}{'steps':>7}{'s/step':>9}{'x fastest':>10}{'wire s':>9}"
             f"{'link model s':>13}{'wire/model':>11}{'wait s':>9}{'MB up':>8}{'MB down':>8}"]
    for r in rows:
        def f(v: Any, spec: str) -> str:
            return "-" if v is None else format(v, spec)
        lines.append(f"{r['class']:<14}{f(r['quota'], '.2f'):>6}{f(r.get('cpu_got'), '.2f'):>6}{r['device_rounds']:>8}{r['steps']:>7}"
                     f"{f(r['compute_per_step_s'], '.4f'):>9}{f(r['step_ratio'], '.2f'):>10}{r['wire_s']:>9.2f}"
                     f"{r['link_model_s']:>13.2f}{f(r['wire_over_model'], '.2f'):>11}{r['wait_s']:>9.2f}"
                     f"{r['bytes_up'] / 1e6:>8.2f}{r['bytes_down'] / 1e6:>8.2f}")
    lines.append("(cpu: each device's CPU quota; got: the CPU seconds its devices got over their compute seconds, "
                 "below the quota when the host was busy)")
    return "\n".join(lines)
