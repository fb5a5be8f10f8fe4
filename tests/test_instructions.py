"""The strategy contract's round start (coordinator/instructions.py): one typed ``Instruction`` per device,
core fields a method cannot overwrite, and a learning-rate schedule that reaches the devices and the server."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _coordinator import bodies
from _runs import tiny_config

from fedsga_edge.config import TrainConfig
from fedsga_edge.coordinator.instructions import CORE_FIELDS, Instruction, check_instructions, round_start_body
from fedsga_edge.coordinator.strategy import Method, Strategy, register_strategy, unregister_strategy
from fedsga_edge.simulation import Simulation
from fedsga_edge.wire import Outgoing


class _AtOne(Strategy):
    """Every device at p_1; the throwaway strategies below change one thing each."""

    @classmethod
    def methods(cls) -> dict[str, Method]:
        return {cls.name: Method(cls.name, default=False)}

    def assign(self, t: int, clients: list[str]) -> dict[str, int | None]:
        return {c: 1 for c in clients}


class SplitThroughAField(_AtOne):
    """Tries to move every device to p_3 through a method field instead of the instruction's split."""

    name = "split-through-a-field-test"

    def configure_round(self, t: int, devices: list[str]) -> dict[str, Instruction]:
        return {cid: i.with_fields(split=3) for cid, i in super().configure_round(t, devices).items()}


class OwnRate(_AtOne):
    """Sets its devices' rate itself, in the instruction: the coordinator must send it as it is."""

    name = "own-rate-test"

    def configure_round(self, t: int, devices: list[str]) -> dict[str, Instruction]:
        return {cid: i.with_train(lr=0.042) for cid, i in super().configure_round(t, devices).items()}


class WarmUp(_AtOne):
    """A linear learning-rate warm-up over the first three rounds: 1/3, 2/3, then the full rate."""

    name = "warm-up-test"

    def lr_scale(self, t: int) -> float:
        return min(t, 3) / 3


@pytest.fixture
def registered(request: pytest.FixtureRequest) -> Iterator[type[Strategy]]:
    cls = request.param
    register_strategy(cls)
    try:
        yield cls
    finally:
        unregister_strategy(cls.name)


@pytest.mark.parametrize("registered", [SplitThroughAField], indirect=True)
def test_a_method_field_cannot_set_the_split(registered, digits) -> None:
    sim = Simulation(tiny_config(registered.name, rounds=1), digits)
    with pytest.raises(ValueError, match="method field 'split' would overwrite the round_start's core field 'split'"):
        sim.coordinator.begin_round(1)


@pytest.mark.parametrize("registered", [OwnRate], indirect=True)
def test_the_coordinator_sends_a_strategy_chosen_rate_as_it_is(registered, digits) -> None:
    sim = Simulation(tiny_config(registered.name, rounds=2, lr_schedule="cosine"), digits)
    out = sim.coordinator.begin_round(2)
    assert {b["train"]["lr"] for b in bodies(out).values()} == {0.042}


@pytest.mark.parametrize("key", sorted(CORE_FIELDS))
def test_no_core_field_is_a_method_field(key: str) -> None:
    with pytest.raises(ValueError, match=f"core field '{key}'"):
        Instruction(1, TrainConfig(), {key: 1})
    with pytest.raises(ValueError, match=f"core field '{key}'"):
        Instruction(1, TrainConfig()).with_fields(**{key: 1})


