"""``--wire-format auto``: the planner picks each device's wire format with its split, for the round's
makespan; the round start carries it, the device and the coordinator send that device's tensors in it, and the
round's record keeps it. On the virtual clock (``simulate --fleet``) and digits, a few seconds a run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from _runs import tiny_config, write_fleet

from fedsga_edge.config import TrainConfig

# resnet18_cifar at width 0.125 (K = 3): p_1 sends 8192 values a sample each way, p_3 2048. A 1 Mbit/s link is the
# round's end at any split in fp32; over 200 Mbit/s the activations cost little in any format.
FAST = {"count": 2, "gflops": 50.0, "uplink_mbps": 200.0, "downlink_mbps": 400.0, "rtt_ms": 2.0}
SLOW_LINK = {"count": 2, "gflops": 50.0, "uplink_mbps": 1.0, "downlink_mbps": 1.0, "rtt_ms": 2.0}


def _config(fleet: str, **kw: object) -> object:
    return tiny_config("planner", clients=4, rounds=2, width=0.125, fleet=fleet, server_copies="per_client",
                       wire_format="auto", train=TrainConfig(local_epochs=1, batch_size=16, max_batches=2), **kw)


def test_a_slow_link_gets_a_smaller_format_and_a_fast_link_keeps_fp32(tmp_path: Path) -> None:
    from fedsga_edge.coordinator.planning import split_loads
    from fedsga_edge.simulation import Simulation

    sim = Simulation(_config(write_fleet(tmp_path / "f.toml", {"fast": FAST, "slow_link": SLOW_LINK})))
    classes = sim.scheduler.classes
    slow = [c for c in sim.client_ids if classes[c].name == "slow_link"]
    fast = [c for c in sim.client_ids if classes[c].name == "fast"]
    for rec in sim.rounds():
        plan = rec["plan"]
        assert all(plan[c]["wire_format"] == "fp32" for c in fast), plan  # the round does not wait on them
        assert all(plan[c]["wire_format"] == "int4" for c in slow), plan  # the round's end: its fastest format
        for c in slow:  # the device sent its activations in int4 and the coordinator its gradients: the bytes show it
            k, tm = rec["splits"][c], rec["timing"][c]
            loads = {f: split_loads(sim.coordinator.costs, sim.coordinator.clients[c], sim.cfg, wire_format=f)[k]
                     for f in ("int4", "fp32")}
            assert tm["bytes_up"] == pytest.approx(loads["int4"].up, rel=0.15), (tm, loads)
            assert tm["bytes_down"] == pytest.approx(loads["int4"].down, rel=0.15), (tm, loads)
            assert tm["bytes_up"] < 0.5 * loads["fp32"].up
    # the coordinator's Peer sends each device's gradients in its own codec
    assert sim.coordinator.wire_formats == {c: "int4" for c in slow} | {c: "raw" for c in fast}
    assert sim.peer.formats == sim.coordinator.wire_formats


def test_an_unknown_or_misplaced_wire_format_is_a_clear_error() -> None:
    from fedsga_edge.config import TrainConfig as TC
    from fedsga_edge.coordinator.instructions import Instruction
    from fedsga_edge.device.role import check_round_start
    from fedsga_edge.runbuild import validate_config
    from fedsga_edge.wire import RemoteProtocolError

    with pytest.raises(ValueError, match="--wire-format auto needs --strategy planner"):
        validate_config(tiny_config("static", wire_format="auto"))
    validate_config(tiny_config("planner", wire_format="auto"))
    with pytest.raises(ValueError, match="Instruction.wire_format must be one of fp32, fp16, int8, int4"):
        Instruction(1, TC(), wire_format="fp8")
    body = {"split": 1, "full": False, "train": TC().to_wire(), "weights": {}, "fedsga": None}
    check_round_start(body | {"wire_format": "int8"})
    with pytest.raises(RemoteProtocolError, match="wire_format 'fp8' is none of fp32, fp16, int8, int4"):
        check_round_start(body | {"wire_format": "fp8"})


def test_on_the_crossed_fleet_no_fixed_split_is_fast_for_both_classes() -> None:
    """fleets/crossed-bench.toml (docs/fleet.md, "A fleet where the plan pays") on benchmarks/fleet.py's small
    preset: the slow processors are fastest at p_1, the slow uplinks at p_K, so the plan's predicted makespan is
    at most 0.61x the best fixed split's, and lower still with each device's own wire format."""
    from fedsga_edge.simulation import Simulation

    fleet = str(Path(__file__).resolve().parents[1] / "fleets" / "crossed-bench.toml")
    cfg = tiny_config("planner", clients=10, width=0.125, fleet=fleet, server_copies="per_client",
                      train=TrainConfig(local_epochs=1, batch_size=16))
    sim = Simulation(cfg)
    classes = sim.scheduler.classes
    one = {classes[c].name: c for c in sim.client_ids}
    assert set(one) == {"pi3_ethernet", "jetson_lte"}
    seconds = {name: sim.strategy.predicted(1, c) for name, c in one.items()}
    assert min(seconds["pi3_ethernet"], key=seconds["pi3_ethernet"].get) == 1
    assert min(seconds["jetson_lte"], key=seconds["jetson_lte"].get) == 3
    best_fixed = min(max(s[k] for s in seconds.values()) for k in (1, 2, 3))
    planned = max(min(s.values()) for s in seconds.values())
    assert planned <= 0.61 * best_fixed, (planned, best_fixed, seconds)

    sim.strategy.cfg = dataclasses.replace(cfg, wire_format="auto")
    sim.strategy.assign(1, sim.client_ids)
    plan = sim.strategy._plan
    auto = max(p["predicted_s"][str(p["split"])] for p in plan.values())
    assert auto < planned and {plan[c]["split"] for c in sim.client_ids if classes[c].name == "pi3_ethernet"} == {1}
    assert all(plan[c]["wire_format"] != "fp32" for c in sim.client_ids if classes[c].name == "jetson_lte")
