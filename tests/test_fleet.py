"""simulate --fleet (docs/fleet.md): the fleet file, the discrete-event schedule on the virtual clock,
the deadline and dropouts on that clock, per-device timing, determinism, and resource's speeds from the fleet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from _runs import tiny_config
from fedsga_edge.fleet import FleetError, load_fleet, parse_fleet, profile_gflops
from fedsga_edge.runfiles import TIMING_FIELDS
from fedsga_edge.simulation import Simulation, run_simulation

ROOT = Path(__file__).resolve().parents[1]

FAST = {"count": 1, "gflops": 50.0, "uplink_mbps": 200.0, "downlink_mbps": 400.0, "rtt_ms": 2.0}
SLOW = {"count": 1, "gflops": 0.5, "uplink_mbps": 2.0, "downlink_mbps": 8.0, "rtt_ms": 80.0}


def _toml(classes: dict[str, dict[str, Any]], extra: str = "") -> str:
    out = [extra]
    for name, keys in classes.items():
        out.append(f"[classes.{name}]")
        out += [f"{k} = {json.dumps(v)}" for k, v in keys.items()]
    return "\n".join(out) + "\n"


def _fleet(tmp_path: Path, classes: dict[str, dict[str, Any]], name: str = "fleet.toml", extra: str = "") -> str:
    p = tmp_path / name
    p.write_text(_toml(classes, extra))
    return str(p)


def _served(sim: Simulation) -> list[tuple[str, str, float]]:
    """(device, kind, virtual time) of every message the coordinator handles, in the order it handles them."""
    seen: list[tuple[str, str, float]] = []
    receive = sim.coordinator.receive

    def spy(msg: Any, now: float | None = None) -> Any:
        seen.append((msg.sender, msg.kind, now))
        return receive(msg, now)

    sim.coordinator.receive = spy  # type: ignore[method-assign]
    return seen


# -- the fleet file ---------------------------------------------------------------------------------------


def test_example_fleets_parse() -> None:
    fleet = load_fleet(ROOT / "fleets" / "mixed.toml")
    assert [(c.name, c.count) for c in fleet.classes] == [("pi4_wifi", 4), ("jetson_ethernet", 2), ("phone_lte", 4)]
    by = fleet.assign([f"d{i}" for i in range(10)])
    assert [by[f"d{i}"].name for i in (0, 3, 4, 5, 6, 9)] == ["pi4_wifi", "pi4_wifi", "jetson_ethernet",
                                                              "jetson_ethernet", "phone_lte", "phone_lte"]
    assert load_fleet(ROOT / "fleets" / "mixed-300.toml").size == 300


def test_speed_factor_and_profile(tmp_path: Path) -> None:
    # a profile with two splits at two batches: the largest batch per split counts, FLOPs over seconds summed
    rows = [{"split": 1, "variant": "fp32", "batch": 1, "flops_train_per_sample": 1e9, "train_step_ms": {"p50": 999.0}},
            {"split": 1, "variant": "fp32", "batch": 8, "flops_train_per_sample": 1e9, "train_step_ms": {"p50": 400.0}},
            {"split": 2, "variant": "fp32", "batch": 8, "flops_train_per_sample": 3e9, "train_step_ms": {"p50": 1600.0}},
            {"split": 2, "variant": "int8", "batch": 8, "flops_train_per_sample": 3e9, "train_step_ms": {"p50": 1.0}}]
    (tmp_path / "dev.json").write_text(json.dumps({"results": rows}))
    assert profile_gflops({"results": rows}) == pytest.approx((8e9 + 24e9) / 2.0 / 1e9)
    path = _fleet(tmp_path, {"a": {**FAST, "speed_factor": 0.25, "gflops": None},
                             "b": {**SLOW, "profile": "dev.json", "gflops": None}}, extra="[host]\ngflops = 40.0\n")
    text = Path(path).read_text().replace("gflops = null\n", "")
    Path(path).write_text(text)
    fleet = load_fleet(path)
    assert fleet.classes[0].gflops == pytest.approx(10.0)
    assert fleet.classes[1].gflops == pytest.approx(16.0)
    assert fleet.classes[1].availability == 1.0


BAD = [
    ({"nodes": {}}, "nodes"),
    ({"classes": {}}, "classes"),
    ({"classes": {"a": {**FAST, "speed": 3}}}, "classes.a.speed"),
    ({"classes": {"a": {k: v for k, v in FAST.items() if k != "uplink_mbps"}}}, "classes.a.uplink_mbps"),
    ({"classes": {"a": {**FAST, "count": 0}}}, "classes.a.count"),
    ({"classes": {"a": {**FAST, "count": 1.5}}}, "classes.a.count"),
    ({"classes": {"a": {**FAST, "gflops": "fast"}}}, "classes.a.gflops"),
    ({"classes": {"a": {**FAST, "gflops": 0}}}, "classes.a.gflops"),
    ({"classes": {"a": {**FAST, "speed_factor": 2.0}}}, "classes.a"),  # two speeds
    ({"classes": {"a": {k: v for k, v in FAST.items() if k != "gflops"}}}, "classes.a"),  # no speed
    ({"classes": {"a": {**{k: v for k, v in FAST.items() if k != "gflops"}, "speed_factor": 2.0}}},
     "classes.a.speed_factor"),  # relative to a host the file does not describe
    ({"classes": {"a": {**FAST, "downlink_mbps": -1.0}}}, "classes.a.downlink_mbps"),
    ({"classes": {"a": {**FAST, "rtt_ms": float("inf")}}}, "classes.a.rtt_ms"),
    ({"classes": {"a": {**FAST, "availability": 1.5}}}, "classes.a.availability"),
    ({"classes": {"a": {**FAST, "availability": 0}}}, "classes.a.availability"),
    ({"classes": {"a": {**{k: v for k, v in FAST.items() if k != "gflops"}, "profile": "missing.json"}}},
     "classes.a.profile"),
    ({"host": {"gflops": 1.0, "cores": 4}, "classes": {"a": FAST}}, "host.cores"),
    ({"server": {"gflops": -2.0}, "classes": {"a": FAST}}, "server.gflops"),
]


@pytest.mark.parametrize(("data", "key"), BAD, ids=[k for _, k in BAD])
def test_bad_fleet_names_the_key(data: dict[str, Any], key: str, tmp_path: Path) -> None:
    with pytest.raises(FleetError) as err:
        parse_fleet(data, "f.toml", base=tmp_path)
    msg = str(err.value)
    assert "f.toml" in msg and f" {key} " in msg + " ", msg


def test_bad_toml_and_counts(tmp_path: Path) -> None:
    (tmp_path / "x.toml").write_text("[classes.a\ncount = 1\n")
    with pytest.raises(FleetError, match="not valid TOML"):
        load_fleet(tmp_path / "x.toml")
    with pytest.raises(FleetError, match="does not exist"):
        load_fleet(tmp_path / "nope.toml")
    path = _fleet(tmp_path, {"a": FAST, "b": SLOW})
    with pytest.raises(ValueError, match="--clients"):  # before any data is loaded
        Simulation(tiny_config(fleet=path, clients=3))


# -- the schedule on the virtual clock -------------------------------------------------------------------


def test_fast_device_is_served_first(tmp_path: Path) -> None:
    """Two devices, three batches each: the fast one's requests all arrive (and are served) before the slow
    one's first activation; swapping the classes swaps the order. The default scheduler interleaves them."""
    orders = {}
    for name, classes in (("fast_first", {"fast": FAST, "slow": SLOW}), ("slow_first", {"slow": SLOW, "fast": FAST})):
        sim = Simulation(tiny_config(clients=2, rounds=1, max_batches=3, fleet=_fleet(tmp_path, classes, name)))
        seen = _served(sim)
        rec = sim.run_round(1)
        assert set(rec["splits"]) == {"client-000", "client-001"}
        times = [now for _, _, now in seen]
        assert times == sorted(times)  # served in virtual-time order
        orders[name] = [d for d, kind, _ in seen if kind == "activation"]
    a, b = "client-000", "client-001"
    assert orders["fast_first"] == [a] * 3 + [b] * 3
    assert orders["slow_first"] == [b] * 3 + [a] * 3
    sim = Simulation(tiny_config(clients=2, rounds=1, max_batches=3, device_order="fixed"))
    seen = _served(sim)
    sim.run_round(1)
    assert [d for d, kind, _ in seen if kind == "activation"] == [a, b] * 3


