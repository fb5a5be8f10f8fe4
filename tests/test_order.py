"""The simulated round's device order (``--device-order``, docs/method.md "Rounds").

With a fixed order client-000 stepped the shared server copy first in every round and the last device
last; the default draws a permutation per round from the seed on its own random stream. The first
tests step fake devices (no training: milliseconds); the last runs the simulation to check the wiring.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _runs import tiny_config

from fedsga_edge.coordinator.clock import VirtualClock
from fedsga_edge.coordinator.scheduling import InProcessScheduler
from fedsga_edge.simulation import Simulation

IDS = [f"client-{i:03d}" for i in range(5)]


class _Device:
    """Needs two turns per round; logs each turn."""

    def __init__(self, cid: str, log: list[str]) -> None:
        self.cid, self.log, self.busy, self.left, self.last_error = cid, log, False, 0, None

    def step(self) -> bool:
        self.log.append(self.cid)
        self.left -= 1
        self.busy = self.left > 0
        return self.busy

    def abort(self) -> None:
        self.busy = False


class _Round:
    """What the scheduler reads of the coordinator: the round, its deadline check and whether it is over."""

    def __init__(self, t: int, devices: list[_Device]) -> None:
        self.round, self.devices = SimpleNamespace(t=t), devices

    def tick(self, now: float) -> list:
        return []

    @property
    def round_complete(self) -> bool:
        return not any(d.busy for d in self.devices)


def turns(order: str, seed: int, rounds: int = 4, schedule: str = "round_robin",
          ids: list[str] = IDS) -> list[list[str]]:
    """Each round's turns, device ids in the order they stepped."""
    log: list[str] = []
    devices = [_Device(c, log) for c in ids]
    sched = InProcessScheduler(devices, schedule, np.random.default_rng([seed, 13]), order=order, seed=seed)
    out = []
    for t in range(1, rounds + 1):
        for d in devices:
            d.busy, d.left = True, 2
        co = _Round(t, devices)
        log.clear()
        sched.advance(co, VirtualClock(per_step=1.0), lambda out: None)
        out.append(list(log))
    return out


def first_turns(rounds: list[list[str]]) -> list[tuple[str, ...]]:
    """Each round's device order: the devices in the order of their first turn."""
    return [tuple(dict.fromkeys(r)) for r in rounds]


def test_same_seed_same_orders_another_seed_others() -> None:
    a, b, c = turns("shuffled", 0), turns("shuffled", 0), turns("shuffled", 1)
    assert a == b
    assert first_turns(a) != first_turns(c)
    assert all(sorted(o) == IDS for o in first_turns(a))  # a permutation: every device, once


def test_rounds_get_different_orders() -> None:
    orders = first_turns(turns("shuffled", 0, rounds=6))
    assert len(set(orders)) >= 4, orders  # 5 devices: 120 orders; six draws from one seed, not one order
    assert any(o != tuple(IDS) for o in orders)


@pytest.mark.parametrize("schedule", ["round_robin", "sequential"])
def test_fixed_is_the_partition_order_every_round(schedule: str) -> None:
    fixed = turns("fixed", 0, schedule=schedule)
    expect = IDS * 2 if schedule == "round_robin" else [c for c in IDS for _ in range(2)]
    assert fixed == [expect] * 4
    assert turns("shuffled", 0, schedule=schedule) != fixed


def test_an_unknown_order_is_refused_when_built() -> None:
    with pytest.raises(ValueError, match="device order"):
        InProcessScheduler([], "round_robin", np.random.default_rng(0), order="sorted")


def _run(sim: Simulation) -> tuple[list[tuple[str, ...]], list[dict[str, int]]]:
    """Run the simulation: each round's devices in the order the coordinator got their first
    activation, and each round's splits."""
    seen: list[tuple[int, str]] = []
    receive = sim.coordinator.receive

    def spy(msg: Any, now: float | None = None) -> Any:
        if msg.kind == "activation":
            seen.append((msg.round, msg.sender))
        return receive(msg, now)

    sim.coordinator.receive = spy
    sim.transport._handlers["coordinator"] = sim.peer.serve(spy)
    splits = [rec["splits"] for rec in sim.rounds()]
    return [tuple(dict.fromkeys(c for t, c in seen if t == r)) for r in range(1, len(splits) + 1)], splits


def test_simulate_takes_the_order_from_the_config_and_moves_no_other_draw(digits) -> None:
    """The default config shuffles per round, ``fixed`` keeps partition order; the order has its own
    random stream, so the random strategy's splits are the same either way."""
    def cfg(**kw: Any):
        return tiny_config("random", clients=4, rounds=3, batch_size=16, max_batches=1, **kw)

    shuffled, shuffled_splits = _run(Simulation(cfg(), digits))
    fixed, fixed_splits = _run(Simulation(cfg(device_order="fixed"), digits))
    assert fixed == [tuple(IDS[:4])] * 3
    assert shuffled == first_turns(turns("shuffled", 0, rounds=3, ids=IDS[:4])) and shuffled != fixed
    assert shuffled_splits == fixed_splits

