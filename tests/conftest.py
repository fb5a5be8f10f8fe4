"""Shared test setup."""

import fcntl
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

# Tests run tiny models; one intra-op thread avoids oversubscription when other work shares the
# two cores (torch's spinning thread pool slowed small steps ~5x under load) and keeps runs exact.
torch.set_num_threads(1)
# The same for the processes the tests start (coordinators, devices, trials, the README's commands): torch
# reads OMP_NUM_THREADS when it starts. Three workers each running processes with torch's default two
# threads on two cores oversubscribed the machine (the README's simulate took 262 s in the suite, 171 s
# alone on one thread). A test that sets its own value keeps it.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_SHARED = pytest.StashKey[str]()


@pytest.fixture(scope="session")
def digits():
    """The bundled digits data set, loaded once for every test that trains on it."""
    from fedsga_edge.data import load_dataset

    return load_dataset("digits")


# -- one folder per run, shared by pytest-xdist's workers ------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    """``FEDSGA_TEST_SHARED``: one folder per run for what is built once and shared (the exports of
    tests/_export_artifacts.py) and for the locks below. Made by the main process before pytest-xdist
    starts its workers, which inherit it through the environment; removed when the run ends."""
    if hasattr(config, "workerinput"):
        return
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist's main process: keep our file order
        config.option.loadscopereorder = False
    if os.environ.get("FEDSGA_TEST_SHARED"):
        return
    root = tempfile.mkdtemp(prefix="fedsga-tests-")
    os.environ["FEDSGA_TEST_SHARED"] = root
    config.stash[_SHARED] = root


def pytest_unconfigure(config: pytest.Config) -> None:
    root = config.stash.get(_SHARED, None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)
        os.environ.pop("FEDSGA_TEST_SHARED", None)


# -- the longest files first -----------------------------------------------------------------------------

# pytest-xdist (``--dist loadfile``) hands out whole files in collection order (we turn off its own
# order, by test count, which put the slowest files last, so one worker ran alone at the end). These
# files, longest first, lead; the rest keep pytest's order. A file missing here just runs later.
# test_backward_graph builds the train export (the slowest fixture) for the other three files that use
# it (test_onnx_device, test_device_runtime, test_profile); they come after it so that they rarely wait.
# Seconds per file on 3 workers on the 2 cores (1,386 s of tests in all): trial 138, simulation
# 115, local_data 90, backward_graph 78, accuracy_bench 64, backbones 63, hostile 63, rounds 59, faults 56,
# fleet_trial 50, resume 50, fleet 47, strategies 46, baselines_fedgh_fedas 42, onnx_device 39, diagnostics
# 37, method_calibration 30, models 29, baselines_split 26, field 22; the rest under 20 each. With only the
# first eleven listed, one worker ran 512 s of tests while the other two ran 435-440 (the long unlisted
# files came last): longest first is what keeps the workers level.
RUN_FIRST = ("test_backward_graph.py", "test_trial.py", "test_simulation.py", "test_local_data.py",
             "test_accuracy_bench.py", "test_backbones.py", "test_hostile.py", "test_rounds.py", "test_faults.py",
             "test_fleet_trial.py", "test_resume.py", "test_fleet.py", "test_strategies.py",
             "test_baselines_fedgh_fedas.py", "test_onnx_device.py", "test_diagnostics.py",
             "test_method_calibration.py", "test_models.py", "test_baselines_split.py", "test_field.py",
             "test_baselines.py", "test_fuzz.py", "test_label_memory.py")
# (test_strategies.py's throwaway strategy no longer leaks its option into later apps: runflags builds a
# new command function each time, so it needs no place in this order.)


FULL = bool(os.environ.get("FEDSGA_EDGE_FULL_TESTS"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``full`` are skipped, with their reason, unless FEDSGA_EDGE_FULL_TESTS=1 (the README's
    "Tests" section lists them); under pytest-xdist, the longest files first."""
    for item in items:
        mark = item.get_closest_marker("full")
        if mark is not None and not FULL:
            why = mark.args[0] if mark.args else "minutes"
            item.add_marker(pytest.mark.skip(reason=f"{why} (FEDSGA_EDGE_FULL_TESTS=1 runs it)"))
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # one process: pytest's own order
        return
    rank = {name: i for i, name in enumerate(RUN_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file is kept


# -- tests that measure time run alone -------------------------------------------------------------------


@pytest.hookimpl(wrapper=True, tryfirst=True)  # outermost: pytest-timeout's clock starts after the wait
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Under pytest-xdist, a test marked ``exclusive`` (it measures latency against a fixed bound) runs
    while no other worker runs a test: every test holds a shared lock from its setup to its teardown, an
    exclusive one the exclusive lock. A turnstile in front keeps the workers from starving it (a waiting
    exclusive test holds it, so the others' next tests queue behind it)."""
    root = os.environ.get("FEDSGA_TEST_SHARED")
    if not root or not os.environ.get("PYTEST_XDIST_WORKER"):
        return (yield)
    exclusive = item.get_closest_marker("exclusive") is not None
    with open(Path(root) / "turnstile.lock", "w") as gate, open(Path(root) / "running.lock", "w") as running:
        fcntl.flock(gate, fcntl.LOCK_EX)
        if not exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)
        fcntl.flock(running, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        if exclusive:
            fcntl.flock(gate, fcntl.LOCK_UN)
        return (yield)  # the files close (and the locks go) after the test's teardown
