"""``simulate --engine ray``: the devices on Ray actors give the in-process engine's run, bit for bit.

The Ray tests need the scale extra (``pip install -e '.[scale]'``) and skip without it; one local Ray
(two CPUs) serves the module: starting it takes 15-25 s on a small machine.
"""

from __future__ import annotations

import sys

import pytest
import torch
from _runs import tiny_config
from typer.testing import CliRunner

from fedsga_edge.coordinator.clock import VirtualClock
from fedsga_edge.simulation import Simulation


@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture
def one_thread():
    """The bit-identical runs need the same torch thread count on both sides."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _run(cfg, digits, engine=None, clock=None):
    sim = Simulation(cfg, digits, engine=engine, clock=clock)
    records = list(sim.rounds())
    return records, {n: v.clone() for n, v in sim.model.state_dict().items()}, sim


# Ray starts in 15-25 s here: the tests that need it run with the `full` ones (.ci/run installs the scale extra).
RAY = pytest.mark.full("starts a local Ray (15-25 s) and runs each engine")

MEASURED = ("wall_s", "round_s")  # host seconds (round_s: the virtual clock advanced by measured step times)


def _same(a, b) -> None:
    (ra, wa, _), (rb, wb, _) = a, b
    for x, y in zip(ra, rb, strict=True):
        x, y = ({k: v for k, v in r.items() if k not in MEASURED} for r in (x, y))
        assert x == y
    assert wa.keys() == wb.keys()
    for n in wa:
        assert torch.equal(wa[n], wb[n]), n


@RAY
@pytest.mark.slow
def test_ray_engine_gives_the_in_process_run(ray_local, digits, one_thread) -> None:
    """Metrics and the global weights of two rounds (per-client server copies, FedSGA's probes and
    calibration included) equal the in-process engine's; the devices' state comes back to the driver."""
    from fedsga_edge.rayengine import RayDevice, RayEngine

    cfg = tiny_config("fedsga", clients=3, rounds=2, max_batches=2, server_copies="per_client")
    engine = RayEngine(actors=2)
    try:
        ray_run = _run(cfg, digits, engine)
    finally:
        engine.close()
    _same(_run(cfg, digits), ray_run)
    devices = ray_run[2].clients
    assert all(isinstance(d, RayDevice) and d.state is not None and not d.busy for d in devices)
    assert len({d.actor._actor_id.hex() for d in devices}) == 2  # device i on actor i % 2


@RAY
def test_the_pool_starts_beside_the_driver_and_fits_the_run(ray_local, digits, one_thread) -> None:
    """The actors start on the engine's own thread as it is made; the run's plan trims the pool to its devices
    and each actor builds its devices before round 1; an engine closed before any device leaves the Ray it
    found running as it was."""
    from fedsga_edge.rayengine import RayEngine

    unused = RayEngine(actors=2)
    unused.close()
    assert ray_local.is_initialized() and not unused.ready and unused.init_s > 0
    engine = RayEngine(actors=3)
    try:
        sim = Simulation(tiny_config("static", clients=2, rounds=1, max_batches=1), digits, engine=engine)
        assert engine.ready and len(engine.pool) == 2  # 3 actors asked for, 2 devices
        assert 0 <= engine.waited_s <= engine.setup_s and engine.init_s <= engine.setup_s
        built = ray_local.get([a.__ray_call__.remote(lambda w: sorted(w.clients)) for a in engine.pool])
        assert built == [[0], [1]]
        assert len(list(sim.rounds())) == 1
    finally:
        engine.close()
    assert engine.pool == [] and ray_local.is_initialized()


@RAY
@pytest.mark.slow
def test_a_deadline_undoes_the_steps_run_ahead(ray_local, digits, one_thread) -> None:
    """One virtual second per step and a deadline mid-round: the devices dropped at the deadline had their
    next step computed ahead on the actors; it is undone, and both rounds match the in-process run."""
    from fedsga_edge.rayengine import RayEngine

    # 3 devices x 6 requests in turn: at 16.5 s two devices have sent their update, the third has computed
    # its own ahead (FedSGA's private state moved on the actor) and is dropped; round 2 runs on that state
    cfg = tiny_config("fedsga", clients=3, rounds=2, max_batches=3, round_timeout=16.5)
    engine = RayEngine(actors=2)
    try:
        ray_run = _run(cfg, digits, engine, VirtualClock(per_step=1.0))
    finally:
        engine.close()
    local = _run(cfg, digits, None, VirtualClock(per_step=1.0))
    assert len(local[0][0]["failures"]) == 1 and len(local[0][1]["splits"]) == 3  # the deadline did cut round 1
    _same(local, ray_run)
    _same_devices(local[2].clients, ray_run[2].clients)


def _same_devices(clients, devices) -> None:
    """Each device's private state in the driver is the in-process device's."""
    import numpy as np

    from fedsga_edge.device.statefile import Snapshot

    for c, d in zip(clients, devices, strict=True):
        mine, theirs = Snapshot.take(c), d.state[0]
        assert mine.rng == theirs.rng and np.array_equal(mine.backend_rng, theirs.backend_rng), c.cid
        for f in ("prompts", "m_prev", "m_last", "H_prev", "r_prev", "rounds"):
            a, b = getattr(mine.state, f, None), getattr(theirs.state, f, None)
            assert (a is None and b is None) or np.array_equal(a, b), (c.cid, f)


def test_without_ray_simulate_says_what_to_install(monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    from fedsga_edge.cli.main import app

    res = CliRunner().invoke(app, ["simulate", "--engine", "ray", "--dataset", "digits", "--clients", "2",
                                   "--rounds", "1", "--quiet", "--out", str(tmp_path / "run")])
    assert res.exit_code == 2
    assert "fedsga-edge[scale]" in res.output


def test_engine_flags_are_checked(tmp_path) -> None:
    from fedsga_edge.cli.main import app

    res = CliRunner().invoke(app, ["simulate", "--engine", "spark", "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and "--engine must be inprocess or ray" in res.output
    res = CliRunner().invoke(app, ["simulate", "--ray-address", "auto", "--out", str(tmp_path / "r")])
    assert res.exit_code == 2 and "need --engine ray" in res.output


@RAY
@pytest.mark.slow
def test_simulate_engine_ray_writes_the_run(ray_local, tmp_path) -> None:
    """The command line's engine: the run's files as with the in-process engine; the local Ray it found
    running is left running."""
    import json

    from fedsga_edge.cli.main import app

    out = tmp_path / "run"
    res = CliRunner().invoke(app, ["simulate", "--engine", "ray", "--ray-actors", "1", "--dataset", "digits",
                                   "--clients", "2", "--rounds", "1", "--width", "0.125", "--max-batches", "1",
                                   "--threads", "1", "--quiet", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "ray engine: 1 actors" in res.output
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1 and len(rows[0]["splits"]) == 2 and rows[0]["failures"] == {}
    assert ray_local.is_initialized()