@pytest.mark.parametrize("server_gflops", [None, 0.5])
def test_round_time_is_the_hand_computed_sum(tmp_path: Path, server_gflops: float | None) -> None:
    """One device: the round lasts its round start's download, then per request its compute, upload and half
    round trip, and per reply (but the last, the update's ack) its download and half round trip; with
    ``[server] gflops`` also the server's three forwards of the suffix per activation."""
    cls = {"count": 1, "gflops": 2.0, "uplink_mbps": 3.0, "downlink_mbps": 12.0, "rtt_ms": 40.0}
    extra = f"[server]\ngflops = {server_gflops}\n" if server_gflops else ""
    sim = Simulation(tiny_config(clients=1, rounds=1, max_batches=2,
                                 fleet=_fleet(tmp_path, {"only": cls}, extra=extra)))
    msgs: list[tuple[str, str, int, int]] = []
    inner = sim.transport
    request, send = inner.request, inner.send

    def rec_request(src: str, dst: str, payload: bytes, *, timeout: float | None = None) -> bytes:
        reply = request(src, dst, payload, timeout=timeout)
        msgs.append((src, dst, len(payload), len(reply)))
        return reply

    def rec_send(src: str, dst: str, payload: bytes) -> None:
        msgs.append((src, dst, len(payload), 0))
        send(src, dst, payload)

    inner.request, inner.send = rec_request, rec_send  # type: ignore[method-assign]
    seen = _served(sim)
    rec = sim.run_round(1)
    k = rec["splits"]["client-000"]
    assert [kind for _, kind, _ in seen] == ["activation", "activation", "update"]
    half = cls["rtt_ms"] / 2e3
    (rs,) = [m for m in msgs if m[0] == "coordinator"]
    reqs = [m for m in msgs if m[0] == "client-000"]
    flops = 2 * 32 * sim.costs.train(k)  # two batches of 32 (the device holds hundreds of samples)
    compute = flops / (cls["gflops"] * 1e9)
    expected = rs[2] * 8 / 12e6 + half + compute + sum(m[2] * 8 / 3e6 + half for m in reqs) \
        + sum(m[3] * 8 / 12e6 + half for m in reqs[:-1])
    if server_gflops:
        expected += 2 * 3 * 32 * sim.costs.suffix_fwd(k) / (server_gflops * 1e9)
    assert rec["round_s"] == pytest.approx(expected, rel=1e-9)
    assert rec["fleet_s"] == pytest.approx(expected, rel=1e-9)
    tm = rec["timing"]["client-000"]
    assert set(tm) <= set(TIMING_FIELDS)
    assert tm["compute_s"] == pytest.approx(compute, abs=1e-6)
    assert tm["bytes_up"] == sum(m[2] for m in reqs) and tm["split"] == k
    assert tm["compute_s"] + tm["wire_s"] + tm["wait_s"] == pytest.approx(expected, abs=1e-5)


