"""A device's own latency profile: read and summarised on the device, reported in its hello,
checked by the coordinator as hostile input, and turned by ``--strategy resource`` into that device's split
instead of a fleet's or a drawn speed."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import pytest
from _runs import tiny_config
from typer.testing import CliRunner

from fedsga_edge.coordinator.strategies.resource import Resource
from fedsga_edge.latency import (MAX_TEXT, ProfileError, hello_profile, hello_profile_problem, read_profile,
                                 split_latency)
from fedsga_edge.runbuild import coordinator_service, device_agent
from fedsga_edge.transport import LoopbackTransport, Peer

MODEL, K = "resnet18_cifar", 3  # p_ref = 2
BASE_MS = (1.0, 2.0, 4.0)  # train-step ms per sample at splits 1..3 of the median device


def report(scale: float = 1.0, *, arch: str = MODEL, width: float = 0.25, splits: int = K) -> dict[str, Any]:
    """A `fedsga-edge profile --json` report as the profiler writes it (two batches, a forward and a train step)."""
    rows = [{"split": k, "depth": k, "variant": "fp32", "batch": b, "latency_ms": {"p50": ms * scale * b / 3},
             "train_step_ms": {"p50": ms * scale * b}}
            for k, ms in zip(range(1, splits + 1), BASE_MS) for b in (1, 32)]
    rows.append({"split": 1, "variant": "int8", "batch": 64, "latency_ms": {"p50": 0.001}})  # not fp32: ignored
    return {"device": {"cpu": "Cortex-A72 " * 40, "runtime": "onnxruntime", "cores_logical": 4},
            "model": {"arch": arch, "width": width, "num_blocks": 5}, "results": rows}


def write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data))
    return path


# -- the device's side: the file, and the summary its hello carries -------------------------------------------

def test_the_hello_carries_k_numbers_of_seconds_per_sample_and_short_strings() -> None:
    got = hello_profile(report(), MODEL, K, width=0.25)
    assert set(got) == {"model", "runtime", "cpu", "sample_s"} and got["model"] == MODEL
    assert got["sample_s"] == pytest.approx({"1": 1e-3, "2": 2e-3, "3": 4e-3})  # the train step, largest batch
    assert len(got["cpu"]) == MAX_TEXT and got["runtime"] == "onnxruntime"
    assert hello_profile_problem(got, MODEL, K) is None  # what a device sends is what a coordinator accepts


@pytest.mark.parametrize("bad, match", [
    (report(arch="vit_tiny_c32"), "measured model 'vit_tiny_c32', but this run trains 'resnet18_cifar'"),
    (report(width=1.0), "at width 1, but this run's --width is 0.25"),
    (report(splits=2), r"no fp32 latency for split\(s\) \[3\]"),
    ({"results": []}, r"does not name its model"),
    (report() | {"results": [{"split": "one", "variant": "fp32", "latency_ms": {"p50": 1}}]}, r"results\[0\] needs"),
    (report() | {"results": [{"split": 1, "batch": 1, "latency_ms": {"p50": -1.0}}]}, r"results\[0\] has -0.001 s"),
])
def test_a_profile_of_another_model_or_with_a_split_missing_is_refused_naming_why(bad, match) -> None:
    with pytest.raises(ProfileError, match=match):
        hello_profile(bad, MODEL, K, width=0.25, where="--latency-profile p.json")


def test_a_missing_or_malformed_file_is_named(tmp_path) -> None:
    with pytest.raises(ProfileError, match="does not exist"):
        read_profile(tmp_path / "nope.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="bad.json is not JSON"):
        read_profile(tmp_path / "bad.json")


def _cli(args: list[str]):
    from fedsga_edge.cli.main import app

    return CliRunner().invoke(app, args, env={"COLUMNS": "300"})


def test_the_device_command_refuses_a_bad_profile_before_it_reaches_the_broker(tmp_path) -> None:
    base = ["device", "--broker", "mqtt://127.0.0.1:1", "--index", "0", "--state-dir", str(tmp_path / "s"),
            "--model", MODEL, "--width", "0.25"]
    (tmp_path / "bad.json").write_text("[1, 2")
    for path, why in ((tmp_path / "nope.json", "does not exist"), (tmp_path / "bad.json", "is not JSON"),
                      (write(tmp_path / "vit.json", report(arch="vit_tiny_c32")), "measured model 'vit_tiny_c32'")):
        res = _cli(base + ["--latency-profile", str(path)])
        assert res.exit_code == 2 and why in res.output and "broker" not in res.output, res.output
    res = _cli(["trial", "--clients", "2", "--device-profiles", str(tmp_path / "s2")])
    assert res.exit_code == 2 and "is not a folder" in res.output, res.output
    (tmp_path / "empty").mkdir()
    res = _cli(["trial", "--clients", "2", "--device-profiles", str(tmp_path / "empty")])
    assert res.exit_code == 2 and "has no client-NNN.json" in res.output, res.output


# -- the coordinator's side: the hello field is hostile input ---------------------------------------------------

GOOD = {"model": MODEL, "runtime": "torch", "cpu": "x86", "sample_s": {"1": 0.001, "2": 0.002, "3": 0.004}}


@pytest.mark.parametrize("bad, why", [
    ([1, 2, 3], "profile must be a map"),
    (GOOD | {"extra": 1}, "unknown field(s) ['extra']"),
    (GOOD | {"model": "vit_b16"}, "profile is of model 'vit_b16', but this run trains 'resnet18_cifar'"),
    ({k: v for k, v in GOOD.items() if k != "model"}, "profile is of model None"),
    (GOOD | {"cpu": "x" * (MAX_TEXT + 1)}, "profile.cpu must be a string of at most"),
    (GOOD | {"runtime": 7}, "profile.runtime must be a string"),
    (GOOD | {"sample_s": [0.001, 0.002, 0.004]}, "profile.sample_s must be a map"),
    (GOOD | {"sample_s": {"1": 0.001, "2": 0.002}}, 'the keys "1".."3"'),
    (GOOD | {"sample_s": {"1": 0.001, "2": 0.002, "4": 0.004}}, 'the keys "1".."3"'),
    (GOOD | {"sample_s": {str(k): 0.001 for k in range(1, 10_001)}}, 'the keys "1".."3"'),
    (GOOD | {"sample_s": {"1": 0.001, "2": math.nan, "3": 0.004}}, "profile.sample_s[2] must be a finite number"),
    (GOOD | {"sample_s": {"1": 0.001, "2": 0.0, "3": 0.004}}, "profile.sample_s[2] must be"),
    (GOOD | {"sample_s": {"1": 0.001, "2": 1e9, "3": 0.004}}, "profile.sample_s[2] must be"),
    (GOOD | {"sample_s": {"1": True, "2": 0.002, "3": 0.004}}, "profile.sample_s[1] must be"),
    (GOOD | {"sample_s": {"1": "fast", "2": 0.002, "3": 0.004}}, "profile.sample_s[1] must be"),
])
def test_the_coordinator_refuses_each_bad_profile_with_its_reason(bad, why) -> None:
    problem = hello_profile_problem(bad, MODEL, K)
    assert problem is not None and why in problem, problem


def test_the_service_refuses_a_bad_profile_and_accepts_a_good_one_or_none(digits, tmp_path) -> None:
    cfg = tiny_config("resource", clients=2, rounds=1)
    cfg.round_timeout = 60.0
    transport = LoopbackTransport()
    service = coordinator_service(cfg, transport, tmp_path / "run", bundle=digits, min_devices=1)
    try:
        hello = {"backend": "torch", "num_samples": service.co.clients["client-000"], "capabilities": {}}
        peer = Peer(transport, "client-000", "sim-0")
        bad = peer.call("coordinator", "hello", 0, hello | {"profile": GOOD | {"sample_s": {"1": -1.0}}})
        assert bad.kind == "error" and 'the keys "1".."3"' in bad.body["reason"]
        assert service.registered == {} and service.co.strategy.reported == {}
        assert peer.call("coordinator", "hello", 0, hello | {"profile": GOOD}).kind == "ack"
        assert service.registered["client-000"]["profile"] == GOOD
        assert service.co.strategy.reported["client-000"] == pytest.approx({1: 0.001, 2: 0.002, 3: 0.004})
        other = Peer(transport, "client-001", "sim-0")
        plain = {"backend": "torch", "num_samples": service.co.clients["client-001"]}
        assert other.call("coordinator", "hello", 0, plain).kind == "ack"  # no profile: still a device of the run
        assert "profile" not in service.registered["client-001"]
        saved = json.loads((tmp_path / "run" / "devices.json").read_text())  # a resumed coordinator reads it back
        assert saved["client-000"]["profile"] == GOOD
        peer.send("coordinator", "bye", 0, {"reason": "shutting down"})  # its profile no longer counts (device_left)
        for _ in range(100):
            if "client-000" not in service.registered:
                break
            time.sleep(0.05)
        assert "client-000" not in service.registered and service.co.strategy.reported == {}
    finally:
        service.close()
    events = [json.loads(line) for line in (tmp_path / "run" / "coordinator.log").read_text().splitlines()]
    refused = [e for e in events if e["event"] == "hello_refused"]
    assert len(refused) == 1 and "profile.sample_s" in refused[0]["reason"]
    assert [e.get("profile") for e in events if e["event"] == "hello_ack"] == [GOOD, None]
    # a resumed coordinator tells its strategy what the restored devices reported; a profile gone bad is dropped
    saved["client-001"]["profile"] = GOOD | {"model": "vit_b16"}
    (tmp_path / "run" / "devices.json").write_text(json.dumps(saved))
    again = coordinator_service(cfg, LoopbackTransport(), tmp_path / "run", bundle=digits, resume=True)
    again.close()
    assert set(again.co.strategy.reported) == {"client-000"} and "profile" not in again.registered["client-001"]


# -- the resource strategy: a reported profile, then the fleet, then the draw -------------------------------------

CLIENTS = ["client-000", "client-001", "client-002"]
FLOPS = {0: 700, 1: 100, 2: 200, 3: 400}


def reported(scale: float) -> dict[str, Any]:
    return {"profile": hello_profile(report(scale), MODEL, K)}


def test_a_device_reporting_8x_slower_gets_a_shallower_split_than_its_draw_and_the_source_is_recorded() -> None:
    st = Resource(tiny_config("resource", speed_sigma=0.0), K, CLIENTS, FLOPS)  # the draw: every device at speed 1
    assert st.assign(1, CLIENTS) == {c: 2 for c in CLIENTS} and set(st.source.values()) == {"draw"}
    for cid, scale in zip(CLIENTS, (1.0, 1.0, 8.0)):
        st.device_registered(cid, reported(scale))
    assert st.assign(2, CLIENTS) == {"client-000": 2, "client-001": 2, "client-002": 1}  # budget: the median's p_ref
    assert st.speed["client-002"] == pytest.approx(1 / 8) and st.speed["client-000"] == pytest.approx(1.0)
    rec: dict[str, Any] = {}
    st.end_round({c: {} for c in CLIENTS}, rec)
    assert rec["speed_source"] == {c: "reported" for c in CLIENTS}
    assert rec["speed_factors"]["client-002"] == pytest.approx(0.125)
    st.device_registered("client-002", {"backend": "torch"})  # registers again without a profile: the draw again
    assert st.assign(3, CLIENTS)["client-002"] == 2 and st.source["client-002"] == "draw"
    assert st.speed["client-002"] == 1.0


def test_a_device_that_said_bye_no_longer_sets_the_reporters_median() -> None:
    """Without --profile the budget is the reporters' median p_ref: two slow reporters and a fast one put the fast one
    deepest; once both slow ones leave, the fast one is the median again (p_ref), and the leavers are back on the draw."""
    st = Resource(tiny_config("resource", speed_sigma=0.0), K, CLIENTS, FLOPS)
    for cid, scale in zip(CLIENTS, (0.25, 1.0, 1.0)):
        st.device_registered(cid, reported(scale))
    assert st.assign(1, CLIENTS)["client-000"] == 3  # 4x faster than the median: p_3's 4 ms x 0.25 fits p_ref's 2 ms
    st.device_left("client-001")
    st.device_left("client-002")
    got = st.assign(2, CLIENTS)
    assert set(st.reported) == {"client-000"} and got["client-000"] == 2
    assert st.source["client-001"] == "draw" and st.speed["client-001"] == 1.0


def test_with_the_coordinators_profile_one_slow_reporter_is_measured_against_it(tmp_path) -> None:
    """--profile is the median device's table: alone among the devices, an 8x slower reporter still goes shallower
    (without it the budget would be the reporters' own median, i.e. its own p_ref)."""
    median = write(tmp_path / "median.json", report())
    fleet = tmp_path / "fleet.toml"
    fleet.write_text('[classes.pi]\ncount = 3\ngflops = 4.0\nuplink_mbps = 10\ndownlink_mbps = 10\nrtt_ms = 5\n')
    st = Resource(tiny_config("resource", profile=str(median), fleet=str(fleet)), K, CLIENTS, FLOPS)
    fleet_splits = st.assign(1, CLIENTS)
    assert st.budget_s == pytest.approx(split_latency(report(), K)[2])
    st.device_registered("client-002", reported(8.0))
    got = st.assign(2, CLIENTS)
    assert fleet_splits == {c: 2 for c in CLIENTS} and got["client-002"] == 1  # one class: all median devices
    assert {c: got[c] for c in CLIENTS[:2]} == {c: fleet_splits[c] for c in CLIENTS[:2]}
    assert st.source == {"client-000": "fleet", "client-001": "fleet", "client-002": "reported"}


# -- end to end: agents started with their profiles, the service, one round -------------------------------------

def test_agents_report_their_profiles_and_the_round_uses_them(digits, tmp_path) -> None:
    cfg = tiny_config("resource", rounds=1, max_batches=1, speed_sigma=0.0)
    cfg.round_timeout = 120.0
    transport = LoopbackTransport()
    service = coordinator_service(cfg, transport, tmp_path / "run", bundle=digits, register_timeout=60)
    service.start()
    agents = []
    try:
        for i, scale in enumerate((1.0, 1.0, 8.0)):
            path = write(tmp_path / f"client-{i:03d}.json", report(scale))
            agents.append(device_agent(cfg, i, transport, tmp_path / f"state-{i}", bundle=digits, latency_profile=path))
            agents[-1].start(timeout=30)
        service.wait(180)
    finally:
        for a in agents:
            a.stop()
    (rec,) = service.records
    assert rec["failures"] == {} and rec["splits"] == {"client-000": 2, "client-001": 2, "client-002": 1}
    assert rec["speed_source"] == {c: "reported" for c in CLIENTS}
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["speed_source"] == rec["speed_source"]
    with pytest.raises(ProfileError, match="measured model 'vit_tiny_c32'"):  # a wrong one: no agent, no hello
        device_agent(cfg, 0, transport, tmp_path / "state-x", bundle=digits,
                     latency_profile=write(tmp_path / "vit.json", report(arch="vit_tiny_c32")))


def test_a_profile_the_caller_has_read_is_not_read_again(digits, tmp_path) -> None:
    # the device command checks the file before it connects and hands its JSON on: the agent must use that
    # JSON, not open the path a second time (here the path no longer exists)
    cfg = tiny_config("resource", rounds=1, max_batches=1, speed_sigma=0.0)
    agent = device_agent(cfg, 0, LoopbackTransport(), tmp_path / "state", bundle=digits,
                         latency_profile=tmp_path / "gone.json", latency_report=report(8.0))
    try:
        assert agent.profile["model"] == MODEL and len(agent.profile["sample_s"]) == K
    finally:
        agent.log.close()