def test_an_instruction_is_checked_and_cannot_be_changed_after_construction() -> None:
    i = Instruction(2, TrainConfig(lr=0.05), {"method": {"name": "fedgh"}})
    with pytest.raises(TypeError):
        i.fields["split"] = 3  # type: ignore[index]
    with pytest.raises(ValueError, match="must be a map naming"):
        Instruction(2, TrainConfig(), {"method": {"settings": 1}})
    with pytest.raises(ValueError, match="split must be None or an integer"):
        Instruction(True, TrainConfig())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="must be a TrainConfig"):
        Instruction(1, {"lr": 0.1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one Instruction per device"):
        check_instructions({"a": i}, ["a", "b"])
    with pytest.raises(ValueError, match="not an Instruction"):
        check_instructions({"a": 1}, ["a"])
    body = round_start_body(i, {}, evaluate=True)
    assert body == {"split": 2, "full": False, "train": TrainConfig(lr=0.05).to_wire(), "weights": {},
                    "fedsga": None, "method": {"name": "fedgh"}, "evaluate": True}
    assert round_start_body(Instruction(0, TrainConfig()), {}, evaluate=False)["split"] is None


@pytest.mark.parametrize("registered", [WarmUp], indirect=True)
def test_a_warm_up_reaches_the_devices_and_the_server_alike(registered, digits) -> None:
    sim = Simulation(tiny_config(registered.name, rounds=3), digits)
    co, base = sim.coordinator, sim.cfg.train.lr
    sent: list[list[float]] = []
    trained: dict[int, list[float]] = {}
    server: dict[int, set[float]] = {}
    begin, step = co.begin_round, co.server.step

    def begin_round(t: int, *args: Any, **kw: Any) -> Outgoing:
        out = begin(t, *args, **kw)
        sent.append([b["train"]["lr"] for b in bodies(out).values()])
        return out

    def server_step(*args: Any, **kw: Any) -> Any:
        server.setdefault(co.round.t, set()).update(g["lr"] for g in co.server.shared.opt.param_groups)
        return step(*args, **kw)

    for client in sim.clients:
        def train_begin(cfg: TrainConfig, *a: Any, _orig: Any = client.backend.train_begin, **kw: Any) -> None:
            trained.setdefault(co.round.t, []).append(cfg.lr)
            return _orig(cfg, *a, **kw)

        client.backend.train_begin = train_begin
    co.begin_round, co.server.step = begin_round, server_step
    records = list(sim.rounds())
    assert len(records) == 3 and all(not r["failures"] for r in records)
    want = [base / 3, 2 * base / 3, base]
    assert sent == [pytest.approx([w] * 3) for w in want]
    assert [trained[t] for t in (1, 2, 3)] == [pytest.approx([w] * 3) for w in want]
    assert [sorted(server[t]) for t in (1, 2, 3)] == [pytest.approx([w]) for w in want]
    assert sim.cfg.train.lr == base  # the run's own setting is untouched


def test_the_round_start_arms_one_device_side_fedsgas_by_its_settings_field() -> None:
    from fedsga_edge.config import FedSGAConfig
    from fedsga_edge.device.fedsga import FedSGADevice
    from fedsga_edge.device.methods import FedGHDevice, check_method, device_method
    from fedsga_edge.device.role import check_round_start
    from fedsga_edge.wire import RemoteProtocolError

    fixed = {"split": 2, "full": False, "train": TrainConfig().to_wire(), "weights": {},
             "fedsga": dict(vars(FedSGAConfig()))}
    assert check_method(fixed) is FedSGADevice and isinstance(device_method(fixed), FedSGADevice)
    assert check_method(dict(fixed, fedsga=None)) is None and device_method(dict(fixed, fedsga=None)) is None
    assert isinstance(device_method(dict(fixed, fedsga=None, method={"name": "fedgh"})), FedGHDevice)
    check_round_start(fixed)
    with pytest.raises(RemoteProtocolError, match="arms two device sides"):
        check_round_start(dict(fixed, method={"name": "fedgh"}))
    with pytest.raises(RemoteProtocolError, match="KeyError: 'estimator'"):  # it chooses: it needs Gamma
        check_round_start(dict(fixed, split=None))
    with pytest.raises(RemoteProtocolError, match="names no split and carries no FedSGA settings"):
        check_round_start(dict(fixed, split=None, fedsga=None))