def test_deadline_acts_on_virtual_time(tmp_path: Path) -> None:
    """A deadline between the fast device's finish and the slow one's: the round closes exactly at it, with
    the fast device's update in and the slow device out, whatever the host took."""
    path = _fleet(tmp_path, {"fast": FAST, "slow": SLOW})
    full = Simulation(tiny_config(clients=2, rounds=1, max_batches=2, fleet=path)).run_round(1)
    done = {d: t["done_s"] for d, t in full["timing"].items()}
    assert done["client-000"] < done["client-001"]
    deadline = (done["client-000"] + full["round_s"]) / 2
    rec = Simulation(tiny_config(clients=2, rounds=1, max_batches=2, fleet=path, round_timeout=deadline)).run_round(1)
    assert rec["round_s"] == pytest.approx(deadline, abs=1e-9)
    assert list(rec["splits"]) == ["client-000"]
    assert rec["failures"] == {"client-001": "missed the round deadline"}
    slow = rec["timing"]["client-001"]
    assert slow["done_s"] is None and slow["compute_s"] + slow["wire_s"] <= deadline + 1e-6


def test_mergesfl_parks_a_held_device_until_its_merged_step_on_virtual_time(tmp_path: Path) -> None:
    """MergeSFL on a fast and a slow device: the fast device's activation is held until the slow one's
    arrives, so their activations alternate and the fast device's next one leaves only after the merged
    step's reply crossed its link; one server step per merged batch. With a deadline before the slow
    device's first activation, the held request gets its refusal when the round closes (nothing hangs)."""
    path = _fleet(tmp_path, {"fast": FAST, "slow": SLOW})
    sim = Simulation(tiny_config("mergesfl", clients=2, rounds=1, max_batches=2, fleet=path))
    steps = {"n": 0}
    opt = sim.coordinator.server.shared.opt
    opt_step = opt.step

    def counted(*a: Any, **kw: Any) -> Any:
        steps["n"] += 1
        return opt_step(*a, **kw)

    opt.step = counted  # type: ignore[method-assign]
    seen = _served(sim)
    rec = sim.run_round(1)
    a, b = "client-000", "client-001"
    assert rec["failures"] == {} and steps["n"] == 2
    acts = [(d, now) for d, kind, now in seen if kind == "activation"]
    assert [d for d, _ in acts] == [a, b, a, b]
    fast = rec["timing"][a]
    # the fast device's next activation: after the slow one's arrival released the step, one fast
    # link round trip and batch later (seconds earlier without the merge)
    assert acts[1][1] + FAST["rtt_ms"] / 1e3 < acts[2][1] < acts[1][1] + 1.0
    assert fast["wait_s"] > 10 * fast["compute_s"] and fast["bytes_down"] == rec["timing"][b]["bytes_down"]
    assert rec["bytes_down"] == sum(t["bytes_down"] for t in rec["timing"].values())
    first_slow = acts[1][1]
    sim = Simulation(tiny_config("mergesfl", clients=2, rounds=1, max_batches=2, fleet=path,
                                 round_timeout=first_slow / 2))
    seen = _served(sim)
    rec = sim.run_round(1)
    assert [(d, kind) for d, kind, _ in seen] == [(a, "activation")]
    assert rec["round_s"] == pytest.approx(first_slow / 2) and set(rec["failures"]) == {a, b}
    assert all(not c.busy for c in sim.clients)


