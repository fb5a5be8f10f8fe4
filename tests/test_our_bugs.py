"""Errors split by who broke the rules: only a device's ``RemoteProtocolError`` becomes a refusal.

A ``ValueError`` out of our own code (a strategy hook, the server's torch step) is a bug: ``simulate``
fails with it and no ``error`` reply reaches a device, whether the step is taken at once (static) or
held for a merged batch (MergeSFL). A device's bad input is still refused, round and run going on.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from _coordinator import only_reply
from _runs import loopback_field_run, tiny_config

from fedsga_edge.coordinator.strategies.mergesfl import MergeSFL
from fedsga_edge.coordinator.strategies.static import Static
from fedsga_edge.coordinator.strategy import register_strategy, unregister_strategy
from fedsga_edge.simulation import Simulation
from fedsga_edge.wire import Message


class _AfterStepBug:
    """A strategy whose ``after_step`` hook has a bug (a ValueError of its own)."""

    def after_step(self, Z: Any, y: Any, extra: Any) -> None:
        raise ValueError("our bug in after_step")


class _StepBug(_AfterStepBug, Static):
    """Static SplitFed with the bug."""

    name = "step-bug-test"
    help = "throwaway test strategy: after_step raises"
    label = "Step bug (test)"


class _MergedStepBug(_AfterStepBug, MergeSFL):
    """MergeSFL with the same bug: it surfaces when the merged step releases the held activations."""

    name = "merged-step-bug-test"
    help = "throwaway test strategy: MergeSFL whose after_step raises"
    label = "Merged step bug (test)"


class _EndRoundBug(Static):
    """Static SplitFed whose ``end_round`` hook has a bug."""

    name = "end-round-bug-test"
    help = "throwaway test strategy: end_round raises"
    label = "End-round bug (test)"

    def end_round(self, updates: dict[str, dict[str, Any]], record: dict[str, Any]) -> None:
        raise ValueError("our bug in end_round")


@pytest.fixture
def buggy() -> Iterator[None]:
    for cls in (_StepBug, _MergedStepBug, _EndRoundBug):
        register_strategy(cls)
    try:
        yield
    finally:
        for cls in (_StepBug, _MergedStepBug, _EndRoundBug):
            unregister_strategy(cls.name)


def _refusals(sim: Simulation) -> int:
    """``error`` messages the coordinator's Peer encoded (each a refusal sent to a device)."""
    return sim.peer.encoded_bytes.get("error", 0)


@pytest.mark.parametrize("name", [_StepBug.name, _MergedStepBug.name, _EndRoundBug.name])
def test_a_strategy_hook_raising_value_error_fails_simulate_and_refuses_nothing(buggy, name, digits) -> None:
    sim = Simulation(tiny_config(name, clients=2, rounds=1, max_batches=2), digits)
    hook = "end_round" if name == _EndRoundBug.name else "after_step"
    with pytest.raises(ValueError, match=f"our bug in {hook}"):
        sim.run_round(1)
    assert _refusals(sim) == 0 and sim.coordinator.remote_errors == 0


def test_a_devices_bad_activation_is_still_refused_and_the_round_goes_on(digits) -> None:
    """The other side of the split: validation raises RemoteProtocolError, which is a refusal."""
    sim = Simulation(tiny_config("static", clients=2, rounds=1, max_batches=2), digits)
    co = sim.coordinator
    co.begin_round(1, now=0.0)
    k = co.round.assigned["client-000"]
    z = np.full((4, *co.model.interface_shape(co.model.depth_of(k))), np.nan, np.float32)
    rep = only_reply(co.receive(Message("activation", "run", 1, 1, "client-000",
                                        {"z": z, "y": np.arange(4), "split": k}), now=0.0))
    assert rep.kind == "error" and "non-finite" in rep.body["reason"] and co.remote_errors == 1
    assert co.round.phase == "training" and "client-000" in co.round.waiting


def test_a_strategy_hook_raising_value_error_fails_the_field_run(buggy, digits, tmp_path) -> None:
    """The coordinator service (real time, device agents over the loopback): the bug stops the run, which
    fails with it (``wait`` raises it), and the coordinator refused no one."""
    cfg = tiny_config(_StepBug.name, clients=2, rounds=2, max_batches=2)
    cfg.round_timeout = 120.0
    with loopback_field_run(cfg, digits, tmp_path) as service, pytest.raises(ValueError, match="our bug in after_step"):
        service.wait(120)
    assert service.peer.encoded_bytes.get("error", 0) == 0 and service.co.remote_errors == 0
    assert len(service.records) <= 1  # stopped in its first round