def test_dropouts_on_virtual_time(tmp_path: Path) -> None:
    """Devices that miss a round (availability): without a deadline the coordinator is told at once; with one,
    they stay silent and the round lasts until the deadline. Which devices miss is the seed's."""
    flaky = {**SLOW, "count": 4, "gflops": 20.0, "availability": 0.5}
    path = _fleet(tmp_path, {"flaky": flaky})
    sim = Simulation(tiny_config(clients=4, rounds=1, max_batches=1, fleet=path))
    missed = sim.scheduler.missed(1)
    assert 0 < len(missed) < 4  # seed 0: some but not all (a draw that changed would show here)
    rec = sim.run_round(1)
    assert rec["failures"] == {d: "missed the round (fleet availability)" for d in sorted(missed)}
    assert set(rec["splits"]) == {f"client-00{i}" for i in range(4)} - missed
    assert all(rec["timing"][d].get("missed") for d in missed)
    assert rec["round_s"] == pytest.approx(max(rec["timing"][d]["done_s"] for d in rec["splits"]), rel=0.05)
    sim = Simulation(tiny_config(clients=4, rounds=1, max_batches=1, fleet=path, round_timeout=30.0))
    rec = sim.run_round(1)
    assert rec["round_s"] == pytest.approx(30.0)
    assert rec["failures"] == {d: "missed the round deadline" for d in sorted(missed)}
    assert any(sim.scheduler.missed(t) != missed for t in range(2, 12))  # drawn per round
    always = _fleet(tmp_path, {"flaky": {**flaky, "availability": 1.0}}, "always.toml")
    assert Simulation(tiny_config(clients=4, rounds=1, max_batches=1, fleet=always)).scheduler.missed(1) == set()


def _strip(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: v for k, v in r.items() if k != "wall_s"} for r in records]


def test_deterministic_from_the_seed(tmp_path: Path) -> None:
    path = str(ROOT / "fleets" / "mixed.toml")
    runs = []
    for seed in (0, 0, 1):
        out = tmp_path / f"run{len(runs)}"
        cfg = tiny_config(clients=10, rounds=2, max_batches=1, batch_size=16, fleet=path, seed=seed,
                          device_order="shuffled")
        summary = run_simulation(cfg, out)
        runs.append((_strip([json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]), summary))
    (a, sa), (b, sb), (c, _) = runs
    assert a == b
    assert sa["fleet_s"] == sb["fleet_s"] == pytest.approx(sum(r["fleet_s"] for r in a))
    assert sa["fleet_round_s"]["max"] == max(r["fleet_s"] for r in a)
    assert a != c  # another seed: other dropouts, other data, other times
    assert all(len(r["timing"]) == 10 for r in a)


def test_no_fleet_no_fleet_fields() -> None:
    rec = Simulation(tiny_config(clients=2, rounds=1, max_batches=1)).run_round(1)
    assert "timing" not in rec and "fleet_s" not in rec


# -- resource's speeds -------------------------------------------------------------------------------------


def test_resource_takes_speeds_from_the_fleet(tmp_path: Path) -> None:
    from fedsga_edge.coordinator.strategies.resource import Resource

    fleet = {"slow": {**SLOW, "gflops": 1.0}, "mid": {**SLOW, "gflops": 4.0}, "fast": {**FAST, "gflops": 64.0}}
    path = _fleet(tmp_path, fleet)
    clients = ["client-000", "client-001", "client-002"]
    flops = {0: 400, 1: 10, 2: 40, 3: 160}  # K = 3, p_ref = 2: a 4x faster device goes one split deeper
    strategies = [Resource(tiny_config("resource", fleet=path, speed_sigma=s), 3, clients, flops) for s in (0.5, 2.0)]
    for st in strategies:
        assert st.speed == {"client-000": 0.25, "client-001": 1.0, "client-002": 16.0}
        assert st.splits == {"client-000": 1, "client-001": 2, "client-002": 3}
    drawn = Resource(tiny_config("resource", speed_sigma=0.5), 3, clients, flops)
    assert drawn.speed != strategies[0].speed


def test_class_table_sets_cpu_got_against_the_quota(tmp_path: Path) -> None:
    """trial --fleet's per-class table: the CPU seconds a class's devices got over their compute seconds (what
    tells a busy host from a quota), next to the steps and the link model; devices without cpu_s leave it out."""
    from fedsga_edge.fleetlimits import class_table, format_class_table

    fleet = load_fleet(_fleet(tmp_path, {"fast": FAST, "slow": SLOW}))
    def tm(cls: str, compute: float, cpu: float | None) -> dict[str, Any]:
        t = {"class": cls, "compute_s": compute, "wire_s": 1.0, "wait_s": 0.0, "bytes_up": 250_000,
             "bytes_down": 1_000_000, "done_s": 5.0, "steps": 4, "requests": 4}
        return t | ({"cpu_s": cpu} if cpu is not None else {})
    records = [{"timing": {"a": tm("fast", 2.0, 1.8), "b": tm("slow", 8.0, 2.0)}},
               {"timing": {"a": tm("fast", 2.0, 1.6), "b": tm("slow", 8.0, None)}}]
    rows = {r["class"]: r for r in class_table(records, fleet, {"fast": 1.0, "slow": 0.25})}
    assert rows["fast"]["cpu_got"] == pytest.approx(3.4 / 4.0)
    assert rows["slow"]["cpu_got"] == pytest.approx(2.0 / 8.0)  # the round without cpu_s is not counted in it
    assert rows["slow"]["compute_per_step_s"] == pytest.approx(2.0) and rows["slow"]["step_ratio"] == pytest.approx(4.0)
    # 2 Mbit/s up, 8 down, 80 ms per request and one more: the link model per device-round
    assert rows["slow"]["link_model_s"] == pytest.approx(2 * (250_000 * 8 / 2e6 + 1_000_000 * 8 / 8e6 + 5 * 0.08))
    text = format_class_table(list(rows.values()), "cgroup+netns")
    assert "got" in text.splitlines()[1] and "0.85" in text.splitlines()[2] and "0.25" in text.splitlines()[3]


def test_a_class_warmup_is_added_once_to_each_devices_first_step(tmp_path: Path) -> None:
    """``warmup_s``: a fresh process's one-time work, on its first step only (round 1), not in later rounds."""
    def run(warmup: float) -> list[dict[str, Any]]:
        cls = dict(SLOW, count=2) | ({"warmup_s": warmup} if warmup else {})
        sim = Simulation(tiny_config(clients=2, rounds=2, max_batches=1, fleet=_fleet(tmp_path, {"slow": cls},
                                                                                      name=f"w{warmup}.toml")))
        return [sim.run_round(r) for r in (1, 2)]

    cold, warm = run(0.0), run(5.0)
    for cid in ("client-000", "client-001"):
        assert warm[0]["timing"][cid]["compute_s"] == pytest.approx(cold[0]["timing"][cid]["compute_s"] + 5.0)
        assert warm[1]["timing"][cid]["compute_s"] == pytest.approx(cold[1]["timing"][cid]["compute_s"])
    assert warm[0]["fleet_s"] > cold[0]["fleet_s"] + 5.0 - 1e-6 and warm[1]["fleet_s"] == pytest.approx(cold[1]["fleet_s"])
    with pytest.raises(FleetError, match="warmup_s must be >= 0"):
        parse_fleet({"classes": {"slow": dict(SLOW, warmup_s=-1.0)}}, "f.toml")
